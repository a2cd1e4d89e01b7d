"""Shared fixtures: the shipped constitution and profiles, and helpers to run the CLI and to
load a benchmark script."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# Under pytest-xdist (`make test` runs two workers on the 2-core machines) each worker, and every
# subprocess it starts, gets one torch thread: two tests side by side then use the two cores
# without oversubscribing them (the tiny models gain little from a second thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

import pytest
from transformers.utils import logging as hf_logging

from kitchen import paths
from kitchen.constitution import Constitution, load_constitution
from kitchen.profile import Profile, load_profiles

ROOT = Path(__file__).resolve().parent.parent

# transformers makes its log handler at its first log call, on the sys.stderr of that moment.
# Made inside a test that captures stderr (`capsys`), it would write to that test's buffer, closed
# when the test ends, and a later warning would print a logging error (with a traceback) into
# whichever test runs then. Made here, it holds pytest's session-long stream.
hf_logging.get_logger("transformers")


@pytest.fixture(scope="session")
def concierge() -> Constitution:
    return load_constitution(paths.DEFAULT_CONSTITUTION)


@pytest.fixture(scope="session")
def profiles() -> list[Profile]:
    return load_profiles(paths.PROFILES)


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `kitchen ARGS` in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "kitchen.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def load_benchmark(name: str):
    """`benchmarks/<name>.py` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
