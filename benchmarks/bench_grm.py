"""Reviews per second: one batched generation per trajectory versus one generation per clause.

Not a test (timings depend on the machine). Run:

    .venv/bin/python benchmarks/bench_grm.py                 # 48 held-out dialogues, batch 16
    .venv/bin/python benchmarks/bench_grm.py --n 96 --batch 32 --grm data/models/grm-tiny

The issue asks the GRM to review a whole trajectory's clauses in one pass. This measures why, on
the shipped tiny GRM, in one run over the same held-out dialogues (scripted, both agents):

- **batched**: `GRM.review` — one prompt per trajectory (the whole constitution, every turn),
  `--batch` trajectories generated together; the review lists every turn × clause.
- **per clause**: the way a reviewer without a structured language works — one prompt per
  (trajectory, clause), holding the constitution reduced to that clause, the same batching
  (`--batch` prompts together), and the answers assembled into one review per trajectory.

Both are greedy. It prints reviews per second for each and their ratio, plus each one's
agreement with the rule judge (the per-clause prompts are outside what the tiny GRM was trained
on, so expect that number to be worse too — it is reported, not the point).
"""

from __future__ import annotations

import argparse
import time

import torch

from kitchen.calibrate import agreement, scripted_mix
from kitchen.grm import GRM, GRMConfig, build_prompt, parse_review
from kitchen.judge import judge
from kitchen.review import Review, overall_from


def per_clause_reviews(grm: GRM, trajs, pcs) -> list[Review]:
    """One generation per (trajectory, clause); verdicts assembled per trajectory."""
    prompts, owners = [], []
    for i, (traj, pc) in enumerate(zip(trajs, pcs, strict=True)):
        for clause in pc.clauses:
            one = pc.model_copy(update={"clauses": [clause]})
            prompts.append(build_prompt(traj, one, grm.cfg))
            owners.append((i, clause.id))
    texts = grm.generate(prompts)
    cells: list[dict[tuple[int, str], object]] = [{} for _ in trajs]
    for (i, cid), (text,) in zip(owners, texts, strict=True):
        r = parse_review(text, turns=range(len(trajs[i].turns)), clauses=[cid])
        for v in r.verdicts:
            cells[i][(v.turn, cid)] = v
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
                overall=overall_from(verdicts),
                parsed_fraction=produced / len(verdicts) if verdicts else 1.0,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=48, help="held-out dialogues (default 48)")
    ap.add_argument("--batch", type=int, default=16, help="prompts generated together")
    ap.add_argument("--grm", default=GRMConfig().model, help="GRM checkpoint")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    torch.manual_seed(0)

    grm = GRM.load(GRMConfig(model=args.grm, batch_size=args.batch))
    triples = scripted_mix(args.n, "heldout", args.seed, {"grm": 0.5, "sft": 0.5})
    trajs = [t for t, _, _ in triples]
    pcs = [pc for _, pc, _ in triples]
    refs = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    clauses = sum(len(pc.clauses) for pc in pcs) / len(pcs)
    grm.review(trajs[: args.batch], pcs[: args.batch])  # warm-up: first-call overheads

    t0 = time.perf_counter()
    batched = grm.review(trajs, pcs)
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = per_clause_reviews(grm, trajs, pcs)
    t_single = time.perf_counter() - t0

    rb, rs = len(trajs) / t_batched, len(trajs) / t_single
    ab, asg = agreement(batched, refs), agreement(single, refs)
    print(f"command: python benchmarks/bench_grm.py --n {args.n} --batch {args.batch}")
    print(
        f"{len(trajs)} held-out dialogues, {clauses:.1f} active clauses each, "
        f"{torch.get_num_threads()} CPU threads, GRM {args.grm}"
    )
    print(f"{'mode':12} {'generations':>12} {'seconds':>9} {'reviews/s':>10} {'acc(p/v)':>9}")
    print(f"{'batched':12} {len(trajs):12d} {t_batched:9.1f} {rb:10.2f} {ab.decided_accuracy:9.1%}")
    print(
        f"{'per clause':12} {round(len(trajs) * clauses):12d} {t_single:9.1f} {rs:10.2f} "
        f"{asg.decided_accuracy:9.1%}"
    )
    print(f"ratio: batched whole-trajectory reviews are {rb / rs:.1f}x faster per review")


if __name__ == "__main__":
    main()
