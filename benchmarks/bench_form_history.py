"""Does a policy pick a recommendation's form from the diner's style or copy its earlier messages?
For #14.

Not a test. Takes held-out SFT dialogues (`data/sft/eval.jsonl`) of brief and normal diners with
two recommendations or more, cuts each before its last recommendation and lets the policy write
it `--samples` times at temperature 1, three ways: the dialogue as written, with every earlier
recommendation rewritten in the long form (`I recommend Dish, 5 dollars, ready in 10 minutes.`)
and rewritten in the short form (`Dish: 5$, 10 min.`). Prints the share of short, long and other
answers per verbosity and variant. A policy that reads the style in its header writes the same
form whatever came before; one that copies its history follows the rewrite.

    .venv/bin/python benchmarks/bench_form_history.py data/models/policy-tiny --dialogues 50
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import torch

from kitchen import paths
from kitchen.models import ModelSpec, load_model, replies

SHORT = re.compile(r"^([A-Z][^:.!?]*): (\d+)\$, (\d+) min\.(.*)$")
LONG = re.compile(r"^I recommend ([^,.]+), (\d+) dollars, ready in (\d+) minutes\.(.*)$")
VARIANTS = ("as written", "earlier long", "earlier short")


def to_long(text: str) -> str:
    g = SHORT.match(text)
    return f"I recommend {g[1]}, {g[2]} dollars, ready in {g[3]} minutes.{g[4]}" if g else text


def to_short(text: str) -> str:
    g = LONG.match(text)
    return f"{g[1]}: {g[2]}$, {g[3]} min.{g[4]}" if g else text


def answer_form(text: str) -> str:
    text = text.strip()
    if re.match(r"^[A-Z][^:.!?]*: \d+\$", text):
        return "short"
    return "long" if text.startswith("I recommend") else "other"


def contexts(rows: list[dict], n: int) -> list[tuple[str, str, list[dict]]]:
    """(verbosity, variant, messages before the last recommendation) for the first `n`
    dialogues of brief or normal diners with two recommendations or more."""
    out = []
    for row in rows:
        msgs = row["messages"]
        verbosity = re.search(r"verbosity=(\w+)", msgs[0]["content"])
        if not verbosity or verbosity[1] not in ("brief", "normal"):
            continue
        recs = [
            i
            for i, m in enumerate(msgs)
            if m["role"] == "assistant" and (SHORT.match(m["content"]) or LONG.match(m["content"]))
        ]
        if len(recs) < 2:
            continue
        for variant, rewrite in zip(VARIANTS, (None, to_long, to_short), strict=True):
            ctx = [dict(m) for m in msgs[: recs[-1]]]
            for i in recs[:-1] if rewrite else ():
                ctx[i]["content"] = rewrite(ctx[i]["content"])
            out.append((verbosity[1], variant, ctx))
        if len(out) >= 3 * n:
            break
    return out


def probe(policy, rows: list[dict], n: int, samples: int, seed: int = 0) -> dict:
    """Share of each answer form per (verbosity, variant)."""
    model, tok = policy
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for k, (verbosity, variant, ctx) in enumerate(contexts(rows, n)):
        for text in replies(
            model, tok, ctx, n=samples, max_new_tokens=24, temperature=1.0, seed=seed + k
        ):
            counts[(verbosity, variant)][answer_form(text)] += 1
    return {
        k: {f: c[f] / sum(c.values()) for f in ("short", "long", "other")}
        for k, c in counts.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", help="a policy checkpoint folder (e.g. data/models/policy-tiny)")
    ap.add_argument("--data", type=Path, default=paths.DATA / "sft" / "eval.jsonl")
    ap.add_argument("--dialogues", type=int, default=50, help="dialogues per run (default 50)")
    ap.add_argument("--samples", type=int, default=8, help="answers per context (default 8)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path=args.policy))
    model.eval()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    shares = probe((model, tok), rows, args.dialogues, args.samples)
    print(f"{'':<24}{'short':>8}{'long':>8}{'other':>8}")
    for (verbosity, variant), s in sorted(shares.items()):
        print(f"{verbosity + ' · ' + variant:<24}" + "".join(f"{s[f]:>8.0%}" for f in s))


if __name__ == "__main__":
    main()
