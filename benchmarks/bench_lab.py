"""Samples to target, per preset and horizon, in one run: the lab's measured result.

Not a test. Run (about two minutes on 2 CPU cores):

    .venv/bin/python benchmarks/bench_lab.py
    .venv/bin/python benchmarks/bench_lab.py --horizons 4,8,12 --seeds 10 --updates 400

Every preset in `kitchen.mapo.PRESETS` trains on the same `--seeds` worlds of the
credit-assignment lab (`kitchen.lab`, defaults of `LabConfig`: 4 actions, 3 situations, key turn 1,
judge noise 0.5, per-situation offset 1.0, K = 8, Adam lr 0.1, target success 0.6) at each
horizon, until every seed reaches the target or `--updates` run out. The comparison varies one
factor: each preset runs as `mapo.one_factor(preset, mapo)`, its advantage estimator with MAPO's
state key and loss (in the lab one action is one token, so the loss aggregations coincide anyway:
`kitchen.lab`, departure 1). Printed: the median number of rollouts per seed to reach the target
(">B" when most seeds did not within the budget B), the mapo/grpo ratio per horizon, and MAPO's
ablations at the largest horizon.
"""

from __future__ import annotations

import argparse
import math
import time

from kitchen import lab, mapo


def fmt(x: float, budget: int) -> str:
    return f">{budget}" if math.isinf(x) else f"{x:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizons", default="4,8,12,16,24")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--updates", type=int, default=2000)
    ap.add_argument("--noise", type=float, default=0.5, help="judge noise (std)")
    args = ap.parse_args()
    horizons = [int(h) for h in args.horizons.split(",")]
    cfg = lab.LabConfig(updates=args.updates, local_noise=args.noise)

    t0 = time.perf_counter()
    base = mapo.PRESETS["mapo"]
    presets = {name: mapo.one_factor(p, base) for name, p in mapo.PRESETS.items()}
    runs = lab.compare(cfg, presets, horizons, args.seeds)
    table = lab.samples_table(runs)
    by = {(r["preset"], r["horizon"]): r for r in table}
    budget = args.updates * cfg.k

    print(
        f"median rollouts per seed to reach success ≥ {cfg.target} "
        f"({args.seeds} seeds, budget {budget}, judge noise {args.noise}; every preset with "
        "MAPO's state key and loss: the presets differ in their advantage alone)\n"
    )
    print("| preset | " + " | ".join(f"H={h}" for h in horizons) + " |")
    print("|---|" + "---:|" * len(horizons))
    for name in mapo.PRESETS:
        cells = [fmt(by[(name, h)]["median_episodes"], budget) for h in horizons]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ratios = []
    for h in horizons:
        r = by[("mapo", h)]
        ratio = r["vs_grpo"]
        ratios.append("n/a" if math.isnan(ratio) else f"{'≤' if r['bound'] else ''}{ratio:.2f}")
    print("| mapo / grpo | " + " | ".join(ratios) + " |")

    check = lab.halving_check(table)
    print(
        f"\nmapo ≤ 0.5 × grpo at H={check['largest_horizon']}: {check['halved']}; "
        f"ratio falls as H grows: {check['falling']}"
    )

    h = max(horizons)
    base = base.model_dump()
    variants = {
        "mapo (preset)": base,
        "no buffer history": base | {"use_buffer": False},
        "alpha = 1 (local only)": base | {"alpha": {"kind": "constant", "alpha0": 1.0}},
        "alpha = 0 (global only)": base | {"alpha": {"kind": "constant", "alpha0": 0.0}},
        "replay into gradient": base | {"replay_in_gradient": True},
        "singleton -> 0": base | {"singleton": "zero"},
    }
    print(f"\nMAPO ablations at H={h} (median rollouts per seed):\n")
    print("| variant | judge noise 0.5 | judge noise 2.0 |")
    print("|---|---:|---:|")
    for name, v in variants.items():
        adv = mapo.AdvantageConfig.model_validate(v | {"name": name})
        cells = []
        for noise in (0.5, 2.0):
            c = cfg.model_copy(update={"horizon": h, "local_noise": noise})
            cells.append(fmt(lab.median_samples(lab.train(c, adv, args.seeds)), budget))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
