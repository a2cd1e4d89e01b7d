"""verl integration: the registered `mapo` estimator gives kitchen's advantages on the same batch.

Run in their own environment (`make test-verl`, part of `make test`): verl 0.9 needs an older
transformers than the kit's main environment.

Skipped where verl is not installed (it is an optional extra, `kitchen[verl]`). The agent-loop
test also needs verl's rollout extras (cachetools, TransferQueue, uvicorn) and skips without them.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos")

from omegaconf import OmegaConf  # noqa: E402

from kitchen import paths  # noqa: E402
from kitchen.buffer import ReplayBuffer  # noqa: E402
from kitchen.integrations import verl as kv  # noqa: E402
from kitchen.integrations.episodes import episode_tokens, job_pool  # noqa: E402
from kitchen.judge import judge  # noqa: E402
from kitchen.mapo import StepBatch, advantages, encode  # noqa: E402
from kitchen.models import ModelSpec, load_model  # noqa: E402
from kitchen.rollout import RolloutConfig, rollout  # noqa: E402
from kitchen.train import RewardConfig, episode_rewards, step_samples  # noqa: E402

POLICY = paths.DATA / "models" / "policy-tiny"
K = 4


@pytest.fixture(scope="module")
def episodes():
    """Two task groups of K concierge episodes of the shipped tiny policy, with their reviews."""
    torch.manual_seed(0)
    model, tok = load_model(ModelSpec(path=str(POLICY)))
    jobs = job_pool("constitutions/concierge.yaml", 6, seed=2)[:2]
    trajs, _ = rollout(model, tok, jobs, RolloutConfig(k=K, max_turns=4, max_new_tokens=40), seed=5)
    pcs = [pc for _, pc, _ in jobs for _ in range(K)]
    uids = [f"job{i // K}" for i in range(len(trajs))]
    return {"model": model, "tok": tok, "jobs": jobs, "trajs": trajs, "pcs": pcs, "uids": uids}


def verl_batch(ep, reward: RewardConfig):
    """The episodes as verl sees them: response mask, turn-reward layout, reward extra info."""
    rows = [episode_tokens(ep["tok"], t, tail=True) for t in ep["trajs"]]
    width = max(len(r.completion_ids) for r in rows) + 3  # some padding, as verl pads
    mask = torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        mask[b, : len(r.mask)] = torch.tensor(r.mask, dtype=torch.float32)
    scored = [
        kv.review_episode(t, pc, None, reward) for t, pc in zip(ep["trajs"], ep["pcs"], strict=True)
    ]
    last = [len(r.completion_ids) - 1 for r in rows]
    rewards = kv.layout([s.turns for s, _ in scored], [float(s) for s, _ in scored], mask, last)
    return mask, rewards, scored


def algo(preset: str, buffer: dict | None = None, **overrides):
    kitchen = {"advantage": {"preset": preset, "overrides": overrides}}
    return OmegaConf.create(
        {"adv_estimator": "mapo", "kitchen": kitchen | ({"buffer": buffer} if buffer else {})}
    )


def oracle_advantages(buf: ReplayBuffer, samples, cfg, step: int) -> torch.Tensor:
    """The independent oracle: kitchen's path from step samples to advantages spelled out with
    the buffer's primitives (store, the state groups' history, `mapo.advantages`) rather than
    through `kitchen.steps.advantages_for`. Returns the fresh samples' advantages."""
    kept = buf.add(samples)
    history = buf.history(samples, by=cfg.state_key, exclude=kept)
    adv, _ = advantages(buf.batch(samples, history, by=cfg.state_key), cfg, step=step)
    return adv[: len(samples)]


def test_everything_registers_through_verls_registries():
    """The estimator, reward manager, agent loop and trainer are found by verl's own getters."""
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    names = kv.register()
    assert isinstance(get_adv_estimator_fn("mapo"), kv.MAPOEstimator)
    assert get_reward_manager_cls("kitchen_grm").__name__ == "KitchenRewardManager"
    assert {"mapo", "kitchen_grm"} <= set(names)
    assert kv.register() == names  # idempotent


def test_the_clause_signal_is_refused_naming_what_verls_batch_lacks():
    """verl hands the estimator one reward per turn: `local_signal: clauses` is a clear error at
    configuration time, not a failure inside the first training step."""
    from pydantic import ValidationError

    node = {"advantage": {"preset": "mapo", "overrides": {"local_signal": "clauses"}}}
    with pytest.raises(ValidationError, match="per-clause verdicts"):
        kv.settings_from({"kitchen": node})


def test_turn_reward_layout_round_trips():
    """r_t on the last token of turn t and R on the last response token read back exactly."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0], [1, 0, 1, 1, 1, 0, 0, 0]])
    out = kv.layout([[0.5, -1.0], [1.0, 0.25]], [1.0, 0.0], mask, last=[6, 5])
    assert out[0].tolist() == [0, 0.5, 0, 0, -1.0, 0, 1.0, 0]
    spans, local, outcome = kv.read_layout(out, mask)
    assert spans == [[(0, 2), (4, 5)], [(0, 1), (2, 5)]]
    assert local == [[0.5, -1.0], [1.0, 0.25]] and outcome == [1.0, 0.0]
    with pytest.raises(Exception, match="inside an action"):
        kv.layout([[0.0]], [1.0], torch.tensor([[0, 1]]), last=[1])


def test_estimator_equals_kitchen_on_the_layout_alone(episodes, monkeypatch):
    """Through verl's public `compute_advantage`, with only rewards, mask and uids (no state keys):
    kitchen's `mapo.advantages` on the same rows, state groups = turn groups."""
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    kv.register()
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "mapo", kv.MAPOEstimator())
    reward = RewardConfig(reviewer="judge", global_blend=0.5, truncated="drop")  # as verl's rows
    mask, rewards, _ = verl_batch(episodes, reward)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array(episodes["uids"], dtype=object)},
    )
    cfg = algo("mapo", alpha={"kind": "constant", "alpha0": 0.5})
    got = compute_advantage(data, adv_estimator="mapo", config=cfg).batch["advantages"]

    spans, local, outcome = kv.read_layout(rewards, mask)
    b_of = [b for b, row in enumerate(spans) for _ in row]
    t_of = [t for row in spans for t in range(len(row))]
    lr = torch.tensor([local[b][t] for b, t in zip(b_of, t_of, strict=True)])
    batch = StepBatch(
        local_reward=lr,
        global_reward=torch.tensor([outcome[b] for b in b_of]),
        ret=lr,
        state=encode([f"{episodes['uids'][b]}|t{t}" for b, t in zip(b_of, t_of, strict=True)]),
        task_group=encode([episodes["uids"][b] for b in b_of]),
        traj=torch.tensor(b_of),
        turn=torch.tensor(t_of),
    )
    want, _ = advantages(batch, kv.settings_from(cfg).advantage.resolve(), step=0)
    assert want.abs().sum() > 0
    for n, (b, t) in enumerate(zip(b_of, t_of, strict=True)):
        s, e = spans[b][t]
        torch.testing.assert_close(got[b, s:e], want[n].expand(e - s))
    assert (got * (1 - mask)).abs().sum() == 0  # nothing on environment tokens


def test_estimator_with_state_keys_equals_kitchens_own_loop(episodes):
    """With the fields `KitchenSyncTrainer` hands over (state keys, validity, turn index), the
    estimator reproduces what `kitchen cook` computes — the oracle: step samples → replay buffer
    → advantages — over two calls, so the second one's state groups hold the first one's history
    and α's schedule moves."""
    reward = RewardConfig(reviewer="judge", global_blend=0.5, truncated="drop")  # as verl's rows
    mask, rewards, scored = verl_batch(episodes, reward)
    rm_scores = kv.layout(
        [[] for _ in scored],
        [float(s) for s, _ in scored],
        mask,
        [int(m.nonzero().max()) + 1 for m in mask],
    )  # verl: R only
    relaid, fields = kv.relayout(rm_scores, mask, [{"reward_extra_info": x} for _, x in scored])
    torch.testing.assert_close(kv.read_layout(relaid, mask)[1], kv.read_layout(rewards, mask)[1])
    # no de-duplication: the second call replays the same episodes, which would replace them all
    alpha = {"kind": "linear", "alpha0": 0.2, "alpha1": 0.6, "steps": 2}
    cfg = algo("mapo", buffer={"max_age": 8, "dedup": False}, alpha=alpha)
    estimator = kv.MAPOEstimator()

    adv_cfg = kv.settings_from(cfg).advantage.resolve()
    trajs, pcs = episodes["trajs"], episodes["pcs"]
    reviews = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    per_turn = episode_rewards(trajs, reviews, pcs, reward)
    buf = ReplayBuffer(kv.settings_from(cfg).buffer)
    spans = kv.turn_spans(mask)
    for call in range(2):
        uids = [f"{u}@{call}" for u in episodes["uids"]]  # verl's uids are new every step
        got, _ = estimator(relaid, mask, np.array(uids), cfg, non_tensor_batch=fields)
        samples = step_samples(trajs, per_turn, adv_cfg, lambda i, u=uids: u[i], version=call)
        if call == 1:
            assert buf.history(samples).numel() > 0
        want = oracle_advantages(buf, samples, adv_cfg, step=call)
        buf.advance(call + 1)
        row = {t.id: i for i, t in enumerate(trajs)}
        for n, (key, turn) in enumerate(zip(samples.traj, samples.turn.tolist(), strict=True)):
            i = row[key]
            span = json.loads(scored[i][1]["kitchen_turn_index"]).index(turn)
            s, e = spans[i][span]
            torch.testing.assert_close(got[i, s:e], want[n].expand(e - s))
        assert want.abs().sum() > 0
    assert estimator.calls == 2 and len(estimator.buffers) == 1


def test_reward_manager_reviews_an_agent_loop_episode(episodes):
    """`kitchen_grm` reads the episode from the agent loop's extra fields and returns R (a float
    for verl) with the turn rewards, state keys and clause pass rates as JSON extra info."""
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    t, pc = episodes["trajs"][0], episodes["pcs"][0]
    cfg = OmegaConf.create({"kitchen": {"reward": {"reviewer": "judge", "global_blend": 0.5}}})
    manager = get_reward_manager_cls("kitchen_grm")(cfg, episodes["tok"])
    extra = {
        "kitchen_trajectory": t.model_dump_json(),
        "kitchen_constitution": pc.model_dump_json(),
    }
    data = DataProto.from_dict(
        tensors={"responses": torch.zeros(1, 4, dtype=torch.long)},
        non_tensors={"tool_extra_fields": np.array([extra], dtype=object)},
    )
    out = manager.loop.run_until_complete(manager.run_single(data))  # verl's own event loop
    score, info = kv.review_episode(t, pc, None, RewardConfig(reviewer="judge", global_blend=0.5))
    assert isinstance(out["reward_score"], float) and out["reward_score"] == float(score)
    assert json.loads(out["reward_extra_info"]["kitchen_turn_rewards"]) == score.turns
    assert set(json.loads(info["kitchen_clause_pass"])) <= set(pc.ids)


def test_agent_loop_plays_an_episode_through_a_server(episodes):
    """`kitchen_concierge` plays the world through an LLM server (here the HF model behind a
    stand-in for verl's server manager) and returns one row ending with the world's reply."""
    al = pytest.importorskip("verl.experimental.agent_loop.agent_loop")
    from verl.workers.rollout.replica import TokenOutput

    tok, model = episodes["tok"], episodes["model"]

    class Server:
        async def generate(self, request_id, prompt_ids, sampling_params, **_):
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=40,
                    do_sample=True,
                    top_k=0,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            return TokenOutput(token_ids=out[0, ids.shape[1] :].tolist())

    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": 512, "response_length": 768, "multi_turn": {}}
            },
            "data": {},
        }
    )
    loop = kv.ConciergeAgentLoop(
        trainer_config=al.DictConfigWrap(cfg),
        server_manager=Server(),
        tokenizer=tok,
        processor=None,
        dataset_cls=None,
        data_config=al.DictConfigWrap(cfg.data),
    )
    row = kv.verl_rows(episodes["jobs"][:1], max_turns=3)[0]
    torch.manual_seed(1)
    out = asyncio.run(loop.run({}, extra_info=row["extra_info"]))
    traj = kv.Trajectory.model_validate_json(out.extra_fields["kitchen_trajectory"])
    trained = [ti for ti in traj.turns if ti.tokens and not (ti.truncated or ti.guarded)]
    assert 1 <= len(traj.turns) <= 3
    assert len(kv.turn_spans(torch.tensor([out.response_mask]))[0]) == len(trained)
    assert out.response_mask[-1] == 0  # the outcome slot is the world's reply, not an action


def test_shipped_verl_config_passes_verls_own_validation():
    """recipes/scale/verl/mapo_qwen0.5b.yaml composes on verl's ppo_trainer and validates."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    folder = paths.HOME / "recipes" / "scale" / "verl"
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        cfg = compose(config_name="mapo_qwen0.5b")
    validate_config(
        config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
    )
    assert kv.settings_from(cfg.algorithm).advantage.resolve().name == "mapo"
    assert cfg.trainer.v1.trainer_mode == "kitchen_sync"


def test_form_clauses_are_refused_naming_what_verls_batch_lacks():
    """`form_clauses` needs each turn's verdicts too: refused when verl's settings are read."""
    from pydantic import ValidationError

    node = {"advantage": {"preset": "mapo", "overrides": {"form_clauses": ["T3"]}}}
    with pytest.raises(ValidationError, match="form_clauses needs each turn's per-clause"):
        kv.settings_from({"kitchen": node})
