"""How the replay buffer's cost grows with its size: 10^4, 10^5 and 10^6 records in one run.

Not a test (timings depend on the machine). Run:

    .venv/bin/python benchmarks/bench_buffer.py            # 1e4, 1e5, 1e6
    .venv/bin/python benchmarks/bench_buffer.py --sizes 10000,100000 --tokens 32

For each size N the buffer (capacity N) is filled with N step samples whose state keys are
hex strings (as the world hands them over), ~N/10 distinct states, 16 action tokens each. Then,
at steady state (full, so every insert also evicts), it times one training step's worth of
operations on a fresh batch of 1,000 samples:

- add       insert the batch (key encoding, validation, eviction)
- history   `history`: every stored record in the fresh samples' state groups
- advantages `buffer.batch` + `mapo.advantages` (mapo preset) over fresh + history rows
- path      the whole of `steps.advantages_for` (add, history, batch, advantages): what one
            training iteration spends in the buffer

and reports milliseconds per operation, the growth factor between consecutive sizes
(10× more records → ×? time), and bytes per record.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kitchen import mapo
from kitchen.buffer import ReplayBuffer
from kitchen.steps import StepSamples, advantages_for

BATCH = 1000


def make_batch(gen: torch.Generator, start: int, n: int, n_states: int, tokens: int, version: int):
    states = torch.randint(n_states, (n,), generator=gen).tolist()
    flat = torch.randint(50_000, (n * tokens,), generator=gen)
    return StepSamples(
        state=[f"{s:016x}" for s in states],
        tokens=flat,
        logp=-torch.rand(n * tokens, generator=gen),
        tok_len=torch.full((n,), tokens),
        local_reward=torch.randn(n, generator=gen),
        ret=torch.randn(n, generator=gen),
        global_reward=((torch.arange(start, start + n) // 8) % 3 == 0).float(),  # per rollout
        task_group=[f"task{(start + i) // 64}" for i in range(n)],
        traj=[f"traj{(start + i) // 8}" for i in range(n)],
        turn=torch.arange(start, start + n) % 8,
        version=version,
    )


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench(size: int, tokens: int, repeat: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(size)
    n_states = max(size // 10, 1)
    buf = ReplayBuffer(capacity=size)
    chunk = min(size, 20_000)
    t0 = time.perf_counter()
    inserted = 0
    while inserted < size:
        buf.add(make_batch(gen, inserted, chunk, n_states, tokens, version=0))
        inserted += chunk
    fill = (time.perf_counter() - t0) / inserted * 1e6
    cfg = mapo.PRESETS["mapo"]

    def batches(first: int):
        return iter(
            [make_batch(gen, first + i * BATCH, BATCH, n_states, tokens, 1) for i in range(repeat)]
        )

    it = batches(inserted)
    add_ms = timed(lambda: buf.add(next(it)), repeat)
    fresh = make_batch(gen, inserted + repeat * BATCH, BATCH, n_states, tokens, 1)
    kept = buf.add(fresh)
    hist_ms = timed(lambda: buf.history(fresh, exclude=kept), repeat)
    history = buf.history(fresh, exclude=kept)
    adv_ms = timed(lambda: mapo.advantages(buf.batch(fresh, history), cfg), repeat)
    it = batches(inserted + (repeat + 1) * BATCH)
    path_ms = timed(lambda: advantages_for(next(it), cfg, buf, step=1), repeat)
    mem = buf.memory_per_record()
    return {
        "records": len(buf),
        "fill µs/rec": fill,
        "add ms": add_ms,
        "history ms": hist_ms,
        "history rows": history.numel(),
        "advantages ms": adv_ms,
        "path ms": path_ms,
        "B/rec": mem["total"],
        "B/rec alloc": mem["allocated_total"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--tokens", type=int, default=16, help="action tokens per record")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default: on a shared 2-core machine a second OpenMP thread "
        "waits for a busy core and turns 0.05 ms ops into 8 ms ones",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    results = [bench(s, args.tokens, args.repeat) for s in sizes]

    cols = list(results[0])
    print(
        f"replay buffer, {args.tokens} tokens/record, batch {BATCH}, torch threads "
        f"{torch.get_num_threads()}; median of {args.repeat}"
    )
    print(" | ".join(f"{c:>13}" for c in cols))
    for r in results:
        print(
            " | ".join(f"{r[c]:>13.3g}" if isinstance(r[c], float) else f"{r[c]:>13}" for c in cols)
        )
    for a, b in zip(results, results[1:], strict=False):
        growth = {
            c: b[c] / a[c] for c in ("add ms", "history ms", "advantages ms", "path ms") if a[c] > 0
        }
        print(
            f"{a['records']:>8} → {b['records']:<8} (×{b['records'] / a['records']:.0f} records): "
            + ", ".join(f"{c} ×{v:.2f}" for c, v in growth.items())
        )


if __name__ == "__main__":
    main()
