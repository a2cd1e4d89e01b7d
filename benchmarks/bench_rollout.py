"""Rollout speed: today's path (transformers' `generate`) against `kitchen.engine`, in one run.

Not a test (timings depend on the machine; ratios from one run are what counts). Run:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rollout.py --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rollout.py --threads 1 --updates 0  # rollouts only

What it prints, each figure for both paths and their ratio:

1. **The machine**: fp32 matmul throughput (the arithmetic limits below divide by it) and copy
   bandwidth (what a decode step's reading of the KV cache is bound by).
2. **Rollouts in the main job's setting** (`recipes/tiny_mapo.yaml`: the shipped tiny policy with
   its LoRA adapter, K = 8, 4 tasks, ≤ 8 turns, ≤ 40 tokens a turn, the same seeds), each path
   `--reps` times, interleaved (generate, engine, generate, ...) so that other load on the
   machine falls on both; medians. Generated tokens/s (wall and CPU time), prefill tokens per
   generated token (tokens read before sampling, padding included), and how far each is from
   the arithmetic limit: the FLOPs the episodes need at least (each context token read once:
   2·P per token through the layers, 4·L·d per token and context position for attention, 2·d·V
   per sampled token for the output layer) over the measured matmul throughput.
3. **Where the engine's time goes**: prefill forwards, decode forwards, the rest (tokenizing
   prompts, worlds, sampling bookkeeping), with forward counts, rows per decode step and
   riders (rows waiting for their prefill); `--profile` adds cProfile's top functions.
4. **Long episodes** (the world's meal tasks, up to 24 turns, ~1,000–2,000 tokens of context;
   `--long 0` skips them).
5. **Seconds per RL update**: `kitchen.train.Run.step()` of the main-job recipe (rollout, GRM
   review with the shipped tiny GRM, advantages, update), today's path (`force_generate`: the
   rollout and the GRM on `generate`) against the engine, interleaved, with their phases.

GRM reviews/s before and after: `benchmarks/bench_grm.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from kitchen import paths


def matmul_gflops(n: int = 512, reps: int = 40) -> float:
    """Best-of-3 fp32 GEMM throughput at [256, n] × [n, n] (the shapes of a tiny model's prefill)."""
    a, b = torch.randn(256, n), torch.randn(n, n)
    best = 0.0
    for _ in range(3):
        for _ in range(3):
            a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * 256 * n * n * reps / (time.perf_counter() - t) / 1e9)
    return best


def copy_gbs(mb: int = 64) -> float:
    x = torch.randn(mb * 2**18)
    y = torch.empty_like(x)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        best = max(best, 2 * x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def shape(model) -> dict:
    """Layers, width, KV width, MLP width, vocabulary and matmul parameters per token."""
    cfg = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    d, f, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = d // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f  # q, o, k, v, gate/up/down
    return {"L": L, "d": d, "V": v, "P": L * per_layer}


def episode_flops(s: dict, contexts: list[int], generated: int) -> float:
    """Least arithmetic of episodes whose final contexts are `contexts` tokens long and which
    sampled `generated` tokens: every context token once through the layers, attention over its
    prefix, the output layer for every sampled token."""
    linear = sum(2 * s["P"] * n for n in contexts)
    attention = sum(4 * s["L"] * s["d"] * n * (n + 1) / 2 for n in contexts)
    return linear + attention + 2 * s["d"] * s["V"] * generated


def final_contexts(tok, trajs) -> list[int]:
    from kitchen.rollout import prompt_ids

    out = []
    for t in trajs:
        if t.turns and t.turns[-1].tokens:
            last = len(t.turns) - 1
            out.append(len(prompt_ids(tok, t.prompt_messages(last))) + len(t.turns[-1].tokens))
    return out


class Timer:
    """Wall and CPU seconds of named phases, by wrapping methods (benchmark-only)."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


def play(model, tok, jobs, cfg, seed, *, today: bool):
    from kitchen.engine import force_generate
    from kitchen.rollout import rollout

    with force_generate() if today else contextlib.nullcontext():
        w, c = time.perf_counter(), time.process_time()
        trajs, stats = rollout(model, tok, jobs, cfg, seed=seed)
        return trajs, stats, time.perf_counter() - w, time.process_time() - c


def compare_rollouts(model, tok, jobs, cfg, args, label: str, timer: Timer, limit: float):
    rows: dict[str, list[dict]] = {"generate": [], "engine": []}
    profile = None
    for rep in range(args.reps):
        for name in ("generate", "engine"):
            timer.reset()
            prof = cProfile.Profile() if args.profile and name == "engine" and rep == 0 else None
            with prof or contextlib.nullcontext():
                trajs, stats, wall, cpu = play(
                    model, tok, jobs, cfg, args.seed, today=name == "generate"
                )
            profile = prof or profile
            ctx = final_contexts(tok, trajs)
            flops = episode_flops(shape(model), ctx, stats.tokens)
            rows[name].append(
                {
                    "tokens": stats.tokens,
                    "wall": wall,
                    "cpu": cpu,
                    "prefill": stats.prefill_per_token,
                    "limit": flops / (limit * 1e9),
                    "turns": stats.turns,
                    "ctx": statistics.fmean(ctx) if ctx else 0.0,
                    "phases": dict(timer.cpu),
                    "calls": dict(timer.calls),
                    "extra": dict(stats.extra),
                }
            )
    med = {
        n: {
            k: statistics.median(r[k] for r in rs)
            for k in ("tokens", "wall", "cpu", "prefill", "limit", "turns", "ctx")
        }
        for n, rs in rows.items()
    }
    g, e = med["generate"], med["engine"]
    print(
        f"\n## {label}: {len(jobs)} jobs × K={cfg.k}, ≤{cfg.max_turns} turns of ≤{cfg.max_new_tokens} tokens, median of {args.reps}\n"
    )
    print("| | generate (today) | engine | engine / generate |")
    print("|---|---:|---:|---:|")
    for key, title, fmt in (
        ("tokens", "generated tokens", "{:.0f}"),
        ("turns", "assistant turns", "{:.0f}"),
        ("ctx", "mean final context (tokens)", "{:.0f}"),
        ("wall", "seconds (wall)", "{:.2f}"),
        ("cpu", "seconds (CPU)", "{:.2f}"),
    ):
        print(
            f"| {title} | {fmt.format(g[key])} | {fmt.format(e[key])} | {e[key] / max(g[key], 1e-9):.2f} |"
        )
    tg, te = g["tokens"] / g["wall"], e["tokens"] / e["wall"]
    cg, ce = g["tokens"] / g["cpu"], e["tokens"] / e["cpu"]
    print(f"| **generated tokens / s (wall)** | {tg:.0f} | {te:.0f} | **{te / tg:.2f}** |")
    print(f"| generated tokens / s (CPU time) | {cg:.0f} | {ce:.0f} | {ce / cg:.2f} |")
    print(
        f"| prefill tokens per generated token | {g['prefill']:.1f} | {e['prefill']:.1f} | {e['prefill'] / max(g['prefill'], 1e-9):.2f} |"
    )
    print(f"| arithmetic limit (s) | {g['limit']:.3f} | {e['limit']:.3f} | |")
    print(
        f"| CPU time / arithmetic limit | {g['cpu'] / g['limit']:.1f}x | {e['cpu'] / e['limit']:.1f}x | |"
    )
    last = rows["engine"][-1]
    ph, n, x = last["phases"], last["calls"], last["extra"]
    other = last["cpu"] - ph.get("prefill", 0) - ph.get("decode", 0)
    print(f"\nwhere the engine's CPU time goes (last run, {last['cpu']:.2f} s):")
    print(
        f"- prefill: {ph.get('prefill', 0):.2f} s in {n.get('prefill', 0)} calls ({x.get('engine/prefill_forwards', 0)} forwards, {x.get('engine/prefill_real', 0)} prompt tokens)"
    )
    rows_per = x.get("engine/decode_rows", 0) / max(x.get("engine/decode_steps", 1), 1)
    print(
        f"- decode: {ph.get('decode', 0):.2f} s in {x.get('engine/decode_steps', 0)} forwards ({rows_per:.1f} rows each, {x.get('engine/riders', 0)} rider slots)"
    )
    print(f"- other (prompt rendering and tokenizing, worlds, sampling bookkeeping): {other:.2f} s")
    if profile is not None:
        s = io.StringIO()
        pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(14)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print("\ncProfile of the first engine rollout, by own time:")
        print("\n".join(ln.replace(str(paths.HOME) + "/", "") for ln in lines[start : start + 15]))
    return te / tg


def recipe(args):
    from kitchen.train import load_recipe

    r = load_recipe(paths.HOME / "recipes" / "tiny_mapo.yaml")
    return r.model_copy(
        update={
            "eval_every": 0,
            "checkpoint_every": 10_000,
            "samples_per_iteration": 0,
            "train": r.train.model_copy(update={"iterations": 1 + args.updates}),
        }
    )


def compare_updates(args) -> None:
    import kitchen.train as train
    from kitchen.engine import force_generate
    from kitchen.grm import GRM

    timer = Timer()
    timer.wrap(train, "rollout", "rollout")
    timer.wrap(GRM, "review", "review")
    timer.wrap(train.Run, "_update", "update")
    r = recipe(args)
    runs = {
        name: train.Run(r, tempfile.mkdtemp(prefix=f"bench-rollout-{name}-"), progress=False)
        for name in ("generate", "engine")
    }
    rows: dict[str, list[dict]] = {"generate": [], "engine": []}
    for it in range(1 + args.updates):
        for name, run in runs.items():
            timer.reset()
            with force_generate() if name == "generate" else contextlib.nullcontext():
                w = time.perf_counter()
                run.step()
                wall = time.perf_counter() - w
            if it:  # the first iteration warms up
                rows[name].append({"wall": wall} | dict(timer.wall))
    keys = ("wall", "rollout", "review", "update")
    med = {
        n: {k: statistics.median(x.get(k, 0.0) for x in rs) for k in keys} for n, rs in rows.items()
    }
    g, e = med["generate"], med["engine"]
    print(
        f"\n## Seconds per RL update: recipes/tiny_mapo.yaml (GRM reviewer), median of {args.updates} after a warm-up\n"
    )
    print("| per update | generate (today) | engine | engine / generate |")
    print("|---|---:|---:|---:|")
    for k, title in zip(
        keys,
        (
            "**wall time (s)**",
            "  rollout (s)",
            "  GRM review (s)",
            "  update: policy + reference forward, backward, step (s)",
        ),
        strict=True,
    ):
        print(f"| {title} | {g[k]:.2f} | {e[k]:.2f} | {e[k] / max(g[k], 1e-9):.2f} |")
    other = {n: m["wall"] - m["rollout"] - m["review"] - m["update"] for n, m in med.items()}
    print(
        f"|   other: judge, rewards, advantages, metrics (s) | {other['generate']:.2f} | {other['engine']:.2f} | |"
    )
    print(f"\nthe engine's update is {g['wall'] / e['wall']:.2f}x faster per update")


def sweep_thresholds(model, tok, jobs, cfg, args) -> None:
    """The engine's batching thresholds (`WAIT_SHARE`: prefill once 1/n of the rows wait;
    `DROP_SHARE`: drop finished rows once they are 1/n of the batch) against the shipped ones,
    interleaved, on the same jobs and seeds; engine tokens/s of wall time, medians."""
    import kitchen.engine as engine

    shipped = (engine.WAIT_SHARE, engine.DROP_SHARE)
    settings = [shipped, (2, 4), (8, 4), (4, 2), (4, 8), (16, 16), (1000, 4)]
    rates: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    try:
        for _ in range(args.reps):
            for s in settings:
                engine.WAIT_SHARE, engine.DROP_SHARE = s
                _, stats, wall, _ = play(model, tok, jobs, cfg, args.seed, today=False)
                rates[s].append(stats.tokens / wall)
    finally:
        engine.WAIT_SHARE, engine.DROP_SHARE = shipped
    print(f"\n## Batching thresholds (engine, main-job setting, median of {args.reps})\n")
    print("| WAIT_SHARE | DROP_SHARE | tokens / s (wall) | vs shipped |")
    print("|---:|---:|---:|---:|")
    base = statistics.median(rates[shipped])
    for (w, d), r in rates.items():
        mark = " (shipped)" if (w, d) == shipped else ""
        print(
            f"| {w}{mark} | {d} | {statistics.median(r):.0f} | {statistics.median(r) / base:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--reps", type=int, default=3, help="rollouts per path (interleaved)")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--long", type=int, default=2, help="long (meal) jobs; 0 skips that section")
    ap.add_argument("--updates", type=int, default=2, help="measured RL updates; 0 skips them")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile one engine rollout")
    ap.add_argument(
        "--thresholds", action="store_true", help="sweep the engine's batching thresholds too"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import kitchen.engine as engine
    from kitchen.constitution import load_constitution
    from kitchen.jobs import pair_jobs
    from kitchen.models import LoraSpec, ModelSpec, load_model
    from kitchen.rollout import RolloutConfig
    from kitchen.world import LONG_MAX_TURNS

    load0 = os.getloadavg()[0]
    gflops, gbs = matmul_gflops(), copy_gbs()
    print(
        f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python benchmarks/bench_rollout.py --threads {args.threads} --reps {args.reps} --long {args.long} --updates {args.updates}"
    )
    print(
        f"machine: {torch.get_num_threads()} torch thread(s); fp32 matmul {gflops:.0f} GFLOP/s; copy {gbs:.1f} GB/s; load average {load0:.1f}"
    )

    timer = Timer()
    timer.wrap(engine.Engine, "_prefill", "prefill")
    timer.wrap(engine.Engine, "_decode", "decode")
    spec = ModelSpec(
        path=str(paths.DATA / "models" / "policy-tiny"), lora=LoraSpec(r=16, alpha=32, dropout=0.0)
    )
    model, tok = load_model(spec)
    s = shape(model)
    print(
        f"policy: data/models/policy-tiny + LoRA r=16 ({s['L']} layers, width {s['d']}, vocab {s['V']}; {2 * s['P'] / 1e6:.2f} MFLOP a token through the layers)"
    )
    con = load_constitution(paths.DEFAULT_CONSTITUTION)
    cfg = RolloutConfig(
        k=args.k, max_turns=args.turns, max_new_tokens=args.max_new_tokens, batch_size=64
    )
    jobs = pair_jobs("train", args.tasks, 0, con)
    play(
        model, tok, jobs[:1], cfg.model_copy(update={"k": 2, "max_turns": 1}), 0, today=False
    )  # warm-up
    ratio = compare_rollouts(
        model, tok, jobs, cfg, args, "Rollouts, main-job setting", timer, gflops
    )
    if args.thresholds:
        sweep_thresholds(model, tok, jobs, cfg, args)
    if args.long:
        long_jobs = pair_jobs("train", args.long, 0, con, long_share=1.0, key="long")
        lcfg = cfg.model_copy(update={"k": 4, "max_turns": LONG_MAX_TURNS})
        compare_rollouts(model, tok, long_jobs, lcfg, args, "Long episodes (meals)", timer, gflops)
    print(f"\nrollout tokens/s, engine over generate (main-job setting): {ratio:.2f}x")
    if args.updates:
        compare_updates(args)
    print(f"\nload average {load0:.1f} → {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
