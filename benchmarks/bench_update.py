"""What bfloat16 autocast (`train.autocast`) does to the policy update: its speed and its log-probs.

Not a test (about two minutes on one core). Two readings, each from one run of this script:

1. **Speed.** Two runs of the main job's recipe (`recipes/tiny_mapo.yaml`; the rule judge
   reviews, which leaves the update as it is and skips the GRM's cost), one with
   `train.autocast: none` and one with `bfloat16`, step in turn in this one process, iteration by
   iteration — so both see the same machine load. Their rollouts part after the first update, so
   the update is compared per token: `speed/update_tokens_per_s` (tokens through the update's
   forward, backward and reference passes a second), iteration by iteration, and the median of
   the ratios.
2. **Fidelity.** On `--dialogues` held-out SFT dialogues (`data/sft/eval.jsonl`) under the shipped
   policy with the shipped MAPO adapter, log π per token with and without autocast, and
   log π − log π_ref (what the KL term reads): mean and largest absolute differences, and the
   mean of each (a bias would move the KL penalty).

    .venv/bin/python benchmarks/bench_update.py
    .venv/bin/python benchmarks/bench_update.py --iterations 6 --dialogues 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from kitchen import paths
from kitchen.models import ModelSpec, adapters_disabled, load_adapter, load_model, token_logprobs
from kitchen.train import Recipe, Run, load_recipe, update_autocast

MODES = ("none", "bfloat16")


def speed(recipe_path: str, iterations: int) -> None:
    base = load_recipe(recipe_path).model_dump(mode="json")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths.RUNS = Path(tmp)
        for mode in MODES:
            doc = json.loads(json.dumps(base))
            doc["name"] = f"bench-update-{mode}"
            doc["train"] |= {"iterations": iterations, "autocast": mode}
            doc["reward"]["reviewer"] = "judge"
            doc |= {"eval_every": 0, "compare": {}}
            runs[mode] = Run(Recipe.model_validate(doc), progress=False)
        rows = {mode: [] for mode in MODES}
        for it in range(iterations):
            for mode, run in runs.items():
                rows[mode].append(run.step())
            a, b = (rows[m][-1] for m in MODES)
            print(
                f"iteration {it}: update tokens/s none {a['speed/update_tokens_per_s']:,.0f} "
                f"({a['time/update_s']:.1f} s), bfloat16 {b['speed/update_tokens_per_s']:,.0f} "
                f"({b['time/update_s']:.1f} s)"
            )
    ratios = [
        a["speed/update_tokens_per_s"] / b["speed/update_tokens_per_s"]
        for a, b in zip(rows["none"], rows["bfloat16"], strict=True)
    ]
    print(
        f"update time per token, bfloat16 / float32: median {statistics.median(ratios):.2f}x "
        f"(iterations: {', '.join(f'{r:.2f}' for r in ratios)})"
    )


def fidelity(dialogues: int) -> None:
    base, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    policy = load_adapter(base, str(paths.DATA / "models" / "mapo-tiny"), "policy", trainable=True)
    policy.eval()
    with open(paths.DATA / "sft" / "eval.jsonl") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(dialogues), strict=False)]
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    out = {}
    for mode in MODES:
        with torch.no_grad(), update_autocast(mode, torch.device("cpu")):
            logp, _ = token_logprobs(policy, ids, mask)
            with adapters_disabled(policy):
                ref, _ = token_logprobs(policy, ids, mask)
        out[mode] = (logp, logp - ref)
    keep = mask[:, 1:].bool()
    (lp32, d32), (lp16, d16) = out["none"], out["bfloat16"]
    err, derr = (lp16 - lp32)[keep].abs(), (d16 - d32)[keep].abs()
    print(
        f"{int(keep.sum()):,} tokens of {len(rows)} held-out dialogues: |Δ log π| mean "
        f"{err.mean():.4f}, largest {err.max():.3f}; |Δ(log π − log π_ref)| mean {derr.mean():.4f}; "
        f"mean log π − log π_ref {d32[keep].mean():.4f} (float32) vs {d16[keep].mean():.4f} "
        "(bfloat16)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(paths.RECIPES / "tiny_mapo.yaml"))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--dialogues", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fidelity(args.dialogues)
    speed(args.recipe, args.iterations)


if __name__ == "__main__":
    main()
