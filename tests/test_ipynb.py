"""Jupyter and Colab: the helpers degrade outside marimo, and exported notebooks run under nbval."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kitchen import notebook

from .conftest import ROOT

# Every notebook's export runs in CI. Measured on the 2-core machine with one torch thread (a busy
# one), export + kernel start + run: 00 19 s, 01 10 s, 02 31 s, 03 63 s, 04 22 s, 05 87 s, 06 20 s,
# 07 18 s with the notebooks' small defaults; 03 and 05 now run smaller still (`_nbval`).
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


HELPERS_OUTSIDE_MARIMO = """
import os
from kitchen import notebook
assert notebook.mode() is None and not notebook.interactive()
assert notebook.gate(object()) is True
os.environ["KITCHEN_NB_TASKS"] = "7"
assert notebook.arg("tasks", 3) == 7 and notebook.arg("other", 2.5) == 2.5
calls = []

@notebook.cache
def f(x):
    calls.append(x)
    return x * 2

assert (f(2), f(2), calls) == (4, 4, [2])
with notebook.persistent_cache("x"):
    pass
notebook.show("nothing to replace")
assert list(notebook.progress(range(3), "t")) == [0, 1, 2]
assert notebook.small()  # nobody can click: the script's small defaults
with notebook.spinner("nothing to spin"):
    pass
import transformers.trainer as hf_trainer
before = hf_trainer.DEFAULT_PROGRESS_CALLBACK
with notebook.trainer_progress("steps"):
    assert hf_trainer.DEFAULT_PROGRESS_CALLBACK is before  # transformers' own bar outside marimo
frame = notebook.rounded([{"x": 0.1 + 0.05, "n": 3, "s": "a"}, {"x": None, "n": 4, "s": "b"}])
assert frame["x"].to_list() == [0.15, None] and frame["n"].to_list() == [3, 4]
rows = []
cb = notebook.log_callback(rows.append)
cb.on_log(None, type("S", (), {"global_step": 7})(), None, logs={"loss": 1.5})
assert rows == [{"loss": 1.5, "step": 7}]
print("ok")
"""


def test_helpers_outside_marimo():
    """In plain Python (as in Jupyter) there is no marimo mode: gates open, `arg` reads only the
    environment, `cache` memoises, `persistent_cache` and `spinner` are no-ops, `show` does
    nothing, `progress` passes every item through, `small` is on, `trainer_progress` leaves
    transformers' own progress bar in place, `rounded` rounds float columns only, and
    `log_callback` hands the trainer's rows on with their step. (A subprocess without pytest's environment: marimo reports mode 'test' under pytest.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    res = subprocess.run(
        [sys.executable, "-c", HELPERS_OUTSIDE_MARIMO],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.stdout.strip() == "ok", res.stderr[-2000:]


def test_helpers_under_marimo_test_mode(monkeypatch):
    """Under pytest marimo reports mode 'test': not interactive, so gates open, the small
    defaults apply and `show` is silent; `cache` is marimo's. `KITCHEN_NB_SMALL` asks for the
    small defaults where a person could click (the browser test)."""
    assert notebook.mode() == "test" and not notebook.interactive()
    assert notebook.gate(object()) is True and notebook.small()
    monkeypatch.setattr(notebook, "interactive", lambda: True)
    monkeypatch.delenv("KITCHEN_NB_SMALL", raising=False)
    assert not notebook.small()
    monkeypatch.setenv("KITCHEN_NB_SMALL", "1")
    assert notebook.small()
    monkeypatch.undo()
    notebook.show("nothing to replace")
    assert list(notebook.progress(range(2))) == [0, 1]


def test_finish_ipynb_fills_what_jupyter_and_nbval_need():
    """Set-up note and cell first, kernelspec, counts 1, 2, … on code cells, no outputs."""
    nb = {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# T"},
            {"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": [{"x": 1}],
             "execution_count": None},
            {"cell_type": "code", "metadata": {}, "source": "x", "outputs": [],
             "execution_count": None},
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }  # fmt: skip
    out = notebook.finish_ipynb(nb, "09_x.py", repo_url="https://example.org/kitchen.git")
    cells = out["cells"]
    assert cells[0]["cell_type"] == "markdown" and "Colab" in cells[0]["source"]
    assert "notebooks/09_x.py" in cells[0]["source"]
    assert "https://example.org/kitchen.git" in cells[1]["source"]
    assert "os.chdir(paths.HOME)" in cells[1]["source"]
    assert [c["execution_count"] for c in cells if c["cell_type"] == "code"] == [1, 2, 3]
    assert all(c["outputs"] == [] for c in cells if c["cell_type"] == "code")
    assert out["metadata"]["kernelspec"]["name"] == "python3"


def test_export_writes_a_ready_notebook(tmp_path):
    """`python -m kitchen.notebook export` keeps the file order and turns prose into markdown."""
    res = subprocess.run(
        [sys.executable, "-m", "kitchen.notebook", "export", str(tmp_path),
         str(ROOT / "notebooks" / "01_constitution.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    nb = json.loads((tmp_path / "01_constitution.ipynb").read_text())
    kinds = [c["cell_type"] for c in nb["cells"]]
    assert kinds[:3] == ["markdown", "code", "markdown"]
    assert "".join(nb["cells"][2]["source"]).startswith("# 01 ·")  # the title, not the imports
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    assert all(c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code")


CLEAN_KERNEL = """
import os
import sys

for k in [k for k in os.environ if k.startswith("PYTEST")]:
    del os.environ[k]  # a user's Jupyter has no pytest: marimo must not see its test mode
from ipykernel import kernelapp

sys.exit(kernelapp.launch_new_instance())
"""


def _nbval(name: str, tmp_path) -> None:
    """Export `name`, then run it with nbval in a kernel that looks like a user's Jupyter.

    nbval starts the kernel from inside pytest, so the kernel would inherit PYTEST_* variables,
    and marimo would then report mode 'test' instead of None — not what Jupyter users get. The
    kernel here is the venv's ipykernel started by a three-line wrapper that drops them.
    """
    (path,) = notebook.export(tmp_path, [ROOT / "notebooks" / name])
    spec = tmp_path / "jupyter" / "kernels" / "kitchen-jupyter"
    spec.mkdir(parents=True)
    (tmp_path / "clean_kernel.py").write_text(CLEAN_KERNEL)
    argv = [sys.executable, str(tmp_path / "clean_kernel.py"), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "kitchen (Jupyter)", "language": "python"})
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["JUPYTER_PATH"] = str(tmp_path / "jupyter")
    # one torch thread: the tiny models run 5-10x faster so on a busy 2-core machine (measured)
    env["OMP_NUM_THREADS"] = "1"
    # the export is what is tested here (test_notebooks checks the values): the least work that
    # still runs every cell — one training iteration in 05, four reviewed dialogues in 03
    env |= {"KITCHEN_NB_ITERATIONS": "1", "KITCHEN_NB_N": "4"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-kernel-name=kitchen-jupyter",
         "--nbval-cell-timeout=600", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_exported_notebook_runs_in_jupyter(name, tmp_path):
    """The exported notebook runs cell by cell in a Jupyter kernel (nbval, outputs unchecked)."""
    _nbval(name, tmp_path)
