"""kitchen — a notebook-first kit for constitution-aligned agent RL.

The stages, one module each:

- `kitchen.constitution` — the constitution DSL (axioms, theorems) and personalisation.
- `kitchen.profile` — diner profiles and the redaction that keeps PII out of everything else.
- `kitchen.config` — YAML files to pydantic models, with errors that name file, line and field.
- `kitchen.files` — atomic writes and JSONL, so nothing is half-written after a crash.

Importing `kitchen` is cheap: no torch, marimo, altair or polars is imported here, so the GPU and
distributed paths (and the CLI's `--help`) start fast.
"""

__version__ = "0.1.0"
