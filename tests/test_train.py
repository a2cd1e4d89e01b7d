"""The training loop: updates move the policy the right way; runs resume to the same result."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kitchen import paths
from kitchen.config import KitchenError
from kitchen.models import token_logprobs
from kitchen.rollout import render_prompt
from kitchen.train import (
    Recipe,
    Run,
    cook,
    gather_actions,
    latest_checkpoint,
    load_recipe,
    load_run_policy,
    pack_units,
    sequences,
    spans_of,
    unit_tensors,
)

POLICY = os.environ.get("KITCHEN_TEST_POLICY", str(paths.DATA / "models" / "policy-tiny"))


def tiny_recipe(name: str, **over) -> Recipe:
    base = {
        "name": name,
        "seed": 3,
        "policy": {"path": POLICY, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "reward": {"reviewer": "judge"},
        "rollout": {"k": 4, "max_turns": 5, "max_new_tokens": 40},
        "advantage": {"preset": "mapo", "overrides": {"beta": 0.02, "state_key": "abstract"}},
        "train": {"iterations": 2, "tasks_per_iteration": 2, "task_pool": 20, "lr": 3e-3},
        "eval_every": 0,
        "checkpoint_every": 1,
        "samples_per_iteration": 2,
        "torch_threads": 1,
    }
    for k, v in over.items():
        base[k] = base[k] | v if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return Recipe.model_validate(base)


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RUNS", tmp_path)
    return tmp_path


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def action_logprobs(run, model=None):
    """Mean log-prob of each (trajectory, turn) action of the last iteration under `model`."""
    model = model or run.model
    out = {}
    for t, _pc in zip(run.last["trajectories"], run.last["pcs"], strict=True):
        for ti in t.turns:
            if (t.id, ti.turn) not in run.last["advantages"]:
                continue
            prompt = render_prompt(run.tok, t.prompt_messages(ti.turn))
            ids, attn, act = sequences(run.tok, [prompt], [ti.tokens], model.device)
            with torch.no_grad():
                logp, _ = token_logprobs(model, ids, attn)
            packed, mask = gather_actions(logp, act)
            out[(t.id, ti.turn)] = (packed.sum() / mask.sum()).item()
    return out


def test_logprobs_at_collection_match_the_training_forward(runs_dir):
    """The loss scores exactly the tokens the rollout sampled: same positions, same log-probs."""
    run = Run(tiny_recipe("align", train={"iterations": 1}), progress=False)
    from kitchen.rollout import rollout

    trajs, _ = rollout(run.model, run.tok, run._jobs(0), run.recipe.rollout, seed=1)
    checked = 0
    for t in trajs[:4]:
        for ti in t.turns:
            prompt = render_prompt(run.tok, t.prompt_messages(ti.turn))
            ids, attn, act = sequences(run.tok, [prompt], [ti.tokens], run.model.device)
            with torch.no_grad():
                logp, _ = token_logprobs(run.model.eval(), ids, attn)
            packed, mask = gather_actions(logp, act)
            assert int(mask.sum()) == len(ti.tokens)
            torch.testing.assert_close(
                packed[0, : len(ti.tokens)], torch.tensor(ti.logprobs), atol=2e-3, rtol=1e-3
            )
            checked += 1
    assert checked > 4
    # packed: one sequence per trajectory scores every turn the same way
    items = [
        (t.id, ti.turn, render_prompt(run.tok, t.prompt_messages(ti.turn)), ti.tokens)
        for t in trajs[:4]
        for ti in t.turns
    ]
    units = pack_units(run.tok, items)
    packed_trajs = sum(len(spans) > 1 for _, spans in units)
    assert packed_trajs >= 2, "most trajectories should pack into one sequence"
    ids, attn, at = unit_tensors(units, run.tok.pad_token_id, run.model.device)
    with torch.no_grad():
        logp, _ = token_logprobs(run.model.eval(), ids, attn)
        fast, _ = token_logprobs(run.model.eval(), ids, attn, positions=at)
    torch.testing.assert_close(fast, logp * at, atol=1e-4, rtol=1e-4)  # selected rows: same values
    idx, packed, mask = spans_of(fast, units)
    for b, i in enumerate(idx):
        recorded = [ti.logprobs for t in trajs[:4] for ti in t.turns][i]
        torch.testing.assert_close(
            packed[b, : len(recorded)], torch.tensor(recorded), atol=2e-3, rtol=1e-3
        )
        assert int(mask[b].sum()) == len(recorded)


def test_update_moves_weights_toward_positive_advantages(runs_dir):
    """After one iteration the adapter has moved, and actions with a higher advantage gained
    log-probability relative to those with a lower one."""
    run = Run(tiny_recipe("update"), progress=False)
    before = lora_state(run.model)
    m = run.step()
    after = lora_state(run.model)
    moved = sum((after[k] - before[k]).abs().sum().item() for k in before)
    assert moved > 0 and m["train/step_samples"] > 0
    new = action_logprobs(run)
    with torch.no_grad():
        for k, p in run.model.named_parameters():
            if k in before:
                p.copy_(before[k])
    old = action_logprobs(run)
    adv = run.last["advantages"]
    keys = sorted(k for k in new if abs(adv[k]) > 1e-6)
    assert len(keys) >= 4
    a = torch.tensor([adv[k] for k in keys])
    d = torch.tensor([new[k] - old[k] for k in keys])
    corr = torch.corrcoef(torch.stack([a, d]))[0, 1]
    assert corr > 0.3, f"log-prob change does not follow the advantage (corr {corr:.2f})"
    for key in (
        "reward/global_mean",
        "adv/mixed_abs_mean",
        "kl/mean",
        "policy/entropy",
        "group/local_size_mean",
        "speed/rollout_tokens_per_s",
        "judge/compliance",
    ):
        assert key in m


def test_resume_reaches_the_same_result(runs_dir):
    """A run killed after its first checkpoint and resumed ends where an uninterrupted run ends."""
    straight = cook(tiny_recipe("straight"), progress=False)

    class Crash(Exception):
        pass

    def crash_after_first(run, m):
        if run.iteration == 1:
            raise Crash

    recipe = tiny_recipe("resumed")
    with pytest.raises(Crash):
        cook(recipe, progress=False, on_iteration=crash_after_first)
    folder = runs_dir / "resumed"
    assert latest_checkpoint(folder).name == "it-0001"
    resumed = cook(resume=folder, progress=False)
    a, b = lora_state(straight.model), lora_state(resumed.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    keep = [k for k in straight.metrics[-1] if not k.startswith("speed/")]
    for x, y in zip(straight.metrics, resumed.metrics, strict=True):
        assert {k: x.get(k) for k in keep} == pytest.approx(
            {k: y.get(k) for k in keep}, rel=1e-4, abs=1e-6
        )
    # the resumed run's policy loads for evaluation from its checkpoint
    model, _ = load_run_policy(folder)
    torch.testing.assert_close(lora_state(model)[next(iter(a))], b[next(iter(a))])


def test_interrupted_checkpoint_leaves_the_previous_one(runs_dir, monkeypatch):
    run = cook(tiny_recipe("atomic", train={"iterations": 1}), progress=False)
    good = latest_checkpoint(run.folder)
    real = shutil.rmtree

    def fail_midway(*a, **k):  # the save dies after writing its temporary folder
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", fail_midway)
    with pytest.raises(OSError):
        run.save()
    monkeypatch.setattr(os, "replace", os.__dict__["replace"])
    assert latest_checkpoint(run.folder) == good
    assert (good / "state.pt").exists()
    real(run.folder / "checkpoints" / f".{good.name}.tmp", ignore_errors=True)


def test_fresh_run_refuses_to_overwrite(runs_dir):
    cook(tiny_recipe("once", train={"iterations": 1}), progress=False)
    with pytest.raises(KitchenError, match="already holds a run"):
        cook(tiny_recipe("once", train={"iterations": 1}), progress=False)


def test_bad_recipes_are_located(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\npolicy: {path: p}\nrollout: {k: 0}\n")
    with pytest.raises(KitchenError) as e:
        load_recipe(bad)
    text = str(e.value)
    assert f"{bad}:2: policy" in text and "lora" in text
    assert f"{bad}:3: rollout.k" in text
    bad.write_text("name: x\nadvantage: {preset: ppo}\n")
    with pytest.raises(KitchenError, match=r"r.yaml:2: advantage: unknown preset 'ppo'"):
        load_recipe(bad)


def test_shipped_recipes_load():
    for f in sorted((paths.HOME / "recipes").glob("*.yaml")):
        if f.name.startswith(("sft_", "grm_")):
            continue
        assert load_recipe(f).name


def _bench_gpu(*args):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(paths.HOME / "benchmarks" / "bench_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout[out.stdout.index("{") :])


@pytest.mark.slow
def test_gpu_recipe_path_runs_on_a_cpu_in_small_shape():
    """The one-GPU path (nf4 off on CPU, LoRA policy, GRM adapter on the same base) runs."""
    res = _bench_gpu("--small", "--cpu", "--iterations", "1")
    row = res["iterations"][0]
    assert row["rollout_tokens_per_s"] > 0 and row["update_tokens_per_s"] > 0
    assert row["review_generations"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_of_shared_base():
    """Qwen2.5-0.5B-shaped QLoRA: policy + KL reference + GRM on one base vs policy alone."""
    res = _bench_gpu("--iterations", "2")
    assert res["peak_gb_policy_only"] > 0 and res["ratio"] > 1.0
    assert res["ratio"] <= 1.5, res  # the goal is 1.2x; this catches a second copy of the weights
