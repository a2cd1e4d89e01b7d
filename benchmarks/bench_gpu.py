"""One GPU: the recipe's code path on a Qwen2.5-0.5B-shaped model — memory, QLoRA against LoRA,
rollout and update throughput, and a few iterations of the GPU recipe itself.

The single-GPU path (README "On one GPU", `recipes/gpu_qwen_qlora.yaml`) keeps one copy of the
weights on the device: the policy is a LoRA adapter on a (4-bit) base, the KL reference is that
base with the adapters off (docs/method.md#policy-update), and the GRM is a second adapter on it.
This script measures that path with `kitchen.train.Run`, the object `kitchen cook` drives:

1. **Per method** — NF4 QLoRA (the recipe's) and LoRA on the unquantised base (bf16 on a GPU) —
   `--iterations` iterations of `Run.step` (rollout → GRM review → step samples → advantages →
   update), each giving rollout tokens/s at B = 64 episodes, reviews/s and update tokens/s (policy
   forward + backward and the reference's forward, `speed/update_tokens_per_s`). On CUDA, peak
   memory of an iteration's review + update (policy + KL reference + GRM on one base) and of the
   same update as policy-only LoRA training (β = 0, no reference forward, no review), and their
   ratio (goal: at most 1.2×). Then one rollout of the same jobs through each decoding path,
   the fast engine (`RolloutConfig.engine: fast`, `kitchen.engine`) and transformers' `generate`.
2. **The recipe**: `recipes/gpu_qwen_qlora.yaml` as a user runs it, pointed at the random model,
   for `--recipe-iterations` iterations — `Run.step`, the held-out evaluation, checkpoints.

The results are one JSON document (stdout, and `--out FILE` / `--out-dir DIR`, rewritten after
every phase so a run cut short keeps what it measured). `kitchen.decide.read_throughput` reads it
as a throughput record (notebook 00's cost calculator): the top-level `iterations`, `peak_gb_*`
and `ratio` are the NF4 method's; the other method sits under `lora`, the comparison under
`qlora_vs_lora`, the recipe's iterations under `recipe`, each phase's status under `phases`.

    python benchmarks/bench_gpu.py --out-dir data/throughput     # on CUDA: writes <gpu>.json
    python benchmarks/bench_gpu.py --small --cpu                 # the same path, small, on a CPU
    benchmarks/gpu_check.sh                                      # this and the CUDA tests in one go

Departures (what a run with real weights would do differently, and why it does not matter here):
1. Random weights: no checkpoint can be downloaded, so the model is built from a
   Qwen2.5-0.5B-shaped `Qwen2Config` (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab
   151,936, tied embeddings) and saved with the kit's tiny tokenizer. Cost per token depends on
   the shapes, not on the values.
2. Random weights almost never write the end-of-turn token, so every turn would hit its token
   budget and be masked out of the update, and every episode fails alike, so every advantage
   would be 0. While this script runs the loop (`random_weights_loop`), the rollouts' turns are
   marked complete and each episode's global reward is a seeded draw in [0, 1]. That changes
   which samples are trained on and with what weight, not what training costs; every turn costs
   its whole token budget (the cost calculator's upper bound); and the gradients are not zero,
   so the run also shows that the policy adapter, and only it, moves (on CUDA too: the 4-bit
   path is where LoRA gradients have gone missing before, see kitchen.models).
3. The tokenizer has 1,124 tokens and the embedding 151,936 rows: ids beyond the tokenizer decode
   to nothing, so the dialogues' texts are short. What is measured per token is still the cost
   of the full vocabulary (logits, sampling, the log-softmax of the update).
4. Policy-only training runs on the same `Run`, so the idle GRM adapter stays resident (LoRA
   r = 16 on this shape: 8.4 M fp32 parameters, 34 MB) — noise against the base's weights.
5. The recipe phase shrinks the budget only (iterations, tasks per iteration, held-out tasks):
   turns, token budgets, K, the GRM's review budget and the optimiser are the recipe's. It runs
   `kitchen.train.cook`'s loop over `Run` rather than `cook` itself: `cook` writes
   `metrics.parquet` with polars (its 54 MB wheel does not travel to the GPU machine, see
   benchmarks/gpu_check.sh; the file is written where polars is installed), and its checks before
   the first iteration rightly refuse a GRM that writes no verdicts, as a random one does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
# The per-method workload: B = tasks × K episodes decoded together (64 on a GPU), the GRM's review
# budget (kitchen.decide assumes every review of this benchmark fills it: 256, 64 with --small).
WORK = {
    "full": {"tasks": 8, "k": 8, "turns": 4, "tokens": 96, "review": 128, "grm_batch": 32,
             "minibatch": 32},
    "small": {"tasks": 2, "k": 2, "turns": 2, "tokens": 12, "review": 64, "grm_batch": 4,
              "minibatch": 4},
}  # fmt: skip
GIB = 2**30


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the JSON alone)."""
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(folder: Path, shape: dict) -> int:
    """Save a random Qwen2 model of `shape` (bf16) with the kit's tiny tokenizer; returns its
    parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from kitchen import paths

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


@contextlib.contextmanager
def random_weights_loop(on_rollout: Callable[[Any], None] | None = None) -> Iterator[None]:
    """While open, `kitchen.train`'s loop is adapted to random weights (departure 2): every
    rollout marks its turns complete and hands its `RolloutStats` to `on_rollout` (which can read
    and reset the memory peak); every episode's global reward is a seeded draw in [0, 1]."""
    import kitchen.train as train

    real_rollout, real_rewards = train.rollout, train.episode_rewards

    def rollout(*args: Any, **kwargs: Any):
        trajs, stats = real_rollout(*args, **kwargs)
        for t in trajs:
            for turn in t.turns:
                turn.truncated = False
        if on_rollout is not None:
            on_rollout(stats)
        return trajs, stats

    def episode_rewards(trajs, reviews, pcs, reward, blocked=False):
        out = real_rewards(trajs, reviews, pcs, reward, blocked)
        for t, rw in zip(trajs, out, strict=True):
            rw.outcome = random.Random(f"reward:{t.id}").random()
        return out

    train.rollout, train.episode_rewards = rollout, episode_rewards
    try:
        yield
    finally:
        train.rollout, train.episode_rewards = real_rollout, real_rewards


class Cuda:
    """Peak-memory bookkeeping that is a no-op on a CPU (no peak is measured there)."""

    def __init__(self, on: bool):
        import torch

        self.on, self.torch = on, torch

    def reset(self) -> None:
        if self.on:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float | None:
        if not self.on:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() / GIB

    def free(self) -> None:
        gc.collect()
        if self.on:
            self.torch.cuda.empty_cache()


def lora_b_mass(model: Any, adapter: str) -> float:
    """Σ |B| over the LoRA B matrices of `adapter`: 0 for a fresh adapter, > 0 once it trained."""
    return sum(
        float(p.detach().abs().sum())
        for n, p in model.named_parameters()
        if f"lora_B.{adapter}." in n
    )


def method_recipe(folder: Path, method: str, cuda: bool, work: dict, iterations: int) -> Any:
    """The benchmark's recipe for one method: the GPU recipe's model settings (nf4 or not,
    gradient checkpointing, LoRA r 16, the GRM a second adapter) with the benchmark's workload."""
    from kitchen.train import Recipe

    return Recipe.model_validate(
        {
            "name": f"bench-gpu-{method}",
            "seed": 0,
            "policy": {
                "path": str(folder),
                "quantization": "nf4" if method == "nf4" else "none",
                "gradient_checkpointing": True,
                "device": "cuda" if cuda else "cpu",
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            },
            "grm": {
                "model": str(folder),
                "adapter": "grm",
                "clause_text": "full",
                "max_context_tokens": 4096,
                "max_new_tokens": work["review"],
                "batch_size": work["grm_batch"],
            },
            "rollout": {
                "k": work["k"],
                "max_turns": work["turns"],
                "max_new_tokens": work["tokens"],
                "batch_size": work["tasks"] * work["k"],
            },
            "advantage": {"preset": "mapo", "overrides": {"beta": 0.02, "state_key": "abstract"}},
            "train": {
                "iterations": iterations,
                "tasks_per_iteration": work["tasks"],
                "task_pool": 40,
                "minibatch": work["minibatch"],
                "lr": 1e-5,
            },
            "eval_every": 0,
            "samples_per_iteration": 0,
        }
    )


def bench_method(
    folder: Path, method: str, cuda: bool, work: dict, iterations: int, deadline: float
) -> dict[str, Any]:
    """Phase 1 for one method (module docstring): iterations of `Run.step`, policy-only training
    on the last iteration's samples, and one rollout of the same jobs through each engine."""
    import torch

    from kitchen.rollout import rollout
    from kitchen.train import Run

    class KeepScored(Run):  # keeps what its last update trained on, to repeat it policy-only
        scored = None

        def _update(self, scored):
            self.scored = scored
            return super()._update(scored)

    mem = Cuda(cuda)
    mem.free()
    recipe = method_recipe(folder, method, cuda, work, iterations)
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[str, Any] = {}
        if cuda:  # what an earlier phase left behind would count in this one's peaks
            out["resident_gb_before"] = torch.cuda.memory_allocated() / GIB
        run = KeepScored(recipe, folder=Path(tmp) / "run", progress=False)
        out |= {
            "quantization": recipe.policy.quantization,
            "dtype": str(next(p for p in run.model.parameters() if p.is_floating_point()).dtype),
            "episodes_per_rollout": work["tasks"] * work["k"],
            "iterations": [],
        }
        seen: dict[str, Any] = {}
        grm_before = lora_b_mass(run.model, "grm")

        def on_rollout(stats: Any) -> None:  # the rollout's own peak, then the review + update's
            seen["stats"], seen["peak"] = stats, mem.peak_gb()
            mem.reset()

        for it in range(iterations):
            if time.monotonic() > deadline:
                out["cut_short"] = f"out of time after {it} of {iterations} iterations"
                break
            before = run.grm.stats["lines"]
            mem.reset()
            t0 = time.perf_counter()
            with random_weights_loop(on_rollout):
                m = run.step()
            stats = seen["stats"]
            row = {
                "rollout_tokens_per_s": m["speed/rollout_tokens_per_s"],
                "rollout_engine": stats.engine,
                "rollout_tokens": stats.tokens,
                "reviews_per_s": m["speed/reviews_per_s"],
                "review_lines": run.grm.stats["lines"] - before,
                "update_tokens_per_s": m.get("speed/update_tokens_per_s"),
                "step_samples": m.get("train/step_samples", 0),
                "kl_mean": m.get("kl/mean"),
                "grad_norm": m.get("policy/grad_norm"),
                "seconds": time.perf_counter() - t0,
            }
            if cuda:
                row["peak_gb_rollout"] = seen["peak"]
                row["peak_gb_policy_ref_grm"] = mem.peak_gb()
            if stats.fallback:
                row["rollout_fallback"] = stats.fallback
            out["iterations"].append(row)
            log(f"{method} iteration {it}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        if run.scored is None:
            raise RuntimeError(f"{method}: no update ran (no trainable step samples)")
        warm = out["iterations"][1:] or out["iterations"]  # the first pays for the warm-up
        out["medians"] = {
            k: statistics.median(r[k] for r in warm)
            for k in ("rollout_tokens_per_s", "reviews_per_s", "update_tokens_per_s")
            if all(r.get(k) for r in warm)
        }
        # Training moved the policy adapter only (a fresh LoRA B starts at zero).
        out["policy_adapter_moved"] = lora_b_mass(run.model, run.adapter) > 0
        out["grm_adapter_moved"] = lora_b_mass(run.model, "grm") != grm_before
        # Policy-only LoRA training: the last update again, without the reference or a review.
        run.adv_cfg = run.adv_cfg.model_copy(update={"beta": 0.0})
        run.recipe.train.kl_metric = False
        mem.reset()
        m = run._update(run.scored)
        out["policy_only_update_tokens_per_s"] = m["speed/update_tokens_per_s"]
        if cuda:
            out["peak_gb_policy_only"] = mem.peak_gb()
            out["peak_gb_policy_ref_grm"] = max(
                r["peak_gb_policy_ref_grm"] for r in out["iterations"]
            )
            out["ratio"] = out["peak_gb_policy_ref_grm"] / out["peak_gb_policy_only"]
        # The two decoding paths on the same jobs, both warm (iteration 0 paid the warm-up).
        if time.monotonic() < deadline:
            jobs = run._jobs(0)
            for engine in ("fast", "generate"):
                cfg = run.recipe.rollout.model_copy(update={"engine": engine})
                if cuda:
                    torch.cuda.synchronize()
                _, st = rollout(run.model, run.tok, jobs, cfg, seed=0, menu=run.menu)
                out[f"rollout_{engine}_tokens_per_s"] = st.tokens_per_second
                out[f"rollout_{engine}_ran"] = st.engine + (
                    f" ({st.fallback})" if st.fallback else ""
                )
                log(f"{method} rollout via {engine}: {st.tokens_per_second:.0f} tokens/s")
            out["fast_over_generate"] = out["rollout_fast_tokens_per_s"] / max(
                out["rollout_generate_tokens_per_s"], 1e-9
            )
        del run
    mem.free()
    return out


def recipe_phase(
    folder: Path, recipe_path: Path, cuda: bool, small: bool, iterations: int, deadline: float
) -> dict[str, Any]:
    """Phase 2: the GPU recipe as `kitchen cook` runs it (`cook`'s loop over `Run`), pointed at the
    random model, with a smaller budget (departure 5)."""
    from kitchen.train import Run, load_recipe

    recipe = load_recipe(recipe_path)
    doc = recipe.model_dump(mode="json", by_alias=True)
    changes: dict[str, Any] = {
        "policy": {"path": str(folder), "device": "cuda" if cuda else "cpu"},
        "grm": {"model": str(folder)},  # no adapter there: a fresh GRM adapter on the base
        "train": {"iterations": iterations, "tasks_per_iteration": 8},
        "eval": {"tasks": 8, "samples": 1},
    }
    if small:  # a CPU smoke run: small turns and reviews too
        changes["train"]["tasks_per_iteration"] = 1
        changes["eval"]["tasks"] = 1
        changes["rollout"] = {"k": 2, "max_turns": 2, "max_new_tokens": 12, "batch_size": 8}
        changes["grm"] |= {"max_new_tokens": 32, "batch_size": 8, "max_context_tokens": 1024}
    for key, value in changes.items():
        doc[key] = doc[key] | value
    recipe = type(recipe).model_validate(doc)
    try:
        import polars  # noqa: F401

        parquet = True
    except ImportError:
        parquet = False
    mem = Cuda(cuda)
    out: dict[str, Any] = {
        "recipe": str(recipe_path),
        "changed": changes,
        "metrics_parquet": parquet,
        "iterations": [],
    }
    with tempfile.TemporaryDirectory() as tmp, random_weights_loop():
        run = Run(recipe, folder=Path(tmp) / recipe.name, progress=False)
        r = run.recipe
        while run.iteration < r.train.iterations:  # kitchen.train.cook's loop
            if time.monotonic() > deadline:
                out["cut_short"] = f"out of time after {run.iteration} iterations"
                break
            mem.reset()
            t0 = time.perf_counter()
            m = run.step()
            last = run.iteration == r.train.iterations
            if r.eval_every and (run.iteration % r.eval_every == 0 or last):
                m |= run.evaluate()
            if parquet:
                run.write_metrics()
            saved = None
            if run.iteration % r.checkpoint_every == 0 or last:
                saved = run.save()
            keys = ("speed/rollout_tokens_per_s", "speed/reviews_per_s",
                    "speed/update_tokens_per_s", "train/step_samples", "kl/mean", "grm/parsed",
                    "eval/success", "rollout/turns_mean")  # fmt: skip
            row = {k: m[k] for k in keys if k in m}
            row |= {"seconds": time.perf_counter() - t0, "peak_gb": mem.peak_gb()}
            if saved is not None:
                row["checkpoint"] = (saved / "adapter" / "adapter_model.safetensors").is_file()
            out["iterations"].append(row)
            log(f"recipe iteration {run.iteration - 1}: {row}")
        del run
    mem.free()
    return out


def gpu_slug(device: str) -> str:
    """A device's record name: 'NVIDIA H200' → 'h200' (the name kitchen.decide suggests)."""
    name = device.removeprefix("NVIDIA ").strip().split()
    return (name[0] if name else "gpu").lower()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny shape (a smoke run)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (no memory figures)")
    ap.add_argument("--iterations", type=int, default=3, help="Run.step iterations per method")
    ap.add_argument(
        "--methods", default="nf4,lora", help="nf4 (QLoRA) and/or lora (no quantisation)"
    )
    ap.add_argument(
        "--recipe", default=None, help="the GPU recipe (default recipes/gpu_qwen_qlora.yaml)"
    )
    ap.add_argument("--recipe-iterations", type=int, default=2, help="0 skips the recipe phase")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new work after this")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file")
    ap.add_argument(
        "--out-dir", default=None, help="…or to DIR/<gpu>.json (h200.json, cpu-small.json)"
    )
    ap.add_argument("--command", default=None, help="the command to record (default: this one)")
    ap.add_argument(
        "--without", default="", help="comma-separated modules to make unimportable, e.g. polars "
        "(a CPU run then imports only what the GPU machine has)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    for name in filter(None, args.without.split(",")):
        sys.modules[name] = None  # `import name` now fails as if it were not installed
    deadline = time.monotonic() + args.budget_s

    import torch

    from kitchen import paths
    from kitchen.files import atomic_write_json

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        raise SystemExit(
            "bench_gpu.py: no CUDA GPU visible; run with --cpu --small for a smoke run"
        )
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - {"nf4", "lora"}:
        raise SystemExit(f"bench_gpu.py: --methods {args.methods!r}: give nf4, lora or nf4,lora")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    out_file = Path(args.out) if args.out else None
    if args.out_dir:
        out_file = Path(args.out_dir) / f"{gpu_slug(device)}{'-small' if args.small else ''}.json"
    if (
        out_file
        and args.small
        and out_file.resolve().parent == (paths.DATA / "throughput").resolve()
    ):
        raise SystemExit(
            f"bench_gpu.py: --small is a smoke run, not a measurement: write it somewhere other "
            f"than {out_file.parent}"
        )

    import peft
    import transformers

    versions = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}"
    )
    with contextlib.suppress(ImportError):
        import bitsandbytes

        versions += f", bitsandbytes {bitsandbytes.__version__}"
    threads = f"CUDA {torch.version.cuda}" if cuda else f"{torch.get_num_threads()} threads"
    work = WORK["small" if args.small else "full"]
    results: dict[str, Any] = {
        "shape": "small" if args.small else "qwen2.5-0.5b",
        "device": device,
        "hardware": f"{platform.machine()}, {versions}, {threads}",
        "command": args.command or "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "settings": work,
        "phases": {},
        "iterations": [],
    }

    def save() -> None:
        if out_file:
            atomic_write_json(out_file, results)

    def phase(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        if time.monotonic() > deadline:
            results["phases"][name] = "skipped: out of time"
            save()
            return None
        log(f"phase {name}")
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as e:  # record it and go on: one broken phase must not hide the others
            import traceback

            traceback.print_exc()
            results["phases"][name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            save()
            return None
        results["phases"][name] = f"ok in {time.perf_counter() - t0:.0f} s"
        return got

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen-shaped"
        results["parameters"] = build_model(folder, SMALL if args.small else QWEN25_05B)
        log(f"built a random {results['shape']} model: {results['parameters']:,} parameters")
        # The recipe's method first (its figures are the record's), then the recipe itself (the
        # user's path), then the comparison method: a run cut short loses the least important.
        recipe_path = Path(args.recipe or paths.RECIPES / "gpu_qwen_qlora.yaml")
        order = methods[:1] + ["recipe"] * (args.recipe_iterations > 0) + methods[1:]
        for name in order:
            if name == "recipe":
                got = phase(
                    name,
                    lambda: recipe_phase(
                        folder, recipe_path, cuda, args.small, args.recipe_iterations, deadline
                    ),
                )
                if got is not None:
                    results["recipe"] = got
            else:
                got = phase(
                    name,
                    lambda name=name: bench_method(
                        folder, name, cuda, work, args.iterations, deadline
                    ),
                )
                if got is not None and name == methods[0]:
                    results |= {k: v for k, v in got.items() if k != "dtype"}
                if got is not None and name == "lora":
                    results["lora"] = got
            save()
        if "lora" in results and results["phases"].get("nf4", "").startswith("ok"):
            q, lo = results, results["lora"]
            cmp = {
                key: q["medians"][key] / lo["medians"][key]
                for key in q["medians"]
                if lo["medians"].get(key)
            }
            for key in ("peak_gb_policy_ref_grm", "peak_gb_policy_only",
                        "rollout_fast_tokens_per_s", "rollout_generate_tokens_per_s",
                        "policy_only_update_tokens_per_s"):  # fmt: skip
                if q.get(key) and lo.get(key):
                    cmp[key] = q[key] / lo[key]
            results["qlora_vs_lora"] = cmp  # nf4 ÷ lora: memory below 1 = QLoRA needs less
    save()
    print(json.dumps(results, indent=2))
    if out_file:
        log(f"wrote {out_file}")
    failed = [k for k, v in results["phases"].items() if v.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
