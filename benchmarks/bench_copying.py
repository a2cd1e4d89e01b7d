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

`--pretrain OUT` instead trains a model of the cold start's shape (`model.tiny` of
`--recipe`, `recipes/sft_tiny.yaml` by default, with the tokenizer of `--tokenizer`) from scratch
on copying alone — runs of random tokens, each repeated twice after a gap, the loss on the
repeats — and saves it to OUT, a `base:` for `kitchen sft` (`base: {path: OUT, dtype:
float32}`). A 4-layer model trained from scratch on the concierge dialogues never learns to
copy; on this task the loss falls from chance (about 7 nats a token) to about 0.5 once it does
(not to 0: where the second repeat ends and the third begins cannot be told from the run, so the
third repeat's first token stays a guess, about 0.27 nats of the average). On the CPU: about 0.27
s a step on 2 cores.

    .venv/bin/python benchmarks/bench_copying.py --pretrain runs/copy-base --steps 4000 \
        --tokenizer runs/sft_x/final
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


def copy_batch(rng: random.Random, ids: list[int], size: int) -> list[tuple[list[int], list[int]]]:
    """`size` examples of the copying task: a prefix, a run x of 4–24 tokens, a gap, then x
    twice; labels (−100 where nothing is predicted) on the repeats alone."""
    out = []
    for _ in range(size):
        x = [rng.choice(ids) for _ in range(rng.randint(4, 24))]
        pre = [rng.choice(ids) for _ in range(rng.randint(0, 24))]
        gap = [rng.choice(ids) for _ in range(rng.randint(0, 24))]
        seq = pre + x + gap + x + x
        labels = [-100] * (len(pre) + len(x) + len(gap) + 1) + x[1:] + x
        out.append((seq, labels))
    return out


def pretrain(out: Path, tokenizer: str, recipe: str, steps: int, lr: float, seed: int) -> None:
    """Train a fresh model of `recipe`'s `model.tiny` shape on copying (`copy_batch`) and save
    it, with `tokenizer`, to `out`."""
    from transformers import AutoTokenizer

    from kitchen.models import build_tiny_model
    from kitchen.sft import load_recipe

    shape = load_recipe(recipe).model.tiny
    if shape is None:
        raise SystemExit(f"{recipe}: no model.tiny block to take the shape from")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    model = build_tiny_model(tok, shape, seed=seed).train()
    special = set(tok.all_special_ids)
    ids = [i for i in range(256, len(tok)) if i not in special]  # past the 256 byte tokens
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    rng = random.Random(seed)
    for step in range(steps):
        batch = copy_batch(rng, ids, 32)
        n = max(len(s) for s, _ in batch)
        inp = torch.tensor([s + [tok.pad_token_id] * (n - len(s)) for s, _ in batch])
        lab = torch.tensor([y + [-100] * (n - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s, _ in batch])
        loss = model(input_ids=inp, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warm.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: copy loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policies", nargs="*", help="model folders (a cold start's final/, ...)")
    ap.add_argument("--pretrain", type=Path, metavar="OUT", help="train a copying base instead")
    ap.add_argument("--tokenizer", help="with --pretrain: the tokenizer's folder")
    ap.add_argument("--recipe", default=str(paths.HOME / "recipes" / "sft_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dialogues", default=str(paths.DATA / "sft" / "eval.jsonl"))
    ap.add_argument("--n", type=int, default=60, help="dialogues read (default 60)")
    ap.add_argument("--renamed", action="store_true", help="invent every dish's name first")
    ap.add_argument("--seed", type=int, default=0, help="seeds the invented names")
    args = ap.parse_args()
    try:
        run(ap, args)
    except (KitchenError, OSError, ValueError) as e:
        raise SystemExit(f"bench_copying: {e}") from None


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pretrain:
        if not args.tokenizer:
            ap.error("--pretrain needs --tokenizer (a folder with the tokenizer to build on)")
        pretrain(args.pretrain, args.tokenizer, args.recipe, args.steps, args.lr, args.seed)
        return
    if not args.policies:
        ap.error("name at least one policy (or --pretrain OUT)")
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
