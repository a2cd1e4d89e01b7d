"""Every notebook runs, and its computed values are what the stage promises.

Most notebooks run as a plain script here (exit code); a notebook whose values are tested below
through `app.run()` — every cell, the gated ones included, since nobody can click in a test —
is not run a second time as a script."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
VALUES_TESTED = {"05_mapo.py", "06_evaluate.py"}  # their tests below run every cell


def load_app(name: str):
    path = ROOT / "notebooks" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


@pytest.mark.parametrize(
    "path", [p for p in NOTEBOOKS if p.name not in VALUES_TESTED], ids=lambda p: p.name
)
def test_notebook_runs_as_script(path):
    res = subprocess.run(
        [sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_01_constitution_values():
    _, defs = load_app("01_constitution.py").run()
    assert defs["problems"].height == 0  # the shipped constitution validates
    personal = defs["personal"]
    assert personal.profile.startswith("diner-")
    assert {"A1", "A2", "A3", "A4"} <= set(personal.ids)
    assert defs["changes"].height > 0  # two different diners differ
    assert len(defs["cache"]) == len(defs["profiles"])


@pytest.fixture
def no_cli_args(monkeypatch):
    """marimo's `cli_args()` reads sys.argv in `app.run()`: hide pytest's own flags (`-k ...`)
    from the notebooks' `notebook.arg` controls."""
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])


def test_05_mapo_values(no_cli_args):
    """Notebook 05 trains its default recipe (mapo, the GRM reviewing) for its iterations: one
    metrics row per iteration with the reward, advantage, KL and entropy curves it charts, the
    policy adapter moved off zero, and the trajectory browser shows the last iteration's turns
    with the advantages the update gave them."""
    _, defs = load_app("05_mapo.py").run()
    metrics, run, browser = defs["metrics"], defs["run"], defs["browser"]
    recipe = defs["recipe"]
    assert recipe.advantage.resolve().name == "mapo" and recipe.reward.reviewer == "grm"
    assert metrics.height == recipe.train.iterations == run.iteration
    for name in ("reward/global_mean", "adv/mixed_abs_mean", "kl/mean", "policy/entropy"):
        values = metrics[name].to_list()
        assert all(math.isfinite(v) for v in values), name
    assert any(c.startswith("clause/") for c in metrics.columns)
    assert metrics["train/step_samples"].min() > 0
    lora_b = [p for n, p in run.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero
    traj = run.last["trajectories"][0]
    assert browser.height == len(traj.turns)
    trained = [a for a in browser["advantage"].to_list() if a is not None]
    assert trained and all(math.isfinite(a) for a in trained)
    assert set(run.last["advantages"]) >= {(traj.id, t) for t in browser["turn"]} - {
        (traj.id, ti.turn) for ti in traj.turns if ti.truncated or ti.guarded or not ti.tokens
    }


def test_06_evaluate_values(monkeypatch, no_cli_args):
    """Notebook 06 with no trained run to load falls back to the SFT policy: played on the same
    held-out tasks, diners and seeds as the baseline, the two reports agree exactly and the win
    rate is 50%; the guard leaves no axiom violation the policy did not have, and every table
    the notebook shows is filled."""
    monkeypatch.setenv("KITCHEN_NB_RUN", str(ROOT / "runs" / "no-such-run"))
    _, defs = load_app("06_evaluate.py").run()
    report = defs["report"]
    assert defs["policy_name"].startswith("sft")
    assert report.policy.success == report.baseline.success
    assert report.policy.compliance == report.baseline.compliance
    assert report.win_rate[0] == pytest.approx(0.5)
    assert report.guarded.axiom_violations <= report.policy.axiom_violations
    n = defs["tasks"].value * defs["samples"].value
    assert len(defs["episodes"]["policy"]) == n
    table = defs["clause_table"]
    assert set(table["series"]) == {"policy", "sft", "policy + guard"}
    assert defs["personal"].height > 0
