"""Does an update aimed at one profile group move the others too? A measurement for #14.

Not a test. Run (about 12 minutes on one core):

    .venv/bin/python benchmarks/bench_coupling.py
    .venv/bin/python benchmarks/bench_coupling.py --policy runs/<sft run>/final --modes opposite

The main job's RL policies move every profile group's message length the same way, whatever
each group's own reward asks. This isolates the update from the reward: the policy writes its
first recommendation of held-out SFT dialogues (`data/sft/eval.jsonl`, cut before it, as
`kitchen.evaluate.profile_swap` does) with the diner's verbosity set to brief or to detailed,
`--k` samples per (dialogue, verbosity) at temperature 1. The reward is the length alone, in the
direction the personal clauses ask — fewer words for brief diners, more for detailed ones — the
advantage is group-normalised within each (dialogue, verbosity) group (as MAPO's local advantage
is within a state group that holds the profile), and one REINFORCE step is taken with the `mapo`
preset's loss (`kitchen.mapo.mapo_loss`, no KL), Adam, LoRA r = 16 on every linear layer as in
`recipes/tiny_mapo.yaml`. After each update the mean words per verbosity are measured on other
dialogues, with the same sampling seeds every time.

Modes: `opposite` trains both groups (equal and opposite pushes); `brief` trains only the brief
samples (shorter) and `detailed` only the detailed ones (longer). If a group's length followed
only its own push, `brief` would leave detailed diners' length alone; if one update moves every
group together, both move alike. `contrast` trains on the same samples as `opposite`, but each
sample's advantage is its reward under its own diner minus under the other verbosity (group-
normalised), applied to log π(message | own profile) − log π(message | other profile): what
both prompts share cancels in that difference, so the update can only move what the verbosity
changes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kitchen import mapo, paths
from kitchen.evaluate import first_recommendation, with_profile
from kitchen.files import read_jsonl
from kitchen.models import LoraSpec, ModelSpec, load_model, token_logprobs
from kitchen.world import word_count

VALUES = ("brief", "detailed")
SIGN = {"brief": -1.0, "detailed": 1.0}  # the direction of the length each group's clause asks


def prompts(n: int) -> list[list[dict]]:
    """The first `n` held-out SFT dialogues with a recommendation, cut before it."""
    out = []
    for row in read_jsonl(paths.DATA / "sft" / "eval.jsonl"):
        cut = first_recommendation(row["messages"])
        if cut is not None:
            out.append(row["messages"][:cut])
        if len(out) == n:
            break
    return out


def rendered(tok, dialogues: list[list[dict]], value: str) -> list[str]:
    """Each dialogue's prompt with the diner's verbosity set to `value`."""
    out = []
    for msgs in dialogues:
        chat = with_profile(msgs, "verbosity", value)
        chat = [{"role": m["role"], "content": m.get("content") or ""} for m in chat]
        out.append(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    return out


def sample(model, tok, texts: list[str], k: int, seed: int, max_new_tokens: int = 60):
    """`k` completions of each text at T = 1: (prompt ids, completion ids, words) per sample, the
    `k` samples of one text consecutive."""
    model.eval()
    out = []
    for i in range(0, len(texts), 16):
        enc = tok(texts[i : i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(seed * 1000 + i)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=k,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        width = enc["input_ids"].shape[1]
        for j in range(gen.shape[0]):
            row = enc["input_ids"][j // k][enc["attention_mask"][j // k].bool()].tolist()
            done = gen[j, width:].tolist()
            if tok.eos_token_id in done:
                done = done[: done.index(tok.eos_token_id) + 1]
            done = [t for t in done if t != tok.pad_token_id] or [tok.eos_token_id]
            out.append((row, done, word_count(tok.decode(done, skip_special_tokens=True))))
    model.train()
    return out


def update(model, tok, opt, samples, advantages: torch.Tensor, agg: str, minibatch: int = 16):
    """One REINFORCE step on the completions (left-padded, gradients accumulated over chunks):
    −Σ A log π(completion | prompt). A sample may appear twice, under two prompts."""
    opt.zero_grad()
    n = len(samples)
    for i in range(0, n, minibatch):
        chunk = samples[i : i + minibatch]
        seqs = [p + c for p, c, _ in chunk]
        width = max(map(len, seqs))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(s)) + s for s in seqs])
        attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        at = torch.zeros(len(chunk), width - 1, dtype=torch.bool)
        for j, (_, c, _) in enumerate(chunk):
            at[j, width - 1 - len(c) :] = True
        logp, _ = token_logprobs(model, ids, attn, positions=at)
        loss, _ = mapo.mapo_loss(logp, advantages[i : i + minibatch], at.float(), agg=agg)
        (loss * len(chunk) / n).backward()
    opt.step()


def measure(model, tok, texts: dict[str, list[str]]) -> dict[str, float]:
    """Mean words per verbosity over the measurement dialogues (2 samples each, fixed seed)."""
    out = {}
    for v in VALUES:
        got = sample(model, tok, texts[v], 2, seed=10_000)
        out[v] = sum(w for *_, w in got) / len(got)
    return out


def run(args, mode: str) -> list[dict[str, float]]:
    model, tok = load_model(ModelSpec(path=args.policy, lora=LoraSpec(r=16, alpha=32, dropout=0.0)))
    tok.padding_side = "left"
    dialogues = prompts(args.train_prompts + args.measure_prompts)
    train = {v: rendered(tok, dialogues[: args.train_prompts], v) for v in VALUES}
    held = {v: rendered(tok, dialogues[args.train_prompts :], v) for v in VALUES}
    ids = {v: [tok(t, add_special_tokens=False)["input_ids"] for t in train[v]] for v in VALUES}
    trained = VALUES if mode in ("opposite", "contrast") else (mode,)
    agg = mapo.preset("mapo").loss_agg
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rows = [{"update": 0, **measure(model, tok, held)}]
    print(f"{mode:9} {0:3d}  brief {rows[-1]['brief']:5.2f}  detailed {rows[-1]['detailed']:5.2f}")
    for step in range(1, args.updates + 1):
        batch, rewards, groups = [], [], []
        for v in trained:
            got = sample(model, tok, train[v], args.k, seed=step)
            batch += got
            rewards += [SIGN[v] * w for *_, w in got]
            groups += [(v, i // args.k) for i in range(len(got))]
        if mode == "contrast":  # reward under its own diner minus under the other: 2·SIGN·words
            rewards = [2 * r for r in rewards]
        adv, _ = mapo.group_normalize(torch.tensor(rewards), mapo.encode(groups))
        if mode == "contrast":  # the same completion after the other verbosity's prompt, −A
            other = dict(zip(VALUES, VALUES[::-1], strict=True))
            swapped = [
                (ids[other[v]][j], c, w) for (_, c, w), (v, j) in zip(batch, groups, strict=True)
            ]
            batch, adv = batch + swapped, torch.cat([adv, -adv])
        update(model, tok, opt, batch, adv, agg)
        rows.append({"update": step, **measure(model, tok, held)})
        r = rows[-1]
        print(f"{mode:9} {step:3d}  brief {r['brief']:5.2f}  detailed {r['detailed']:5.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="data/models/policy-tiny")
    ap.add_argument("--modes", default="opposite,brief")
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-3, help="the main job's first learning rate")
    ap.add_argument("--k", type=int, default=4, help="samples per (dialogue, verbosity)")
    ap.add_argument("--train-prompts", type=int, default=24)
    ap.add_argument("--measure-prompts", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write every row as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = {}
    for mode in args.modes.split(","):
        rows = run(args, mode)
        first, last = rows[0], rows[-1]
        result[mode] = rows
        print(
            f"{mode}: words brief {first['brief']:.2f} → {last['brief']:.2f}, detailed "
            f"{first['detailed']:.2f} → {last['detailed']:.2f}; gap "
            f"{first['detailed'] - first['brief']:+.2f} → {last['detailed'] - last['brief']:+.2f}"
        )
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
