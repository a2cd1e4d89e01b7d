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
from kitchen.judge import judge
from kitchen.rollout import rollout
from kitchen.steps import advantages_for
from kitchen.train import Recipe, Run, episode_rewards, load_recipe, step_samples


def adapter(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.named_parameters() if v.requires_grad}


def update(run: Run, scored, weights, opt_state, branches: bool) -> tuple[float, int]:
    """One update of `run` on `scored` from `weights` and `opt_state`: (seconds, tokens)."""
    beta = run.beta
    with torch.no_grad():
        for k, p in run.model.named_parameters():
            if k in weights:
                p.copy_(weights[k])
    run.opt.load_state_dict(copy.deepcopy(opt_state))
    keep = train.takes_tree
    train.takes_tree = (lambda model: keep(model)) if branches else (lambda model: False)
    try:
        t0 = time.perf_counter()
        m = run._update(scored)
        seconds = time.perf_counter() - t0
    finally:
        train.takes_tree, run.beta = keep, beta
    return seconds, round(m["speed/update_tokens_per_s"] * m["time/update_s"])


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
    with tempfile.TemporaryDirectory() as tmp:
        paths.RUNS = Path(tmp)
        run = Run(Recipe.model_validate(doc), progress=False)
        r, k = run.recipe, run.recipe.rollout.k
        ratios, secs = [], []
        for it in range(args.iterations):
            jobs = run._jobs(it)
            pcs = [pc for _, pc, _ in jobs for _ in range(k)]
            trajs, _ = rollout(
                run.model, run.tok, jobs, r.rollout, seed=it, menu=run.menu, guard=train.AxiomGuard
            )
            reviews = [judge(t, pc, run.menu) for t, pc in zip(trajs, pcs, strict=True)]
            rewards = episode_rewards(trajs, reviews, pcs, r.reward, blocked=True)
            samples = step_samples(trajs, rewards, run.adv_cfg, lambda i, it=it: f"{it}:{i // k}")
            scored = advantages_for(samples, run.adv_cfg, run.buffer, step=it)
            run.trajs |= {t.id: (t, pc) for t, pc in zip(trajs, pcs, strict=True)}
            weights, opt_state = adapter(run), copy.deepcopy(run.opt.state_dict())
            flat = update(run, scored, weights, opt_state, branches=False)
            tree = update(run, scored, weights, opt_state, branches=True)  # and keep this one
            ratios.append(tree[1] / flat[1])
            secs.append(tree[0] / flat[0])
            print(
                json.dumps(
                    {
                        "iteration": it,
                        "step_samples": len(samples),
                        "blocked": int(samples.blocked_mask().sum()),
                        "tokens": {"separate": flat[1], "branches": tree[1]},
                        "seconds": {"separate": round(flat[0], 2), "branches": round(tree[0], 2)},
                    }
                )
            )
            run.iteration += 1
    print(
        f"branches / separate sequences: tokens {statistics.median(ratios):.2f}x, "
        f"update time {statistics.median(secs):.2f}x (median of {len(ratios)} iterations: "
        f"{', '.join(f'{x:.2f}' for x in secs)})"
    )


if __name__ == "__main__":
    main()
