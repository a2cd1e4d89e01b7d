"""One GPU: the real-model recipe path with a Qwen2.5-0.5B-shaped model — memory and throughput.

What it measures (issue 6, "On a GPU"), on the code path a user with real weights takes
(`kitchen.train.Run` with a `ModelSpec` of nf4 QLoRA + LoRA, the GRM as a second adapter):

- peak GPU memory of policy training alone (policy forward + backward on the step samples), and of
  the full update (policy + KL reference + GRM review sharing one base), and their ratio
  (goal: at most 1.2×);
- rollout tokens/s, GRM review tokens/s and update tokens/s over a few iterations.

No weights can be downloaded here, so the model is random, built from a Qwen2.5-0.5B-shaped
`Qwen2Config` (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab 151,936, tied
embeddings) and saved next to the kit's tiny tokenizer. Random weights rarely emit the end-of-turn
token, so this script marks the truncated turns of its own rollouts as complete before the
update: that changes which samples are trained on, not the cost of training on them.

    python benchmarks/bench_gpu.py                 # needs CUDA; writes results to stdout (JSON too)
    python benchmarks/bench_gpu.py --small --cpu   # a smoke run of the same path on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kitchen import paths

QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
SMALL = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def build_model(folder: Path, shape: dict) -> int:
    """Save a random model of `shape` with the kit's tiny tokenizer; returns its parameter count."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(paths.DATA / "models" / "policy-tiny")
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen2Config(
        **shape,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=pad,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny shape (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (no quantisation)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON results here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        raise SystemExit("no CUDA GPU: run with --cpu --small for a smoke run")

    from kitchen.train import Recipe, Run, step_rows

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen-shaped"
        n_params = build_model(folder, SMALL if args.small else QWEN25_05B)
        recipe = Recipe.model_validate(
            {
                "name": "bench-gpu",
                "seed": 0,
                "policy": {
                    "path": str(folder),
                    "quantization": "nf4" if cuda else "none",
                    "gradient_checkpointing": cuda,
                    "device": "cuda" if cuda else "cpu",
                    "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
                },
                "grm": {
                    "model": str(folder),
                    "adapter": "grm",
                    "clause_text": "full",
                    "max_prompt_tokens": 2048,
                    "max_new_tokens": 64 if args.small else 256,
                    "batch_size": 32,
                },
                "rollout": {
                    "k": 8,
                    "max_turns": 4,
                    "max_new_tokens": 32 if args.small else 96,
                    "batch_size": 64,
                },
                "train": {
                    "iterations": args.iterations,
                    "tasks_per_iteration": 4,
                    "task_pool": 40,
                    "minibatch": 32,
                },
                "eval_every": 0,
                "samples_per_iteration": 0,
            }
        )
        run = Run(recipe, folder=Path(tmp) / "run", progress=False)
        threads = f"CUDA {torch.version.cuda}" if cuda else f"{torch.get_num_threads()} threads"
        results = {
            "shape": "small" if args.small else "qwen2.5-0.5b",
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "parameters": n_params,  # logical count (4-bit storage would halve a count)
            "hardware": f"{platform.machine()}, torch {torch.__version__}, {threads}",
            "command": "python " + " ".join(sys.argv),
            "date": datetime.date.today().isoformat(),
            "iterations": [],
        }
        from kitchen.judge import judge
        from kitchen.rollout import rollout

        for it in range(args.iterations):
            row = {}
            jobs = run._jobs(it)
            t0 = time.perf_counter()
            trajs, st = rollout(run.model, run.tok, jobs, recipe.rollout, seed=it)
            row["rollout_tokens_per_s"] = st.tokens / (time.perf_counter() - t0)
            for t in trajs:  # random weights never stop on their own (see the docstring)
                for ti in t.turns:
                    ti.truncated = False
            pcs = [pc for _, pc, _ in jobs for _ in range(recipe.rollout.k)]
            if cuda:  # the peak of one iteration: GRM review, then policy + KL reference update
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            before = run.grm.stats["generations"]
            run.grm.review(trajs, pcs)
            seconds = time.perf_counter() - t0
            row["reviews_per_s"] = len(trajs) / seconds
            row["review_generations"] = run.grm.stats["generations"] - before
            reviews = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]  # untrained GRM
            rows = step_rows(
                trajs,
                reviews,
                pcs,
                run.adv_cfg,
                recipe.reward,
                lambda i, it=it: f"it{it}:job{i // recipe.rollout.k}",
            )
            m = run._update(rows, trajs, pcs, it)
            row["update_tokens_per_s"] = m["speed/update_tokens_per_s"]
            if cuda:
                row["peak_gb_policy_ref_grm"] = torch.cuda.max_memory_allocated() / 2**30
            results["iterations"].append(row)
        if cuda:  # policy-only training: the same update, no reference forward, no GRM
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run.adv_cfg = run.adv_cfg.model_copy(update={"beta": 0.0})
            run.recipe.train.kl_metric = False
            run._update(rows, trajs, pcs, args.iterations)
            results["peak_gb_policy_only"] = torch.cuda.max_memory_allocated() / 2**30
            full = max(r["peak_gb_policy_ref_grm"] for r in results["iterations"])
            results["peak_gb_policy_ref_grm"] = full
            results["ratio"] = full / results["peak_gb_policy_only"]
        print(json.dumps(results, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
