"""What packing the guard's blocked candidates as branches (`train.pack_units`) saves the update.

Not a test (a few minutes on one core). With `train.guard: learn` every candidate the axiom guard
blocked is a step sample at a state its episode's played turn shares. Packed as a sequence of its
own, it re-reads its whole prompt, and the played turns after it start yet another sequence;
packed as a branch of its episode's dialogue (`unit_tree`), it costs its own tokens and one more.

For `--iterations` rollouts of the main job's recipe behind the guard (the rule judge reviews,
which leaves the update as it is and skips the GRM's cost), the same scored step samples are
trained on twice from the same adapter, optimiser state and β: with branches and without. It
prints the tokens through the update and its seconds for each, and their ratios. (That the two
compute the same update is a test: tests/test_train.py, the branches test of one update.)

    .venv/bin/python benchmarks/bench_branches.py
    .venv/bin/python benchmarks/bench_branches.py --iterations 4
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kitchen import paths, train
from kitchen.train import Recipe, Run, load_recipe


def adapter(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.named_parameters() if v.requires_grad}


def both_packings(run: Run, rows: list[dict]) -> None:
    """Make `run`'s update train twice on the same scored samples, from the same adapter,
    optimiser state and β: first with each blocked candidate in a sequence of its own, then
    with branches (the update the run keeps). Each update's tokens and seconds go to `rows`."""
    real, keep = run._update, train.takes_tree

    def once(scored, weights, opt_state, beta, branches: bool) -> tuple[float, int, dict]:
        with torch.no_grad():
            for k, p in run.model.named_parameters():
                if k in weights:
                    p.copy_(weights[k])
        run.opt.load_state_dict(copy.deepcopy(opt_state))
        run.beta = beta
        train.takes_tree = keep if branches else (lambda model: False)
        try:
            t0 = time.perf_counter()
            m = real(scored)
            seconds = time.perf_counter() - t0
        finally:
            train.takes_tree = keep
        return seconds, round(m["speed/update_tokens_per_s"] * m["time/update_s"]), m

    def update(scored):
        state = adapter(run), copy.deepcopy(run.opt.state_dict()), run.beta
        flat = once(scored, *state, branches=False)
        tree = once(scored, *state, branches=True)
        rows.append(
            {
                "step_samples": len(scored.samples),
                "blocked": int(scored.samples.blocked_mask().sum()),
                "tokens": {"separate": flat[1], "branches": tree[1]},
                "seconds": {"separate": round(flat[0], 2), "branches": round(tree[0], 2)},
            }
        )
        return tree[2]

    run._update = update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(paths.RECIPES / "tiny_mapo.yaml"))
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    doc = load_recipe(args.recipe).model_dump(mode="json")
    doc["name"] = "bench-branches"
    doc["train"] |= {"guard": "learn"}
    doc["reward"]["reviewer"] = "judge"
    doc |= {"eval_every": 0, "compare": {}}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths.RUNS = Path(tmp)
        run = Run(Recipe.model_validate(doc), progress=False)
        both_packings(run, rows)
        for it in range(args.iterations):
            before = len(rows)
            run.step()
            if len(rows) > before:  # an iteration with nothing to train on has no update
                print(json.dumps({"iteration": it, **rows[-1]}))
    tokens = [r["tokens"]["branches"] / r["tokens"]["separate"] for r in rows]
    secs = [r["seconds"]["branches"] / r["seconds"]["separate"] for r in rows]
    print(
        f"branches / separate sequences: tokens {statistics.median(tokens):.2f}x, "
        f"update time {statistics.median(secs):.2f}x (median of {len(rows)} iterations: "
        f"{', '.join(f'{x:.2f}' for x in secs)})"
    )


if __name__ == "__main__":
    main()
