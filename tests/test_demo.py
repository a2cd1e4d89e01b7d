"""The main job (`kitchen demo`): MAPO and its one-factor GRPO arm, evaluated and reported."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
import yaml

from kitchen import demo, mapo, paths
from kitchen.config import KitchenError
from kitchen.train import Recipe, load_recipe


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run folders (the parent's and the `kitchen cook` subprocesses') under tmp_path."""
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    monkeypatch.setenv("KITCHEN_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def small_recipe(tmp_path) -> str:
    """tiny_mapo.yaml in a small shape (the rule judge reviewing, two short iterations)."""
    doc = yaml.safe_load((paths.RECIPES / "tiny_mapo.yaml").read_text())
    doc |= {
        "reward": {"reviewer": "judge"},
        "rollout": {"k": 2, "max_turns": 3, "max_new_tokens": 24, "batch_size": 8},
        "train": doc["train"] | {"iterations": 2, "tasks_per_iteration": 1, "task_pool": 8},
        "eval": {"tasks": 2, "samples": 1},
        "eval_every": 1,
        "checkpoint_every": 1,
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_two_runs_differ_in_the_advantage_estimator_only():
    """demo-grpo is tiny_mapo.yaml's compare arm: GRPO's advantage (no local term, no buffer)
    over MAPO's state key and loss; `iterations` shortens both runs and MAPO's α schedule."""
    docs = demo.arms(iterations=7)
    m, g = docs["demo-mapo"], docs["demo-grpo"]
    assert {k for k in m if m[k] != g[k]} == {"name", "advantage"}
    rm, rg = Recipe.model_validate(m), Recipe.model_validate(g)
    am, ag = rm.advantage.resolve(), rg.advantage.resolve()
    assert ag.model_dump() == mapo.one_factor(mapo.PRESETS["grpo"], am).model_dump()
    assert am.alpha.steps == 7 and rm.train.iterations == rg.train.iterations == 7
    assert ag.loss_agg == am.loss_agg == "token-mean" and not ag.use_buffer


def test_samples_to_reach_reads_the_rolling_mean():
    frame = pl.DataFrame({"episodes": [32, 64, 96, 128], "c": [0.5, 0.9, 0.5, 0.9]})
    assert demo.samples_to_reach(frame, 0.7, "c", window=1) == 64
    assert demo.samples_to_reach(frame, 0.7, "c", window=2) == 64  # (0.5 + 0.9) / 2 = 0.7
    assert demo.samples_to_reach(frame, 0.71, "c", window=2) is None


def test_run_state_reuses_only_a_run_of_the_same_recipe(tmp_path):
    """A folder is 'new' without a checkpoint or when its recipe differs from today's (an older
    demo), 'partial' before the last iteration, 'done' after it."""
    doc = demo.arms(iterations=3)["demo-mapo"]
    folder = tmp_path / "demo-mapo"
    assert demo._state(folder, doc) == "new"
    ck = folder / "checkpoints" / "it-0002"
    ck.mkdir(parents=True)
    torch.save({}, ck / "state.pt")
    (folder / "checkpoints" / "latest").write_text("it-0002\n")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(doc))
    assert demo._state(folder, doc) == "partial"
    assert demo._state(folder, doc | {"train": doc["train"] | {"iterations": 2}}) == "new"
    (folder / "checkpoints" / "latest").write_text("it-0003\n")
    (folder / "checkpoints" / "it-0002").rename(folder / "checkpoints" / "it-0003")
    assert demo._state(folder, doc) == "done"


def test_a_failed_training_run_is_reported_with_its_log(tmp_path, runs_dir):
    doc = demo.arms(iterations=1)["demo-grpo"]
    doc["policy"]["path"] = str(tmp_path / "no-such-model")
    (tmp_path / "out").mkdir()
    with pytest.raises(KitchenError, match=r"training run demo-grpo failed .*demo-grpo.log"):
        demo.cook_side_by_side({"demo-grpo": doc}, tmp_path / "out", progress=False)


def test_main_job_end_to_end_in_a_small_shape(tmp_path, runs_dir):
    """Both runs train, are evaluated against the SFT policy on held-out tasks, and the report
    and results say what each run's advantage computes."""
    results = demo.main_job(
        iterations=2, eval_tasks=2, eval_samples=1, progress=False, recipe=small_recipe(tmp_path)
    )
    saved = json.loads((runs_dir / "demo" / "results.json").read_text())
    assert saved["mapo_vs_grpo_win_rate"] == pytest.approx(results["mapo_vs_grpo_win_rate"])
    for name in ("demo-mapo", "demo-grpo"):
        w = results[name]["win_rate_vs_sft"]
        assert 0.0 <= w[1] <= w[0] <= w[2] <= 1.0
        assert results[name]["guarded"]["axiom_violations"] <= results[name]["axiom_violations"]
        assert pl.read_parquet(runs_dir / name / "metrics.parquet").height == 2
    a, b = (load_recipe(runs_dir / n / "recipe.yaml").model_dump() for n in demo.RUNS)
    assert {k for k in a if a[k] != b[k]} == {"name", "advantage"}
    assert "A_local  not used" in results["advantage"]["demo-grpo"]
    assert "replay buffer" in results["advantage"]["demo-mapo"]
    assert set(results["sample_efficiency"]["episodes"]) == set(demo.RUNS)
    html = (runs_dir / "demo" / "report.html").read_text()
    assert "differ in the advantage estimator alone" in html and html.count("<svg") > 10
    assert "demo-mapo: win rate vs SFT" in demo.summary(results)


def test_numbers_over_nothing_read_no_data():
    """A held-out compliance or win rate over nothing (NaN) reads "no data" in the summary and
    the efficiency line; the rolling mean skips such rows."""
    nan = float("nan")
    run = {
        "win_rate_vs_sft": (nan, nan, nan),
        "success": nan,
        "compliance": nan,
        "axiom_violations": 0,
        "guarded": {"axiom_violations": 0},
    }
    results = {
        "demo-mapo": run,
        "demo-grpo": run,
        "sft": {"success": nan, "compliance": nan, "axiom_violations": 0},
        "mapo_vs_grpo_win_rate": (nan, nan, nan),
        "sample_efficiency": {"start": nan, "target": None, "episodes": {}},
        "seconds": 60.0,
    }
    text = demo.summary(results)
    assert "nan" not in text.lower() and text.count("no data") >= 7
    frame = pl.DataFrame({"episodes": [32, 64, 96], "c": [0.9, nan, 0.9]})
    assert demo.samples_to_reach(frame, 0.9, "c", window=2) == 32
