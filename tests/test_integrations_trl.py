"""TRL integration: GRPOTrainer plays concierge episodes, scores them with the review, trains on
kitchen's MAPO advantage — and that advantage is exactly `kitchen.mapo.advantages`."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from kitchen import paths
from kitchen.buffer import ReplayBuffer
from kitchen.config import KitchenError
from kitchen.integrations import launch
from kitchen.integrations.episodes import episode_tokens, job_pool
from kitchen.integrations.trl import (
    GRMReward,
    TRLRecipe,
    build_trainer,
    demo_policy,
    grpo_config,
    load_trl_recipe,
)
from kitchen.mapo import advantages
from kitchen.rollout import RolloutConfig, render_prompt, rollout
from kitchen.train import Recipe, RewardConfig, episode_rewards, step_samples

K = 4


def recipe(preset: str = "mapo", **over) -> Recipe:
    base = {
        "name": "trl-test",
        "seed": 3,
        "policy": {
            "path": "data/models/policy-tiny",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        },
        "reward": {"reviewer": "judge", "global_blend": 0.5},
        "rollout": {"k": K, "max_turns": 3, "max_new_tokens": 40},
        "advantage": {"preset": preset, "overrides": {"beta": 0.02, "state_key": "abstract"}},
        "buffer": {"capacity": 1000, "max_age": 4, "dedup": True},
        "train": {"iterations": 2, "tasks_per_iteration": 2, "task_pool": 8, "lr": 1e-2},
        "eval_every": 0,
    }
    for k, v in over.items():
        base[k] = base[k] | v if isinstance(base.get(k), dict) else v
    return Recipe.model_validate(base)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return demo_policy()


def oracle_advantages(buf: ReplayBuffer, samples, cfg, step: int) -> torch.Tensor:
    """The independent oracle: kitchen's path from step samples to advantages spelled out with
    the buffer's primitives — store, look up the state groups' history, `mapo.advantages` —
    rather than through `kitchen.steps.advantages_for`. Returns the fresh samples' advantages."""
    if not cfg.use_buffer:
        return advantages(samples.batch(cfg.state_key), cfg, step=step)[0]
    kept = buf.add(samples)
    history = buf.history(samples, by=cfg.state_key, exclude=kept)
    adv, _ = advantages(buf.batch(samples, history, by=cfg.state_key), cfg, step=step)
    return adv[: len(samples)]


def train(tmp_path, r: Recipe):
    model, tok = demo_policy()  # a fresh copy: TRL wraps the model it trains in an adapter
    trainer = build_trainer(
        TRLRecipe(kitchen=r, trl={"output_dir": str(tmp_path / "out")}), model=model, tokenizer=tok
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    moved = sum(
        (v.detach() - before[k]).abs().sum().item()
        for k, v in trainer.model.named_parameters()
        if k in before
    )
    return trainer, moved


def test_episode_row_holds_the_sampled_actions_in_what_the_policy_saw(policy):
    """prompt + completion up to turn t is the tokenised prompt of turn t, the action tokens are
    the sampled ones with their log-probs, and only trainable actions are in the mask."""
    model, tok = policy
    jobs = job_pool("constitutions/concierge.yaml", 4, seed=1)[:2]
    trajs, _ = rollout(model, tok, jobs, RolloutConfig(k=2, max_turns=3, max_new_tokens=40), seed=2)
    for t in trajs:
        row = episode_tokens(tok, t)
        ids = row.prompt_ids + row.completion_ids
        for ti in t.turns:
            s, e = row.spans[ti.turn]
            assert row.completion_ids[s:e] == ti.tokens
            assert row.logprobs[s:e] == (ti.logprobs if not ti.truncated else [0.0] * (e - s))
            assert set(row.mask[s:e]) == {int(not ti.truncated)}
            if row.drift == 0:
                seen = tok(
                    render_prompt(tok, t.prompt_messages(ti.turn)), add_special_tokens=False
                )["input_ids"]
                assert ids[: len(row.prompt_ids) + s] == seen
        assert sum(row.mask) == sum(len(ti.tokens) for ti in t.turns if not ti.truncated)


def test_grm_reward_has_trls_signature_and_logs_clauses(policy):
    """The reward is R per episode; per-clause pass rates go through log_metric, verdicts
    through log_extra."""
    model, tok = policy
    jobs = job_pool("constitutions/concierge.yaml", 4, seed=1)[:1]
    trajs, _ = rollout(model, tok, jobs, RolloutConfig(k=3, max_turns=3, max_new_tokens=40), seed=4)
    metrics, extra = {}, {}
    reward = GRMReward("judge", RewardConfig(reviewer="judge", global_blend=0.5))
    out = reward(
        prompts=[None] * 3,
        completions=[None] * 3,
        completion_ids=None,
        trajectory=trajs,
        constitution=[jobs[0][1]] * 3,
        log_metric=metrics.__setitem__,
        log_extra=extra.__setitem__,
    )
    assert len(out) == 3 and all(isinstance(x, float) for x in out)
    assert any(k.startswith("clause/") and k.endswith("_pass_rate") for k in metrics)
    assert len(extra["review/overall"]) == 3
    assert set(reward.last) == {t.id for t in trajs}
    with pytest.raises(KitchenError, match="rollout_func"):
        reward(prompts=[None], completions=[None])


@pytest.mark.parametrize("signal", ["return", "clauses"])
def test_two_trl_steps_move_the_weights_with_kitchens_advantages(tmp_path, signal):
    """Two GRPOTrainer steps on CPU: the adapter moved, and every turn's tokens carry exactly
    the advantage kitchen computes from the same episodes and reviews (the oracle: step samples →
    replay buffer → `mapo.advantages`), history from the first step included — with the local
    reward, and with each clause normalised on its own (`local_signal: clauses`)."""
    over = {"beta": 0.02, "state_key": "abstract", "local_signal": signal}
    r = recipe("mapo", advantage={"preset": "mapo", "overrides": over})
    trainer, moved = train(tmp_path, r)
    weights = trainer.kitchen_clauses
    assert trainer.state.global_step == 2 and moved > 0
    cfg = r.advantage.resolve()
    buf = ReplayBuffer(r.buffer)
    nonzero = 0
    for version, h in enumerate(trainer.history):
        trajs, pcs, groups = h["trajectories"], h["pcs"], h["groups"]
        rewards = episode_rewards(trajs, h["reviews"], pcs, r.reward)
        samples = step_samples(
            trajs, rewards, cfg, lambda i, g=groups: g[i], version=version, clause_weights=weights
        )
        assert (
            samples.traj == h["samples"].traj
            and samples.turn.tolist() == h["samples"].turn.tolist()
        )
        if version == 1:  # the second step's state groups include buffered history
            assert buf.history(samples, by=cfg.state_key).numel() > 0
        want = oracle_advantages(buf, samples, cfg, h["step"])
        buf.advance(version + 1)
        token_adv = h["token_advantages"]
        row = {t.id: i for i, t in enumerate(trajs)}
        for j, (key, turn) in enumerate(zip(samples.traj, samples.turn.tolist(), strict=True)):
            s, e = h["tokens"][row[key]].spans[turn]
            torch.testing.assert_close(token_adv[row[key], s:e], want[j].expand(e - s))
            nonzero += abs(want[j].item()) > 0
        trained = torch.zeros_like(token_adv, dtype=torch.bool)
        for i, tk in enumerate(h["tokens"]):
            for s, e in tk.spans.values():
                trained[i, s:e] = True
        assert token_adv[~trained].abs().sum() == 0  # nothing on environment tokens
    assert nonzero > 0


def test_grpo_preset_reproduces_trls_own_advantage(tmp_path):
    """With α = 0 and TRL's epsilon, kitchen's advantage on every turn of an episode equals the
    advantage TRL's GRPO gives the whole episode."""
    r = recipe(
        "grpo",
        advantage={"preset": "grpo", "overrides": {"beta": 0.02, "global_norm": {"eps": 1e-4}}},
        train={"iterations": 1},
        buffer={"dedup": False},
    )
    trainer, _ = train(tmp_path, r)
    h = trainer.history[-1]
    trl_adv = h["trl_advantages"]
    assert trl_adv.abs().sum() > 0
    row = {t.id: i for i, t in enumerate(h["trajectories"])}
    for key, turn in zip(h["samples"].traj, h["samples"].turn.tolist(), strict=True):
        i = row[key]
        s, e = h["tokens"][i].spans[turn]
        torch.testing.assert_close(
            h["token_advantages"][i, s:e], trl_adv[i].expand(e - s), atol=1e-5, rtol=1e-5
        )


def test_recipe_maps_to_grpo_config_and_rejects_what_trl_cannot_do():
    """One optimiser step per K × tasks episodes; loss aggregation → loss_type; clear errors."""
    args = grpo_config(recipe(), num_processes=1)
    assert args.num_generations == K and args.per_device_train_batch_size == 2 * K
    assert args.loss_type == "bnpo" and args.max_steps == 2 and args.beta == 0.02
    assert grpo_config(recipe("grpo")).loss_type == "grpo"
    clipped = recipe(advantage={"preset": "mapo", "overrides": {"beta": 0.02, "clip": 0.1}})
    assert grpo_config(clipped).epsilon == 0.1 and args.epsilon == 0.2  # TRL's own default
    with pytest.raises(KitchenError, match="processes"):
        grpo_config(recipe(), num_processes=3)
    with pytest.raises(KitchenError, match="replay_in_gradient"):
        grpo_config(recipe(advantage={"preset": "mapo", "overrides": {"replay_in_gradient": True}}))
    with pytest.raises(KitchenError, match="k3"):
        grpo_config(recipe(advantage={"preset": "mapo", "overrides": {"beta": 0.1, "kl": "k1"}}))
    with pytest.raises(KitchenError, match="keeps beta fixed"):
        grpo_config(
            recipe(advantage={"preset": "mapo", "overrides": {"beta": 0.1, "kl_target": 0.1}})
        )
    with pytest.raises(KitchenError, match="keep_checkpoints: TRL's Trainer"):
        grpo_config(recipe(keep_checkpoints=[1]))
    # the recipe's learning-rate schedule, not a constant one: cosine falls to lr_final · lr
    assert args.lr_scheduler_type == "constant"
    cos = grpo_config(
        recipe(
            train={
                "iterations": 2,
                "tasks_per_iteration": 2,
                "task_pool": 8,
                "lr": 1e-2,
                "lr_schedule": "cosine",
                "lr_final": 0.1,
            }
        )
    )
    assert cos.lr_scheduler_type == "cosine_with_min_lr"
    assert cos.lr_scheduler_kwargs == {"min_lr_rate": 0.1}


def test_shipped_launch_files_are_the_generated_ones():
    """recipes/scale/ holds exactly what `launch.write_files` generates, every accelerate
    config loads with accelerate's own parser, and every TRL recipe validates."""
    from accelerate.commands.config.config_args import ClusterConfig

    shipped = paths.HOME / "recipes" / "scale"
    for rel, text in launch.files().items():
        assert (shipped / rel).read_text() == text, f"regenerate {rel}: launch.write_files()"
        if rel.startswith("accelerate/"):
            cfg = ClusterConfig.from_yaml_file(str(shipped / rel))
            assert cfg.num_processes == cfg.num_machines * launch.GPUS_PER_NODE
        if rel.startswith("trl_") and rel.endswith(".yaml"):
            load_trl_recipe(str(shipped / rel)).resolve()
    verl = yaml.safe_load((shipped / "verl" / "mapo_qwen0.5b.yaml").read_text())
    assert verl["algorithm"]["adv_estimator"] == "mapo"
    assert verl["trainer"]["v1"]["trainer_mode"] == "kitchen_sync"


RANK_SCRIPT = """
import json, sys
from kitchen.integrations.trl import build_trainer, load_trl_recipe
tr = load_trl_recipe("recipes/scale/trl_tiny.yaml")
tr.trl.output_dir, tr.trl.grpo = sys.argv[1], {"max_steps": 1}
t = build_trainer(tr)
t.train()
h = t.history[-1]
out = {"type": str(t.accelerator.distributed_type), "procs": t.accelerator.num_processes,
       "buffer": len(t.kitchen_buffer), "local_rows": len(h["samples"]),
       "all_rows": len(h["all_advantages"]), "adv": h["all_advantages"].tolist()}
json.dump(out, open(f"{sys.argv[1]}/rank{t.accelerator.process_index}.json", "w"))
"""


@pytest.mark.slow  # ~30 s: two processes under torchrun
def test_two_processes_share_groups_and_buffer(tmp_path):
    """Two CPU processes (torchrun, gloo): each plays half the episodes, the step samples of
    both are gathered, and both compute the same advantages over the whole batch."""
    import json
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(script),
            str(tmp_path),
        ],
        cwd=paths.HOME,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["type"].endswith("MULTI_CPU") and r0["procs"] == 2
    assert r0["adv"] == r1["adv"] and r0["buffer"] == r1["buffer"]  # one batch, one buffer
    assert r0["all_rows"] == r0["local_rows"] + r1["local_rows"]


def test_07_scale_up_values():
    """Notebook 07 trains with TRL (the adapter moves), shows an episode row whose policy
    tokens are the sampled actions, lays out verl's rewards and lists every launch file."""
    from .test_notebooks import load_app

    _, defs = load_app("07_scale_up.py").run()
    assert defs["trainer"].state.global_step == 2 and defs["moved"] > 0
    row, trajs = defs["episode_row"], defs["sample_trajs"]
    assert sum(row.mask) == sum(len(t.tokens) for t in trajs[0].turns if not t.truncated)
    assert defs["row_frame"]["policy"].any() and (~defs["row_frame"]["policy"]).any()
    assert defs["layout_frame"]["slot"][-1] == "outcome"
    assert set(defs["launch_files"]) == set(launch.files())
    adv = defs["advantage_frame"]
    assert adv.height > 0 and adv["mapo"].abs().sum() > 0


def test_side_by_side_benchmark_runs_in_a_tiny_shape():
    """`benchmarks/bench_trl.py` still runs against the current loop and trainer (it patches
    their internals to time phases, so a refactor can break it): one update each, tiny work,
    the table printed with both columns and a ratio."""
    import subprocess
    import sys

    args = ["--threads", "1", "--iters", "1", "--warmup", "0", "--tasks", "1", "--k", "2"]
    args += ["--turns", "2", "--max-new-tokens", "16", "--trl-decoding", "engine"]
    res = subprocess.run(
        [sys.executable, str(paths.HOME / "benchmarks" / "bench_trl.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (
        "| wall time (s) |" in res.stdout
        and "same episodes at the first iteration: yes" in res.stdout
    )
