"""kitchen — a notebook-first kit for constitution-aligned agent RL.

The method is in docs/method.md; the modules follow one iteration's data flow, one concept each:

- the constitution: `constitution` (axioms, theorems, personalisation), `profile` (profiles and
  the redaction that keeps PII out of everything else);
- the world: `world` (menu, tools, simulated diner, episodes), `judge` (the independent rule
  judge), `scripted` (scripted agents for SFT and GRM data), `jobs` (which task meets which
  diner);
- models: `models` (the tiny model, any HF model, LoRA/QLoRA, log-probs), `sft` (the cold start);
- the reward: `review` (verdicts → local and global rewards), `grm` (the generative reward
  model), `calibrate` (its training data and calibration), `guard` (axioms at inference);
- the optimiser: `mapo` (advantages and loss; the peers as presets), `buffer` (the replay
  buffer), `lab` (the tabular credit-assignment lab);
- the loop: `rollout`, `train` (recipes, `kitchen cook`, checkpoints), `evaluate` (held-out,
  judge-scored), `demo` (the main job), `report` (HTML reports), `decide` (should you RL?);
- plumbing: `config` (YAML → pydantic with file:line errors), `files` (atomic writes, JSONL),
  `paths`, `charts` (altair), `notebook` (notebook helpers), `cli`, `integrations` (TRL, verl).

Importing `kitchen` is cheap: no torch, marimo, altair or polars is imported here, and the core
modules import none of marimo, altair or polars (a test checks), so the GPU and distributed paths
run without them and the CLI's `--help` starts fast.
"""

import logging

__version__ = "0.1.0"

# bitsandbytes logs on every import that it cannot fetch an optional CPU kernel from the hub
# (harmless; installing `kernels` would try to reach the hub). Say nothing instead.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.getMessage()
)
