"""`import kitchen` and the core modules must not pull in marimo, altair or polars."""

from __future__ import annotations

import subprocess
import sys

CORE = [
    "kitchen.calibrate",
    "kitchen.train",
    "kitchen.evaluate",
    "kitchen.guard",
    "kitchen.grm",
    "kitchen.rollout",
    "kitchen.jobs",
    "kitchen.notebook",
    "kitchen.decide",
    "kitchen",
    "kitchen.config",
    "kitchen.files",
    "kitchen.profile",
    "kitchen.constitution",
    "kitchen.cli",
    "kitchen.paths",
    "kitchen.mapo",
    "kitchen.buffer",
    "kitchen.lab",
    "kitchen.models",
    "kitchen.sft",
    "kitchen.world",
    "kitchen.judge",
    "kitchen.review",
    "kitchen.scripted",
]


def test_core_modules_do_not_import_notebook_stack():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in CORE)
        + "bad = [m for m in ('marimo', 'altair', 'polars') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout.strip()}"
