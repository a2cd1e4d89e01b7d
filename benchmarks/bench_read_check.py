"""Can a policy of this shape learn to read an allergen check at all? For #14.

Not a test. The cold start's policy recommends a dish its check found unsafe about as often as a
safe one (`bench_red_lines.py --probe`), even on its own training dialogues. This script asks
whether that is the architecture or the setting: it trains a fresh tiny policy (the `model.tiny`
block of an SFT recipe, the shipped policy's tokenizer) on that one decision alone. Each example
is the world's system prompt for a diner with one or two allergies, `--filler` search results (a
meal's dialogue puts ~500 tokens between the profile and a late check; 0 puts none), the reply to
an `@allergens` check, and the assistant header; the loss is on the next turn's first token
alone: `@allergens` (check another dish) when the dish holds one of the diner's allergens, the
dish's name otherwise. Half the examples are unsafe; eight two-allergy lists are held out. Every
`--every` steps it prints the share of examples whose most likely first token is `@allergens`
exactly when the dish is unsafe, on training and on held-out lists (256 fresh examples each).

`--profile world` writes the allergies as the world does (`allergies=peanut,sesame`, tokens
`=peanut`, `,sesame` that the check's reply never holds); `--profile reply` as the check's reply
spells allergens (`allergies: peanut, sesame`, the same tokens).

    .venv/bin/python benchmarks/bench_read_check.py --lr 1e-3 --steps 2000   # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from pathlib import Path
from typing import NamedTuple

import torch
import yaml

from kitchen import paths
from kitchen.models import TinyModelConfig, build_tiny_model, render_chat
from kitchen.world import Dish, check_reply, load_menu, search_entry, system_prompt

CHECK = "@allergens"


class Example(NamedTuple):
    text: str  # the rendered context, up to and including the assistant header
    target: str  # what the next turn opens with
    unsafe: bool


def allergy_lists(
    seed: int, held_out: int = 8
) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """(training lists, held-out lists): every one- and two-allergen list of the menu's allergens,
    `held_out` of the two-allergen ones set aside."""
    allergens = sorted({a for d in load_menu().dishes for a in d.allergens})
    pairs = list(itertools.combinations(allergens, 2))
    held = random.Random(seed).sample(pairs, held_out)
    return [(a,) for a in allergens] + [p for p in pairs if p not in held], held


def profile(allergies: tuple[str, ...], form: str) -> str:
    """The world's system prompt (a meal's), its allergy list in `form`."""
    text = system_prompt({"verbosity": "normal", "allergies": list(allergies)}, meal=True)
    if form == "reply":
        text = text.replace(
            f"allergies={','.join(allergies)}", f"allergies: {', '.join(allergies)}"
        )
    return text


def example(
    rng: random.Random,
    lists: list[tuple[str, ...]],
    dishes: list[Dish],
    unsafe: bool,
    *,
    form: str = "world",
    filler: int = 0,
) -> Example:
    """One decision: a list from `lists` and a dish that does (`unsafe`) or does not hold one of
    its allergens, after `filler` search results."""
    while True:
        allergies, dish = rng.choice(lists), rng.choice(dishes)
        if bool(set(dish.allergens) & set(allergies)) == unsafe:
            break
    search = "; ".join(map(search_entry, rng.sample(dishes, filler)))
    messages = [{"role": "system", "content": profile(allergies, form)}]
    if filler:
        messages.append({"role": "tool", "content": f"results: {search}"})
    messages.append({"role": "tool", "content": check_reply(dish)})
    text = render_chat(messages, add_generation_prompt=True)
    return Example(text, CHECK if unsafe else dish.name, unsafe)


def batch(tok, examples: list[Example]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Left-padded inputs (the decision at the last position) and each target's first token."""
    enc = tok(
        [e.text for e in examples],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    input_ids, mask = enc["input_ids"], enc["attention_mask"]  # (B, T)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # left padding starts at 0
    targets = torch.tensor(
        [tok(e.target, add_special_tokens=False)["input_ids"][0] for e in examples]
    )
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=paths.HOME / "recipes" / "sft_tiny.yaml")
    ap.add_argument("--tokenizer", default=str(paths.DATA / "models" / "policy-tiny"))
    ap.add_argument("--profile", choices=("world", "reply"), default="world")
    ap.add_argument("--filler", type=int, default=0, help="search results before the check")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW, constant (default 1e-3)")
    ap.add_argument("--every", type=int, default=250, help="measure every N steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 2 or args.every < 1 or args.filler < 0 or args.lr <= 0:
        ap.error("--steps, --every ≥ 1, --batch ≥ 2, --filler ≥ 0 and --lr > 0")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    spec = yaml.safe_load(args.recipe.read_text())["model"]["tiny"]
    model = build_tiny_model(tok, TinyModelConfig(**spec), seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_lists, held = allergy_lists(args.seed)
    dishes = list(load_menu().dishes)
    rng = random.Random(args.seed)

    def draw(lists: list[tuple[str, ...]], n: int) -> list[Example]:
        return [
            example(rng, lists, dishes, i % 2 == 0, form=args.profile, filler=args.filler)
            for i in range(n)
        ]

    check_id = tok(CHECK, add_special_tokens=False)["input_ids"][0]

    @torch.no_grad()
    def accuracy(lists: list[tuple[str, ...]]) -> float:
        model.eval()
        examples = draw(lists, 256)
        inputs, _ = batch(tok, examples)
        says_check = model(**inputs).logits[:, -1].argmax(-1) == check_id
        model.train()
        return (says_check == torch.tensor([e.unsafe for e in examples])).float().mean().item()

    print(f"profile {args.profile}, filler {args.filler}, lr {args.lr:g}, batch {args.batch}")
    start = time.time()
    for step in range(args.steps + 1):
        if step % args.every == 0 or step == args.steps:
            print(
                f"step {step:>5}: reads the check in {accuracy(train_lists):.1%} (training lists), "
                f"{accuracy(held):.1%} (held-out lists) — {time.time() - start:.0f} s",
                flush=True,
            )
        if step == args.steps:
            break
        inputs, targets = batch(tok, draw(train_lists, args.batch))
        loss = torch.nn.functional.cross_entropy(model(**inputs).logits[:, -1], targets)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
