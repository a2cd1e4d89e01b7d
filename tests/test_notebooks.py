"""Every notebook runs as a plain script, and its computed values are what the stage promises."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def load_app(name: str):
    path = ROOT / "notebooks" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
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
