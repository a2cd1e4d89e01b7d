"""kitchen — a notebook-first kit for constitution-aligned agent RL.

The stages, one module each:

- `kitchen.constitution` — the constitution DSL (axioms, theorems) and personalisation.
- `kitchen.profile` — diner profiles and the redaction that keeps PII out of everything else.
- `kitchen.config` — YAML files to pydantic models, with errors that name file, line and field.
- `kitchen.files` — atomic writes and JSONL, so nothing is half-written after a crash.

Importing `kitchen` is cheap: no torch, marimo, altair or polars is imported here, so the GPU and
distributed paths (and the CLI's `--help`) start fast.
"""

import logging

__version__ = "0.1.0"

# bitsandbytes logs on every import that it cannot fetch an optional CPU kernel from the hub
# (NOTES.md: harmless; installing `kernels` would try to reach the hub). Say nothing instead.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.getMessage()
)
