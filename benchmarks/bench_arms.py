"""Several trained policies on the main job's held-out set, as `kitchen demo` plays them. For #14.

Not a test. For one-factor experiments on the main job: train each arm with `kitchen cook` (the
main job's recipe with one field changed), then play every arm and the SFT policy on the same
held-out tasks and diners (`kitchen.demo.held_out`: the rule judge, no guard, the episodes kept
in `--cache` so a rerun plays only new arms) and print, per arm: the win rate over the SFT policy
on all episodes and per task kind, success, compliance, axiom violations, and the personal clause
of each profile group (T3 for brief, T6 for detailed, T4 for hurried diners, with intervals);
then every pair of arms head to head. `--out FILE` writes it all as JSON. An arm can also be a
whole model folder — another cold start (`kitchen sft`'s `final/`) against the shipped one — or
a saved adapter such as `data/models/mapo-tiny` (the main job's seed-0 run as shipped).

    kitchen cook my_arm.yaml      # e.g. recipes/tiny_mapo.yaml with reward.local_mode: violations
    .venv/bin/python benchmarks/bench_arms.py --tasks 300 base=runs/tiny-mapo arm=runs/my-arm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kitchen import paths
from kitchen.demo import KINDS, held_out
from kitchen.evaluate import EvalConfig, eval_jobs, judged_scores, win_rate
from kitchen.files import atomic_write_json


def interval(w: tuple[float, float, float] | None) -> str:
    return "—" if w is None else f"{w[0]:.1%} [{w[1]:.1%}, {w[2]:.1%}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", nargs="+", metavar="NAME=RUN", help="a name and a run folder")
    ap.add_argument("--tasks", type=int, default=300, help="held-out tasks (default 300)")
    ap.add_argument("--samples", type=int, default=2, help="episodes per task (default 2)")
    ap.add_argument("--long", type=float, default=0.5, help="share of meals (default 0.5)")
    ap.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)"
    )
    ap.add_argument("--cache", type=Path, default=paths.RUNS / "arms" / "held_out")
    ap.add_argument("--out", type=Path, help="also write the results as JSON")
    args = ap.parse_args()
    arms = {}
    for item in args.arms:
        name, sep, folder = item.partition("=")
        if not sep or not name or name == "sft":
            ap.error(f"{item!r}: give NAME=RUN_FOLDER (a name other than 'sft')")
        arms[name] = Path(folder)
    cfg = EvalConfig(
        tasks=args.tasks, samples=args.samples, long_share=args.long, temperature=args.temperature
    )
    policies = {"sft": paths.DATA / "models" / "policy-tiny", **arms}
    held, trajs = held_out(policies, cfg, cache=args.cache, unguarded=set(policies))
    # the settings the kept episodes were last played with, where bench_red_lines.py and
    # bench_personal.py read them; a `kitchen demo` folder's results.json (more than these
    # settings) is left alone
    settings = args.cache.parent / "results.json"
    if not settings.exists() or set(json.loads(settings.read_text())) == {"eval"}:
        atomic_write_json(settings, {"eval": cfg.model_dump()})
    pcs = [pc for _, pc, _ in eval_jobs(cfg) for _ in range(cfg.samples)]
    scores = {n: judged_scores(trajs[n]["policy"], pcs) for n in policies}
    wins = {n: win_rate(scores[n], scores["sft"], cfg.bootstrap, cfg.seed) for n in arms}
    names = list(arms)
    pairs = {
        f"{a} vs {b}": win_rate(scores[a], scores[b], cfg.bootstrap, cfg.seed)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    for n in policies:
        print(f"{n}: win over SFT {interval(wins.get(n))}")
        for kind in KINDS:
            r = held[n].get(kind)
            if not r:
                continue
            print(
                f"  {kind}: win {interval(r.get('win_rate_vs_sft'))}, success {r['success']:.1%},"
                f" compliance {r['compliance']:.3f}, axiom violations {r['axiom_violations']}"
            )
            for g in r["groups"]:
                print(
                    f"    {g['group']:<20} {g['clause']} {g['pass']:.1%} "
                    f"[{g['pass_low']:.1%}, {g['pass_high']:.1%}], {g['words']:.1f} words"
                )
    for pair, w in pairs.items():
        print(f"{pair}: {interval(w)}")
    if args.out:
        doc = {"eval": cfg.model_dump(), "held_out": held, "win_vs_sft": wins, "pairs": pairs}
        args.out.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
