"""Does a policy copy the dish it names from the dialogue, or recall it? For #14.

Not a test. Most of the red lines the RL policies still break are A3 — a dish no search returned,
written where the dish in front of the policy belonged. This reads, for each policy, the mean
negative log-likelihood of the assistant tokens of held-out SFT dialogues (`--dialogues`,
`data/sft/eval.jsonl` by default), in three kinds:

- `first`: the first token of a menu dish's name (which dish: a choice among those the search
  returned, or the one the check or the diner just named);
- `rest`: the name's other tokens (given its first token, the rest is in the dialogue, a few
  hundred tokens back — or in the model's memory of the menu);
- `other`: every other token of an assistant message (its end-of-turn token left out).

`--renamed` first gives each dialogue's dishes invented names (`kitchen.scripted.renamed_row`,
the same in every message), so memory cannot help: a policy that copies keeps `rest` low, one
that recalls pays for every token of a name it never saw.

    .venv/bin/python benchmarks/bench_copying.py data/models/policy-tiny
    .venv/bin/python benchmarks/bench_copying.py data/models/policy-tiny runs/sft_x/final --renamed

A model of the cold start's shape trained from scratch on the dialogues recalls; one that first
learns to copy random token runs (`copy_warmup:` in an SFT recipe, `kitchen.copying`) copies.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch

from kitchen import paths
from kitchen.config import KitchenError
from kitchen.files import read_jsonl
from kitchen.models import ModelSpec, load_model
from kitchen.scripted import renamed_row
from kitchen.world import load_menu, phrase_pattern

KINDS = ("first", "rest", "other")


def token_kinds(
    text: str, messages: list[dict], offsets: list[tuple[int, int]], names: re.Pattern
) -> dict[int, str]:
    """Each assistant token of `text` (the rendered `messages`) by kind: the first token of a
    dish's name (a match of `names`), another token of it, or any other token. A token
    straddling a name's start counts as its first."""
    kinds: dict[int, str] = {}
    cursor = 0
    for m in messages:
        if not m["content"]:
            continue
        start = text.find(m["content"], cursor)
        if start < 0:
            continue
        cursor = start + len(m["content"])
        if m["role"] != "assistant":
            continue
        spans = [(start + x.start(1), start + x.end(1)) for x in names.finditer(m["content"])]
        for t, (s, e) in enumerate(offsets):
            if e <= s or s < start or e > cursor:
                continue
            kind = "other"
            for a, b in spans:
                if s < b and e > a:
                    kind = "first" if s <= a else "rest"
            kinds[t] = kind
    return kinds


def name_losses(
    policy: str | Path, dialogues: list[tuple[dict, re.Pattern]]
) -> dict[str, tuple[float, int]]:
    """Mean NLL and token count per kind (`token_kinds`) of `policy` on `dialogues`, each a chat
    row and the pattern of the dish names it holds."""
    model, tok = load_model(ModelSpec(path=str(policy), device="cpu", dtype="float32"))
    model.eval()
    sums = dict.fromkeys(KINDS, 0.0)
    counts = dict.fromkeys(KINDS, 0)
    for row, names in dialogues:
        messages = row["messages"]
        text = tok.apply_chat_template(messages, tokenize=False)
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        ids = torch.tensor([enc["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
        for t, kind in token_kinds(text, messages, enc["offset_mapping"], names).items():
            if t >= 1:
                sums[kind] += nll[t - 1].item()
                counts[kind] += 1
    return {k: (sums[k] / max(1, counts[k]), counts[k]) for k in KINDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policies", nargs="+", help="model folders (a cold start's final/, ...)")
    ap.add_argument("--dialogues", default=str(paths.DATA / "sft" / "eval.jsonl"))
    ap.add_argument("--n", type=int, default=60, help="dialogues read (default 60)")
    ap.add_argument("--renamed", action="store_true", help="invent every dish's name first")
    ap.add_argument("--seed", type=int, default=0, help="seeds the invented names")
    args = ap.parse_args()
    try:
        run(args)
    except (KitchenError, OSError, ValueError) as e:
        raise SystemExit(f"bench_copying: {e}") from None


def run(args: argparse.Namespace) -> None:
    menu = load_menu()
    rng = random.Random(args.seed)
    rows = []
    for row in list(read_jsonl(args.dialogues))[: args.n]:
        if args.renamed:
            new: dict[str, str] = {}
            row = renamed_row(row, rng, menu, new)
            names = list(new.values())
        else:
            names = [d.name for d in menu.dishes]
        rows.append((row, phrase_pattern(names) if names else re.compile("(?!)")))
    print(f"{len(rows)} dialogues of {args.dialogues}{', dishes renamed' if args.renamed else ''}")
    print(f"{'policy':48s} " + " ".join(f"{k:>14s}" for k in KINDS))
    for p in args.policies:
        got = name_losses(p, rows)
        cells = " ".join(f"{got[k][0]:7.3f} ({got[k][1]:4d})" for k in KINDS)
        print(f"{str(p)[-48:]:48s} {cells}")


if __name__ == "__main__":
    main()
