"""The copying warm-up: teach a tiny model to copy before it learns the concierge dialogues.

A concierge names dishes it read a few hundred tokens back — in a search result, an allergen
check, the diner's answer. A model can write such a name in two ways: **copy** it from the
context (an induction head: find the earlier occurrence of the current token, predict the token
that followed it), or **recall** it from the menu it memorised in training. Only copying is
right when the context holds a dish the model has not seen in that place; recall writes the
menu's most familiar dish there instead, which is the red line A3 (a dish no search returned).

Measured on the kit's 2M-parameter policy (`benchmarks/bench_copying.py`, docs/results.md
"Copied or recalled?"): trained from scratch on the dialogues, it recalls — it pays 13.9 nats a
token for the rest of a dish's name it never saw, worse than a uniform guess — and it does not
learn to copy even when every dish is renamed so that copying is the only way to fit the data.
Trained first on copying alone, the same model learns to copy: the loss sits near chance (about
7 nats a token) for about a thousand steps, then falls to about 0.5 within two hundred — the
sudden "phase change" in which induction heads form — and SFT on the dialogues keeps it: names
it never saw cost it about 1 nat a token.

The task (`copy_batch`): a prefix of random tokens, a run x of random tokens, a gap, then x
twice; the loss is on the two repeats only. Random tokens mean nothing can be recalled, and the
variable prefix and gap mean positions cannot be counted: the model must look the run up by its
content. Tokens are drawn from the tokenizer's learnt merges (ids past the 256 bytes, specials
left out) — the pieces dish names are made of.

`kitchen sft` runs it before SFT when a `tiny:` recipe has `copy_warmup:` (`CopyWarmup`); the
warmed model is saved in the run's `copy_warmup/` folder so a resumed or repeated run does not
redo it.

Departures and choices:
1. The loss does not reach 0: where the second repeat ends and the third begins cannot be told
   from the tokens, so the third repeat's first token stays a guess (about 0.27 nats of the
   average). A finished warm-up sits near 0.5.
2. The schedule is a 100-step linear warm-up then a constant rate, not SFT's cosine: the drop
   comes after a long plateau whose length varies with the seed, and a decaying rate would
   shrink the step just when it is needed.
3. The rate is lower than SFT's: the plateau's length depends on it, and a large rate keeps the
   model on it (measured on the kit's model: 7e-4 left it at step ~1,100, 2e-3 not in 4,500
   steps, 5e-3 stayed at chance).
4. The warm-up is all or nothing: an interrupted one starts over (about 12 minutes on 2 CPU
   cores at the default 2,500 steps); a finished one is never redone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field, model_validator
from tqdm.auto import tqdm

from kitchen.config import StrictModel

IGNORE = -100  # the label of a position whose next token is not predicted (HF convention)


class CopyWarmup(StrictModel):
    """Train a `tiny:` model on copying random token runs before SFT (`kitchen.copying`)."""

    steps: int = Field(
        2500,
        ge=1,
        description="Optimiser steps. 2,500: at the default rate the kit's 2M-parameter model "
        "sat near 6.5–7 nats a token for ~1,050 steps, then dropped to ~0.55 within 200 "
        "(measured); the rest is margin for a seed whose plateau lasts longer.",
    )
    batch_size: int = Field(32, ge=1, description="Sequences per step (each ~40–120 tokens).")
    lr: float = Field(
        7e-4,
        gt=0,
        description="AdamW learning rate after a 100-step linear warm-up, then constant. 7e-4: "
        "at 2e-3 the model had not left the plateau after 4,500 steps (3,000, then 1,500 with a "
        "fresh optimiser), at 5e-3 it stayed at chance; at 7e-4 it copied after ~1,100 "
        "(measured).",
    )
    min_run: int = Field(4, ge=2, description="Shortest run to copy, in tokens.")
    max_run: int = Field(
        24,
        ge=2,
        description="Longest run to copy, and the longest prefix and gap. 24: longer than "
        "any dish name, short enough that a step stays cheap.",
    )

    @model_validator(mode="after")
    def _runs(self) -> CopyWarmup:
        if self.min_run > self.max_run:
            raise ValueError(f"min_run {self.min_run} exceeds max_run {self.max_run}")
        return self


def copy_batch(
    rng: random.Random, ids: list[int], size: int, min_run: int = 4, max_run: int = 24
) -> list[tuple[list[int], list[int]]]:
    """`size` examples `(tokens, labels)` of the copying task, each of length
    `p + 3·L + g`: a prefix of p ∈ [0, max_run] tokens, a run x of L ∈ [min_run, max_run]
    tokens, a gap of g ∈ [0, max_run], then x twice, all drawn uniformly from `ids`.

    `labels[i]` is the token at i where it is predicted (the model shifts), `IGNORE` elsewhere:
    every token of the two repeats but the first repeat's first (nothing says where x starts).
    """
    out = []
    for _ in range(size):
        x = [rng.choice(ids) for _ in range(rng.randint(min_run, max_run))]
        pre = [rng.choice(ids) for _ in range(rng.randint(0, max_run))]
        gap = [rng.choice(ids) for _ in range(rng.randint(0, max_run))]
        tokens = pre + x + gap + x + x
        labels = [IGNORE] * (len(pre) + len(x) + len(gap) + 1) + x[1:] + x
        out.append((tokens, labels))
    return out


def collate(
    batch: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Right-pad `copy_batch` rows to one length: `input_ids`, `attention_mask`, `labels`, each
    `[B, T]` with T the longest row."""
    n = max(len(t) for t, _ in batch)
    rows = [(t + [pad_id] * (n - len(t)), y + [IGNORE] * (n - len(y)), len(t)) for t, y in batch]
    return {
        "input_ids": torch.tensor([t for t, _, _ in rows], device=device),
        "labels": torch.tensor([y for _, y, _ in rows], device=device),
        "attention_mask": torch.tensor(
            [[1] * k + [0] * (n - k) for _, _, k in rows], device=device
        ),
    }


def copy_ids(tokenizer: Any) -> list[int]:
    """The token ids a run is drawn from: every learnt merge (ids past the 256 byte tokens of a
    byte-level BPE), special tokens left out."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(256, len(tokenizer)) if i not in special]
    if len(ids) < 2:
        raise ValueError(f"a tokenizer of {len(tokenizer)} tokens has no merges to copy")
    return ids


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: CopyWarmup,
    *,
    seed: int = 0,
    on_log: Callable[[dict[str, float]], None] | None = None,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train `model` (in place, on its own device) on `settings.steps` batches of the copying
    task; returns the log, a row `{"step", "copy_loss"}` every 50 steps and at the last (the
    mean loss over the steps since the previous row). The batches are drawn from a private RNG
    seeded with `seed`."""
    device = next(model.parameters()).device
    ids = copy_ids(tokenizer)
    rng = random.Random(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    log: list[dict[str, float]] = []
    total, count = 0.0, 0
    bar = tqdm(range(settings.steps), desc="copy warm-up", unit="step", disable=not progress)
    for step in bar:
        batch = copy_batch(rng, ids, settings.batch_size, settings.min_run, settings.max_run)
        loss = model(**collate(batch, tokenizer.pad_token_id, device)).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"copy warm-up loss {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ramp.step()
        total, count = total + loss.item(), count + 1
        if (step + 1) % 50 == 0 or step == settings.steps - 1:
            row = {"step": step + 1, "copy_loss": total / count}
            log.append(row)
            bar.set_postfix(copy_loss=f"{row['copy_loss']:.3f}")
            if on_log is not None:
                on_log(row)
            total, count = 0.0, 0
    model.eval()
    return log
