"""Every notebook runs, and its computed values are what the stage promises.

Most notebooks run as a plain script here (exit code); a notebook whose values are tested below
through `app.run()` — every cell, the gated ones included, since nobody can click in a test —
is not run a second time as a script."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest

from kitchen.train import load_recipe

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


ARG_PROBE = """
import marimo

app = marimo.App()


@app.cell
def _():
    from kitchen import notebook

    k = notebook.arg("k", 4)
    print(f"k={k}")
    return (k,)


if __name__ == "__main__":
    app.run()
"""


def test_arg_reads_the_notebooks_own_flags_only(tmp_path, monkeypatch):
    """Under pytest, `app.run()` is marimo's script mode and `mo.cli_args()` parses pytest's own
    command line (`-k test_05` would become the notebook's `k`): `notebook.arg` reads flags
    only when the notebook file itself is the program (`python NB.py --k 9`), and the
    environment (`KITCHEN_NB_K`) always."""
    probe = tmp_path / "probe_nb.py"
    probe.write_text(ARG_PROBE)
    spec = importlib.util.spec_from_file_location("probe_nb", probe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["pytest", "-k", "test_05", "--tb", "short"])
    assert module.app.run()[1]["k"] == 4
    monkeypatch.setenv("KITCHEN_NB_K", "6")
    assert module.app.run()[1]["k"] == 6
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "KITCHEN_NB"))}
    res = subprocess.run(
        [sys.executable, str(probe), "--k", "9"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert res.returncode == 0 and "k=9" in res.stdout, res.stderr[-2000:]


def test_05_mapo_values():
    """Notebook 05 trains its default recipe (mapo, the GRM reviewing, meals among the tasks) for
    its iterations, with a held-out curve from before the first update: one metrics row per
    iteration with the reward, advantage, KL and entropy curves it charts, the
    policy adapter moved off zero, and the trajectory browser shows the last iteration's turns
    with the advantages the update gave them."""
    _, defs = load_app("05_mapo.py").run()
    metrics, run, browser = defs["metrics"], defs["run"], defs["browser"]
    recipe, held = defs["recipe"], defs["held"]
    assert recipe.advantage.resolve().name == "mapo" and recipe.reward.reviewer == "grm"
    main = load_recipe(ROOT / "recipes" / "tiny_mapo.yaml")
    assert recipe.grm == main.grm  # as the main job: the GRM, T3, T6 and A2 decided by code
    assert set(recipe.grm.cascade) == {"T3", "T6", "A2"}
    assert recipe.train.long_share > 0 and recipe.eval.long_share > 0  # meals: credit assignment
    assert metrics.height == recipe.train.iterations == run.iteration
    # the held-out curve: before the first update and after the last, by the rule judge
    assert held["iteration"].to_list()[0] == 0 and held["iteration"].to_list()[-1] == run.iteration
    assert all(0 <= v <= 1 for v in held["eval/compliance"].to_list())
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


def _lora_b_moved(model) -> bool:
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    return bool(lora_b) and any(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero


def test_06_evaluate_trains_an_rl_policy_when_none_exists(monkeypatch, tmp_path):
    """Notebook 06 with no shipped MAPO adapter and no run folder trains a small MAPO policy
    (its adapter moves off zero) and evaluates it against the SFT policy — never the SFT policy
    against itself: played on the same held-out tasks, diners and seeds, with a win rate inside
    its interval; the guard leaves no axiom violation the policy did not have, and every table
    the notebook shows is filled. Then the adapter it trained, saved as a shipped adapter
    folder, is what the notebook evaluates without training."""
    from kitchen.models import save_adapter

    monkeypatch.setenv("KITCHEN_NB_RUN", str(tmp_path / "no-such-run"))
    monkeypatch.setenv("KITCHEN_NB_SHIPPED", str(tmp_path / "no-such-adapter"))
    _, defs = load_app("06_evaluate.py").run()
    report, run = defs["report"], defs["brief_run"]
    assert defs["found"] is None and run is not None and run.iteration >= 1
    assert defs["policy_name"].startswith("mapo (") and defs["policy"][0] is run.model
    assert defs["policy"][0] is not defs["baseline"][0] and _lora_b_moved(run.model)
    low, high = report.win_rate[1], report.win_rate[2]
    assert 0.0 <= low <= report.win_rate[0] <= high <= 1.0
    assert report.guarded.axiom_violations <= report.policy.axiom_violations
    n = defs["tasks"].value * defs["samples"].value
    assert len(defs["episodes"]["policy"]) == len(defs["episodes"]["baseline"]) == n
    assert [t.profile for t in defs["episodes"]["policy"]] == [
        t.profile for t in defs["episodes"]["baseline"]
    ]
    table = defs["clause_table"]
    assert set(table["series"]) == {"policy", "sft", "policy + guard"}
    assert defs["personal"].height > 0

    shipped = tmp_path / "mapo-tiny"
    save_adapter(run.model, run.adapter, shipped)
    monkeypatch.setenv("KITCHEN_NB_SHIPPED", str(shipped))
    monkeypatch.setenv("KITCHEN_NB_TASKS", "2")
    _, defs = load_app("06_evaluate.py").run()
    assert defs["found_name"] == "mapo-tiny (shipped)" and defs["brief_run"] is None
    assert defs["policy_name"] == "mapo-tiny (shipped)" and _lora_b_moved(defs["policy"][0])
    assert defs["report"].baseline is not None and len(defs["episodes"]["policy"]) == 2
