"""Reviews per second: the GRM's review conversations on `kitchen.engine` against `generate`, and
against one conversation per clause.

Not a test (timings depend on the machine; ratios from one run are what counts). Run:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grm.py --threads 1      # 48 dialogues
    .venv/bin/python benchmarks/bench_grm.py --n 96 --batch 32 --grm data/models/grm-tiny
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grm.py --threads 1 --batch 32 --lookahead
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grm.py --threads 1 --batch 32 --n 64 \
        --policy data/models/policy-tiny --grm data/models/grm-tiny --compare runs/grm_tiny_short/final

On the shipped tiny GRM, over the same held-out dialogues (scripted, both agents, `--long` of them
meals), greedy and structure-constrained as `GRM.review` runs by default:

- **engine** — `GRM.review` as it runs: every review conversation is a row of one engine batch
  that keeps its KV cache from one reviewed turn to the next (a turn costs only its own tokens);
- **generate** — the same conversations through transformers' `generate`, one turn index at a
  time for every open review, each call re-reading the conversation so far: what a review costs
  without the engine. Both paths write the same lines (greedy), which this script checks;
- **per clause** — the way a reviewer without a structured language works: one conversation per
  (trajectory, clause), the constitution reduced to that clause, on the engine. Why one
  conversation reviews every clause of a turn.

It prints reviews/s, the ratios, each mode's agreement with the rule judge on decided cells, and
how far the engine is from its arithmetic limit (the FLOPs of reading every prompt token once and
writing every review token, over the measured matmul throughput).

`--lookahead` asks whether speculative decoding would pay on this machine: review lines copy much
from their prompt (a dish's facts, the structure of the line before), so a draft of the next k
tokens looked up in the conversation so far (prompt lookup: the tokens that followed the last
earlier occurrence of the newest 3 tokens) would often be right, and the model could check k
drafted tokens in one forward. It records the engine's review completions, replays them to count
the tokens one such forward would accept on average (exact for greedy decoding), times a forward
of k + 1 tokens per row against a one-token decode step on a cache as wide as a review's, and
prints the projected decode speedup (tokens per forward over the forward's relative cost).
Measured on this 2-core machine (2026-12-05): 1.52 tokens per forward with one drafted token,
2.26 with eight, but a forward of 2 tokens per row costs 2.54 decode steps and one of 9, 4.92
(attention reads every key once per query on a CPU, and transformers repeats the grouped K/V
heads for more than one query), so the projection is 0.60x and 0.46x: not built.

The last line says where a decode step goes: rows a step (writing, or riding along while they
wait for their prefill), the attention's width (every row reads the widest row's columns) and the
share of it that holds tokens, and a step of that shape against one forward's fixed cost. On
this machine without AMX (float32, 2026-12-07; `--policy data/models/policy-tiny --n 32 --batch
32 --no-per-clause`): 548 steps, 21.2 rows a step (17.6 writing), 1,029 columns wide, 63% filled;
a step 20.3 ms, 6.6 of them fixed. A review decodes few rows at a time, so the fixed cost and
the unfilled columns are a third of its decode; what was tried against them is in the README
(*On a CPU without AMX*).

`--compare GRM` puts a second GRM beside `--grm` on the same dialogues (with `--policy`, that
policy's rollouts on held-out tasks, what RL reviews), both with the cascade the main job uses
(T3, T6 by code), taken in turn twice: review seconds, lines and tokens written a line, decided
agreement with the rule judge and each red line's violation recall — what a GRM that writes
shorter lines (`recipes/grm_tiny_short.yaml`) buys and what it costs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kitchen.calibrate import agreement
from kitchen.critique import conversation, review_turns
from kitchen.grm import GRM, GRMConfig
from kitchen.grmdata import policy_episodes, pool
from kitchen.judge import judge
from kitchen.review import Review


def per_clause_reviews(grm: GRM, trajs, pcs) -> list[Review]:
    """One review conversation per (trajectory, clause); verdicts assembled per trajectory."""
    ones, owners = [], []
    for i, pc in enumerate(pcs):
        for clause in pc.clauses:
            ones.append(pc.model_copy(update={"clauses": [clause]}))
            owners.append(i)
    got = grm.review([trajs[i] for i in owners], ones)
    cells: list[dict] = [{} for _ in trajs]
    for i, r in zip(owners, got, strict=True):
        cells[i] |= {(v.turn, v.clause): v for v in r.verdicts}
    out = []
    for i, (traj, pc) in enumerate(zip(trajs, pcs, strict=True)):
        verdicts = [cells[i][(t, c)] for t in range(len(traj.turns)) for c in pc.ids]
        produced = sum(v.verdict is not None for v in verdicts)
        out.append(
            Review(
                trajectory=traj.id,
                personal_version=pc.version,
                source="grm",
                turns=len(traj.turns),
                clauses=pc.ids,
                verdicts=verdicts,
                parsed_fraction=produced / len(verdicts) if verdicts else 1.0,
            )
        )
    return out


def review_flops(grm: GRM, trajs, pcs, texts) -> float:
    """Least arithmetic of the reviews: every prompt and review token once through the layers
    (2·P each), attention over its prefix (4·L·d per position), the output layer per review
    token (2·d·V)."""
    cfg = grm.model.config
    d, f, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = d // cfg.num_attention_heads * cfg.num_key_value_heads
    p = L * (2 * d * d + 2 * d * kv + 3 * d * f)
    total = 0.0
    for traj, pc, text in zip(trajs, pcs, texts, strict=True):
        lines = text.split("\n")
        n = len(grm.tokens(conversation(review_turns(traj, pc), lines)))
        n_r = sum(len(grm.tok(x, add_special_tokens=False)["input_ids"]) + 1 for x in lines)
        total += 2 * p * n + 4 * L * d * n * (n + 1) / 2 + 2 * d * v * n_r
    return total


def gflops() -> float:
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(40):
        a @ b
    return 2 * 256 * 512 * 512 * 40 / (time.perf_counter() - t) / 1e9


def prompt_lookup(context: list[int], k: int, n: int = 3) -> list[int]:
    """The k tokens that followed the last earlier occurrence of `context`'s newest m tokens
    (m = n, then shorter), or none."""
    for m in range(min(n, len(context) - 1), 0, -1):
        tail = context[-m:]
        for s in range(len(context) - m - 1, -1, -1):
            if context[s : s + m] == tail:
                return context[s + m : s + m + k]
    return []


def tokens_per_forward(records: list[tuple[list[int], list[int]]], k: int) -> float:
    """Greedy decoding with k drafted tokens per forward: tokens written per forward."""
    forwards = tokens = 0
    for prompt, gen in records:
        context, i = list(prompt), 0
        while i < len(gen):
            draft, took = prompt_lookup(context, k), 0
            while took < len(draft) and i + took < len(gen) and draft[took] == gen[i + took]:
                took += 1
            took = min(took + 1, len(gen) - i)  # the accepted drafts and the model's own token
            context += gen[i : i + took]
            i, forwards = i + took, forwards + 1
        tokens += len(gen)
    return tokens / max(forwards, 1)


def forward_ms(grm: GRM, rows: int, width: int, q: int, repeats: int = 10) -> float:
    """Milliseconds of one engine forward feeding q tokens to each of `rows` rows whose caches
    hold `width` tokens."""
    from kitchen.engine import Engine, RaggedCache

    engine = Engine(grm.model, max_rows=rows)
    cache = RaggedCache(engine.layers)
    cache.add_rows(rows)
    cache.reserve(width + q + 1)
    vocab = engine.vocab
    with torch.inference_mode():
        cols = torch.arange(width)[None].expand(rows, width)
        engine._forward(cache, torch.randint(0, vocab, (rows, width)), cols, width)
        ids = torch.randint(0, vocab, (rows, q))
        cols = (width + torch.arange(q))[None].expand(rows, q)
        engine._forward(cache, ids, cols, width + q)
        t = time.perf_counter()
        for _ in range(repeats):
            engine._forward(cache, ids, cols, width + q)
    return (time.perf_counter() - t) / repeats * 1000


def review_completions(grm: GRM, trajs, pcs) -> list[tuple[list[int], list[int]]]:
    """`grm.review(trajs, pcs)`, recording every review line the engine writes: (its prompt's
    token ids, the line's token ids)."""
    from kitchen import engine as engine_module

    records: list[tuple[list[int], list[int]]] = []
    serve = engine_module.Engine.serve

    def recording(self, requests, params, on_done, **kw):
        prompts = {r.key: list(r.prompt) for r in requests}

        def done(key, completion):
            records.append((prompts[key], list(completion.tokens)))
            nxt = on_done(key, completion)
            if nxt is not None:
                prompts[key] = list(nxt[0])
            return nxt

        return serve(self, requests, params, done, **kw)

    engine_module.Engine.serve = recording
    try:
        grm.review(trajs, pcs)
    finally:
        engine_module.Engine.serve = serve
    return records


def lookahead(grm: GRM, trajs, pcs) -> None:
    """Would prompt-lookup speculative decoding speed the review up here? (module docstring)"""
    records = review_completions(grm, trajs, pcs)
    width = round(sum(len(p) + len(g) for p, g in records) / len(records))
    rows = min(grm.cfg.batch_size, 32)
    one = forward_ms(grm, rows, width, 1)
    print(
        f"\nlookahead: {len(records)} review lines, {sum(len(g) for _, g in records)} tokens; "
        f"one decode step ({rows} rows, {width} cached tokens each): {one:.1f} ms"
    )
    print("\n| k drafted | tokens per forward | forward cost (decode steps) | projected speedup |")
    print("|---:|---:|---:|---:|")
    for k in (1, 2, 4, 8):
        gain = tokens_per_forward(records, k)
        cost = forward_ms(grm, rows, width, k + 1) / one
        print(f"| {k} | {gain:.2f} | {cost:.2f} | {gain / cost:.2f}x |")


def compare(grms: dict[str, GRM], trajs, pcs, refs, rounds: int = 2) -> None:
    """Two GRMs on the same dialogues, as RL runs them: review seconds (the best of `rounds`,
    taken in turn so that a noisy machine slows both alike), tokens written a line, decided
    agreement with the rule judge and the red lines' violation recall."""
    best: dict[str, float] = {}
    out: dict[str, tuple] = {}
    for _ in range(rounds):
        for name, g in grms.items():
            reviews, wall, _ = timed(lambda g=g: g.review(trajs, pcs))
            best[name] = min(best.get(name, wall), wall)
            lines = [x for t in g.last_text for x in t[0].splitlines() if x.strip()]
            tokens = sum(len(g.tok(x, add_special_tokens=False)["input_ids"]) for x in lines)
            out[name] = (agreement(reviews, refs), len(lines), tokens)
    print(
        "\n| GRM | review s (best) | lines | tokens a line | decided agreement | A1 | A2 | A3 | A4 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (rep, n, tokens) in out.items():
        recall = {c.clause: c.recall.get("violate") for c in rep.clauses}
        cells = " | ".join(
            "—" if recall.get(a) is None else f"{recall[a]:.1%}" for a in ("A1", "A2", "A3", "A4")
        )
        print(
            f"| {name} | {best[name]:.1f} | {n} | {tokens / max(n, 1):.1f} | "
            f"{rep.decided_accuracy:.1%} | {cells} |"
        )
    a, b = list(best)
    print(f"\nreview time {b} / {a}: {best[b] / best[a]:.2f}x")


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=48, help="held-out dialogues (default 48)")
    ap.add_argument("--batch", type=int, default=64, help="reviews decoded together")
    ap.add_argument("--grm", default=GRMConfig().model, help="GRM checkpoint")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--long", type=float, default=0.5, help="share of long (meal) dialogues")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-per-clause", action="store_true", help="skip the per-clause mode")
    ap.add_argument(
        "--lookahead", action="store_true", help="only: would speculative decoding pay here?"
    )
    ap.add_argument(
        "--compare",
        metavar="GRM",
        help="only: this GRM against --grm on the same dialogues, with the cascade RL uses "
        "(T3, T6): review time, tokens a line, agreement, red-line recall",
    )
    ap.add_argument(
        "--compare-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the precision the --compare GRM reviews in (GRMConfig.dtype)",
    )
    ap.add_argument(
        "--policy",
        metavar="POLICY",
        help="review this policy's rollouts on held-out tasks (what RL reviews) instead of "
        "the scripted agents' dialogues",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if args.policy:
        pairs = policy_episodes(args.policy, args.n, "heldout", args.seed, long_share=args.long)
    else:
        triples = pool(args.n, "heldout", args.seed, {"grm": 0.5, "sft": 0.5}, long_share=args.long)
        pairs = [(t, pc) for t, pc, _ in triples]
    trajs = [t for t, _ in pairs]
    pcs = [pc for _, pc in pairs]
    refs = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    if args.compare:
        rl = {"batch_size": args.batch, "cascade": ["T3", "T6"]}
        other = f"{args.compare} ({args.compare_dtype})"
        grms = {
            args.grm: GRM.load(GRMConfig(model=args.grm, **rl)),
            other: GRM.load(GRMConfig(model=args.compare, dtype=args.compare_dtype, **rl)),
        }
        for g in grms.values():
            g.review(trajs[:2], pcs[:2])  # warm-up
        print(
            f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python "
            f"benchmarks/bench_grm.py --n {args.n} --batch {args.batch} --threads "
            f"{args.threads} --grm {args.grm} --compare {args.compare} "
            f"--compare-dtype {args.compare_dtype}"
            + (f" --policy {args.policy}" if args.policy else "")
        )
        print(f"{len(trajs)} held-out dialogues, {torch.get_num_threads()} CPU thread(s)")
        compare(grms, trajs, pcs, refs)
        return
    cfg = GRMConfig(model=args.grm, batch_size=args.batch)
    grm = GRM.load(cfg)
    slow_grm = GRM(grm.model, grm.tok, cfg.model_copy(update={"engine": "generate"}))
    clauses = sum(len(pc.clauses) for pc in pcs) / len(pcs)
    turns = sum(len(t.turns) for t in trajs) / len(trajs)
    load0 = os.getloadavg()[0]
    grm.review(trajs[:2], pcs[:2])  # warm-up: first-call overheads (the engine's self-check)
    if args.lookahead:
        lookahead(grm, trajs, pcs)
        return

    grm.stats.clear()
    fast, w_fast, c_fast = timed(lambda: grm.review(trajs, pcs))
    work = dict(grm.stats)
    texts = [t[0] for t in grm.last_text]
    slow, w_slow, c_slow = timed(lambda: slow_grm.review(trajs, pcs))
    rows = [
        ("engine", fast, w_fast, c_fast, len(trajs)),
        ("generate", slow, w_slow, c_slow, len(trajs)),
    ]
    if not args.no_per_clause:
        single, w_one, c_one = timed(lambda: per_clause_reviews(grm, trajs, pcs))
        rows.append(("per clause", single, w_one, c_one, round(len(trajs) * clauses)))
    same = sum(a == b for a, b in zip(texts, [t[0] for t in slow_grm.last_text], strict=True))
    limit = review_flops(grm, trajs, pcs, texts) / (gflops() * 1e9)

    print(
        f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python "
        f"benchmarks/bench_grm.py --n {args.n} --batch {args.batch} --threads {args.threads}"
        + (" --no-per-clause" if args.no_per_clause else "")
        + (f" --policy {args.policy}" if args.policy else "")
    )
    print(
        f"{len(trajs)} held-out dialogues ({args.long:.0%} meals, {turns:.1f} turns), "
        f"{clauses:.1f} active clauses each, {torch.get_num_threads()} CPU thread(s), GRM "
        f"{args.grm}, load average {load0:.1f}"
    )
    print("\n| mode | conversations | seconds (wall) | seconds (CPU) | reviews/s | acc (p/v) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, reviews, wall, cpu, convs in rows:
        acc = agreement(reviews, refs).decided_accuracy
        print(
            f"| {name} | {convs} | {wall:.1f} | {cpu:.1f} | {len(trajs) / wall:.2f} | {acc:.1%} |"
        )
    print(
        f"\nengine vs generate: {w_slow / w_fast:.2f}x the reviews/s (CPU time {c_slow / c_fast:.2f}x)"
    )
    print(f"same review lines through both paths (greedy): {same} of {len(trajs)}")
    if not args.no_per_clause:
        print(f"every clause in one conversation vs one per clause: {w_one / w_fast:.1f}x faster")
    print(f"engine CPU time / arithmetic limit ({limit:.2f} s): {c_fast / limit:.1f}x")
    decode_shape(grm, work)


def decode_shape(grm: GRM, work: dict[str, int]) -> None:
    """Where a decode step's time goes: rows a step (writing, riding along), the attention's
    width and how much of it holds tokens, and one forward's fixed cost (1 row, 10 tokens)
    against a step of the measured mean shape."""
    steps = work.get("decode_steps", 0)
    if not steps:
        return
    rows = work["decode_rows"] / steps
    width = work["decode_cols"] / max(work["decode_rows"], 1)
    fixed = forward_ms(grm, 1, 10, 1)
    step = forward_ms(grm, max(1, round(rows)), max(1, round(width)), 1)
    print(
        f"decode: {steps} steps, {rows:.1f} rows a step "
        f"({(work['decode_rows'] - work['riders']) / steps:.1f} writing, the rest waiting for "
        f"their prefill), attention {width:.0f} columns wide, "
        f"{work['decode_filled'] / max(work['decode_cols'], 1):.0%} of them filled; a step of that "
        f"shape {step:.1f} ms, of which {fixed:.1f} ms one forward's fixed cost"
    )


if __name__ == "__main__":
    main()
