"""Does notebook 05's train button raise held-out compliance? Its recipe, one change at a time.

Not a test (a few minutes per run). Builds the recipe notebook 05 builds from its controls at
their interactive defaults (the notebook is run as an app, its training cell not clicked), applies
`--set key=value` changes (dotted recipe fields, values read as YAML), trains it `--iterations`
times with the loop the notebook's train button runs (`Run.step`), and prints the held-out report
(the rule judge; `--eval-tasks` held-out tasks, the recipe's share of meals) before and after:
compliance, success, per task kind and per clause.

    .venv/bin/python benchmarks/bench_nb05.py                          # the defaults, seed 0
    .venv/bin/python benchmarks/bench_nb05.py --set seed=1 --set train.lr=1e-3
    .venv/bin/python benchmarks/bench_nb05.py --set reward.reviewer=judge
    .venv/bin/python benchmarks/bench_nb05.py --set train.long_share=0 --set eval.long_share=0
    .venv/bin/python benchmarks/bench_nb05.py --iterations 0 --set eval.seed=1   # no training
    .venv/bin/python benchmarks/bench_nb05.py --episodes   # and what the episodes did, per kind

`--episodes` also prints, from the same held-out episodes before and after, for meals and single
dishes apart: turns, how episodes ended (ordered, out of turns, the diner left), the share of the
request fulfilled, actions and the rule judge's violations per episode — where a change in
compliance comes from.

The held-out jobs are drawn from `eval.seed`; `--set eval.seed=N` re-draws them, which is how far
the reading moves without any training (docs/results.md, "Notebook 05's train button").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch
import yaml

from kitchen import paths
from kitchen.config import KitchenError


def notebook_recipe():
    """The recipe notebook 05 builds at its interactive defaults (run as an app, the notebook
    also trains; at one iteration and one held-out task that costs seconds, and `changed` sets
    both back)."""
    os.environ["KITCHEN_NB_ITERATIONS"] = "1"
    os.environ["KITCHEN_NB_EVAL_TASKS"] = "1"
    spec = importlib.util.spec_from_file_location("nb05", paths.HOME / "notebooks" / "05_mapo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, defs = module.app.run()
    return defs["recipe"]


def changed(recipe, changes: list[str], iterations: int, eval_tasks: int):
    """`recipe` with `--set` changes, `iterations` and `eval_tasks`; an α schedule spans the
    run (as the notebook's does)."""
    doc = recipe.model_dump(mode="json")
    doc["train"]["iterations"] = iterations
    doc["eval"]["tasks"] = eval_tasks
    alpha = (doc["advantage"].get("overrides") or {}).get("alpha")
    if isinstance(alpha, dict) and "steps" in alpha:
        alpha["steps"] = iterations
    for change in changes:
        key, sep, raw = change.partition("=")
        if not sep:
            raise KitchenError(f"--set {change}: expected key=value (e.g. train.lr=1e-3)")
        *path, last = key.split(".")
        node = doc
        for part in path:
            if not isinstance(node.get(part), dict):
                raise KitchenError(f"--set {change}: the recipe has no field {key}")
            node = node[part]
        node[last] = yaml.safe_load(raw)
    return type(recipe).model_validate(doc)


def reading(report: dict) -> str:
    keep = {k.removeprefix("eval/"): v for k, v in report.items() if k.startswith("eval/")}
    head = ", ".join(
        f"{k} {keep[k]:.3f}"
        for k in ("compliance", "success", "short_compliance", "long_compliance", "long_success")
        if isinstance(keep.get(k), float)
    )
    clauses = " ".join(
        f"{k.removesuffix('_pass_rate')} {v:.2f}"
        for k, v in sorted(keep.items())
        if k.endswith("_pass_rate") and isinstance(v, float)
    )
    return f"{head}\n    per clause: {clauses}"


def episodes_reading(trajs, pcs) -> str:
    """The held-out episodes (`held_out_episodes`), read per task kind (`--episodes`)."""
    from collections import Counter

    from kitchen.judge import judge

    lines = []
    for kind, meal in (("meals", True), ("single dishes", False)):
        pairs = [(t, pc) for t, pc in zip(trajs, pcs, strict=True) if bool(t.task.courses) == meal]
        if not pairs:
            continue
        n = len(pairs)
        actions = Counter(ti.action.tool or ti.action.kind for t, _ in pairs for ti in t.turns)
        broken = Counter(v.clause for t, pc in pairs for v in judge(t, pc).violations())
        ends = Counter(t.end for t, _ in pairs)
        turns = sum(len(t.turns) for t, _ in pairs) / n
        progress = sum(t.outcome.progress for t, _ in pairs if t.outcome) / n
        lines.append(
            f"    {kind} ({n}): {turns:.1f} turns, ended {dict(sorted(ends.items()))}, "
            f"fulfilled {progress:.3f}"
        )
        lines.append(
            "      actions an episode: "
            + " ".join(f"{a} {c / n:.2f}" for a, c in sorted(actions.items()))
        )
        lines.append(
            "      violations an episode: "
            + " ".join(f"{c} {k / n:.2f}" for c, k in sorted(broken.items()))
        )
    return "\n".join(lines)


def main() -> None:
    from kitchen.train import Run, held_out_episodes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--iterations", type=int, default=16, help="(the notebook's: 16; 0 = the reading before)"
    )
    ap.add_argument("--eval-tasks", type=int, default=96, help="held-out tasks per reading")
    ap.add_argument(
        "--episodes", action="store_true", help="also read the episodes per kind (above)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        recipe = changed(notebook_recipe(), args.set, max(args.iterations, 1), args.eval_tasks)
    except (KitchenError, ValueError) as e:  # a pydantic ValidationError is a ValueError
        raise SystemExit(f"bench_nb05: {e}") from None
    run = Run(recipe, folder=tempfile.mkdtemp(prefix="bench-nb05-"), progress=False)

    def read(when: str) -> None:
        """One reading; with `--episodes` the same held-out episodes, read per kind too."""
        played = held_out_episodes(run.model, run.tok, run.recipe, run.constitution)
        print(f"{when}{reading(run.evaluate(played))}", flush=True)
        if args.episodes:
            print(episodes_reading(*played), flush=True)

    print("command: python benchmarks/bench_nb05.py", *sys.argv[1:])
    read("  before: ")
    if args.iterations < 1:
        return
    t = time.perf_counter()
    for _ in range(recipe.train.iterations):
        run.step()
    seconds = time.perf_counter() - t
    print(f"  after {recipe.train.iterations} iterations ({seconds:.0f} s of training):")
    read("         ")


if __name__ == "__main__":
    main()
