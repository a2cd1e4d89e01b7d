"""Side by side: kitchen's own loop and TRL's GRPOTrainer on the same work, per update.

Not a test. Run (about two minutes on 2 CPU cores; `--threads 1` when other jobs share them):

    .venv/bin/python benchmarks/bench_trl.py
    .venv/bin/python benchmarks/bench_trl.py --iters 4 --tasks 4 --k 8 --turns 6 --threads 1
    .venv/bin/python benchmarks/bench_trl.py --device cuda     # Qwen2.5-0.5B-shaped, on a GPU

In one process, the same policy trains with the same recipe twice, one iteration (one rollout
batch, one optimiser step) at a time, the two loops interleaved (a TRL step, then the same kit
step) so that other load on the machine falls on both alike:

- **kitchen** — `kitchen.train.Run.step()`, the loop `kitchen cook` runs;
- **trl** — `kitchen.integrations.trl.MAPOTrainer`, i.e. TRL's `GRPOTrainer` with the kit's
  rollout hook, reward function and advantage; its rollouts decode with transformers' `generate`
  (`--trl-decoding generate`, the default: what `GRPOTrainer` does without vLLM), or with the
  kit's engine (`--trl-decoding engine`: then the two loops differ in their update alone).

Same work: the same jobs in the same order (TRL's dataset is the kit's job sequence, unshuffled),
the same K, turns, token budgets, LoRA adapter, learning rate, KL coefficient, preset (`mapo`),
reviewer (the rule judge) and sampling seeds — with `--trl-decoding engine` both play identical
episodes at the first iteration (checked and printed). CPU: the shipped tiny policy. GPU (`--device cuda`, or `auto`
where CUDA is available): a randomly initialised model of Qwen2.5-0.5B's shape built from a
`Qwen2Config` (no hub download), with an end-of-turn logit bias so its turns end.

Printed per loop, as medians over the measured iterations (after `--warmup`): wall time per
update, its phases (rollout / review / advantage / update), generated tokens per second of wall
time, tokens through the model in the update, and the kitchen/TRL ratios. `--profile` adds
cProfile's top functions of one update of each loop.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from kitchen import paths
from kitchen.engine import force_generate


class Phases:
    """Wall time per named phase, by wrapping functions (benchmark-only instrumentation)."""

    def __init__(self):
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, float] = defaultdict(float)

    def wrap(self, name, fn, count=None):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
            finally:
                self.t[name] += time.perf_counter() - t0
            if count is not None:
                self.n[name] += count(out)
            return out

        return timed

    def reset(self):
        self.t.clear()
        self.n.clear()


def qwen05b_policy(device: str, eos_bias: float):
    """A random Qwen2.5-0.5B-shaped causal LM (bf16 on GPU) and the kit's tiny tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(paths.DATA / "models" / "policy-tiny")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    folder = Path(tempfile.mkdtemp(prefix="bench-qwen05b-"))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), eos_bias


def add_eos_bias(model, eos: int, bias: float):
    def hook(_m, _i, logits):
        logits[..., eos] += bias
        return logits

    model.get_output_embeddings().register_forward_hook(hook)


def build_recipe(args, policy_path: str):
    from kitchen.train import Recipe

    return Recipe.model_validate(
        {
            "name": "bench-trl",
            "seed": args.seed,
            "policy": {"path": policy_path, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
            "reward": {"reviewer": "judge", "global_blend": 0.5},
            "rollout": {
                "k": args.k,
                "max_turns": args.turns,
                "max_new_tokens": args.max_new_tokens,
                "batch_size": args.tasks * args.k,
            },
            "advantage": {"preset": "mapo", "overrides": {"beta": 0.02, "state_key": "abstract"}},
            "buffer": {"capacity": 20000, "max_age": 6, "dedup": True},
            "train": {
                "iterations": args.warmup + args.iters,
                "tasks_per_iteration": args.tasks,
                "task_pool": 60,
                "lr": 5e-4,
                "minibatch": 10_000,
            },
            "eval_every": 0,
            "checkpoint_every": 1000,
            "samples_per_iteration": 0,
        }
    )


class KitchenLoop:
    """`kitchen.train.Run`, one timed `step()` at a time, with its phases."""

    def __init__(self, recipe, args, eos_bias, folder):
        import kitchen.train as train

        self.ph, self.args = Phases(), args
        train.rollout = self.ph.wrap("rollout", train.rollout, lambda out: out[1].tokens)
        train.judge = self.ph.wrap("review", train.judge)
        train.advantages_for = self.ph.wrap("advantage", train.advantages_for)
        train.Run._update = self.ph.wrap("update", train.Run._update)
        train.unit_tensors = self.ph.wrap(
            "units", train.unit_tensors, lambda out: int(out[1].sum())
        )
        self.run = train.Run(recipe, folder, progress=False)
        if eos_bias:
            add_eos_bias(self.run.model, self.run.tok.eos_token_id, eos_bias)
        self.jobs = [self.run._jobs(it) for it in range(recipe.train.iterations)]
        self.rows: list[dict] = []
        self.first: list = []

    def step(self) -> None:
        ph, it = self.ph, self.run.iteration
        ph.reset()
        prof = cProfile.Profile() if self.args.profile and it == self.args.warmup else None
        t0 = time.perf_counter()
        with prof or contextlib.nullcontext():
            m = self.run.step()
        wall = time.perf_counter() - t0
        if it == 0:
            self.first = [ti.tokens for t in self.run.last["trajectories"] for ti in t.turns]
        phases = ph.t["rollout"] + ph.t["review"] + ph.t["advantage"] + ph.t["update"]
        self.rows.append(
            {
                "wall": wall,
                "rollout": ph.t["rollout"],
                "review": ph.t["review"],
                "advantage": ph.t["advantage"],
                "update": ph.t["update"],
                "other": wall - phases,
                "generated": ph.n["rollout"],
                "update_tokens": ph.n["units"],
                "samples": m.get("train/step_samples", 0),
                **({"profile": prof} if prof else {}),
            }
        )


def run_both(recipe, args, eos_bias):
    """TRL's trainer drives; after each of its steps, the kit's loop takes the same step."""
    from transformers import TrainerCallback

    import kitchen.integrations.trl as ktrl
    from kitchen.models import load_model

    kitchen = KitchenLoop(recipe, args, eos_bias, tempfile.mkdtemp(prefix="bench-kitchen-"))
    ph = Phases()
    rollout = ktrl.rollout
    if args.trl_decoding == "generate":  # TRL's own decoding: transformers' generate per turn

        def rollout(*a, _inner=ktrl.rollout, **kw):
            with force_generate():
                return _inner(*a, **kw)

    ktrl.rollout = ph.wrap("rollout", rollout, lambda out: out[1].tokens)
    ktrl.GRMReward.review = ph.wrap("review", ktrl.GRMReward.review)
    ktrl.advantages_for = ph.wrap("advantage", ktrl.advantages_for)
    flat = [j for jobs in kitchen.jobs for j in jobs]
    model, tok = load_model(recipe.policy.model_copy(update={"lora": None}))
    if eos_bias:
        add_eos_bias(model, tok.eos_token_id, eos_bias)
    tr = ktrl.TRLRecipe(
        kitchen=recipe,
        trl={
            "output_dir": tempfile.mkdtemp(prefix="bench-trl-"),
            "save_steps": 10_000,
            "grpo": {"shuffle_dataset": False, "save_strategy": "no", "logging_steps": 10_000},
        },
    )
    trainer = ktrl.build_trainer(tr, model=model, tokenizer=tok, jobs=flat)
    counted = {"tokens": 0}
    inner = trainer._compute_loss

    def compute_loss(m, inputs):  # the policy forward of TRL's update: prompt + completion
        counted["tokens"] += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        return inner(m, inputs)

    trainer._compute_loss = compute_loss
    # TRL computes the reference log-probs (adapter off, no grad) while scoring the batch; the
    # kit computes them in its update: count them as "update" so the phases compare
    trainer._generate_and_score_completions = ph.wrap(
        "generate+score", trainer._generate_and_score_completions
    )
    logps = trainer._get_per_token_logps_and_entropies

    def per_token_logps(*a, **kw):
        if torch.is_grad_enabled():
            return logps(*a, **kw)
        t0 = time.perf_counter()
        try:
            return logps(*a, **kw)
        finally:
            ph.t["ref"] += time.perf_counter() - t0

    trainer._get_per_token_logps_and_entropies = per_token_logps
    rows: list[dict] = []
    first: list = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            ph.reset()
            counted["tokens"] = 0
            self.prof = None
            if args.profile and state.global_step == args.warmup:
                self.prof = cProfile.Profile()
                self.prof.enable()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            wall = time.perf_counter() - self.t0
            if self.prof:
                self.prof.disable()
            if state.global_step == 1:
                h = trainer.history[-1]
                first.extend(ti.tokens for t in h["trajectories"] for ti in t.turns)
            scoring = ph.t["generate+score"]
            rows.append(
                {
                    "wall": wall,
                    "rollout": ph.t["rollout"],
                    "review": ph.t["review"],
                    "advantage": ph.t["advantage"],
                    "update": wall - scoring + ph.t["ref"],
                    "other": scoring
                    - ph.t["rollout"]
                    - ph.t["review"]
                    - ph.t["advantage"]
                    - ph.t["ref"],
                    "generated": ph.n["rollout"],
                    "update_tokens": counted["tokens"],
                    **({"profile": self.prof} if self.prof else {}),
                }
            )
            kitchen.step()  # the same iteration in the kit's own loop, right after

    trainer.add_callback(Clock())
    trainer.train()
    return kitchen.rows, kitchen.first, rows, first


def summary(rows, warmup):
    keep = rows[warmup:]
    med = {
        k: statistics.median(r[k] for r in keep)
        for k in ("wall", "rollout", "review", "advantage", "update", "other", "update_tokens")
    }
    gen = sum(r["generated"] for r in keep)
    med["tok_per_s"] = gen / sum(r["wall"] for r in keep)
    med["generated"] = gen / len(keep)
    return med


def top(prof, n=16):
    """The `n` functions with the most time of their own (tottime), one line each."""
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join(
        ln.replace(str(Path.cwd()) + "/", "").replace(".venv/lib/python3.11/site-packages/", "")
        for ln in lines[start : start + n + 1]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda where available",
    )
    ap.add_argument(
        "--model",
        choices=["auto", "tiny", "qwen0.5b"],
        default="auto",
        help="auto: qwen0.5b on a GPU, the tiny policy on a CPU",
    )
    ap.add_argument("--iters", type=int, default=3, help="measured iterations per loop")
    ap.add_argument("--warmup", type=int, default=1, help="iterations not measured")
    ap.add_argument("--tasks", type=int, default=4, help="jobs per iteration")
    ap.add_argument("--k", type=int, default=8, help="episodes per job (the task group)")
    ap.add_argument("--turns", type=int, default=6, help="assistant turns per episode, at most")
    ap.add_argument("--max-new-tokens", type=int, default=40, help="token budget of one turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile one update of each loop")
    ap.add_argument(
        "--trl-decoding",
        choices=["generate", "engine"],
        default="generate",
        help="how TRL's side decodes its rollouts: generate (default: what GRPOTrainer does "
        "without vLLM) or the kit's engine (then both loops play the same episodes, checked)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = (
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    if args.model == "qwen0.5b" or (args.model == "auto" and device == "cuda"):
        if device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # keep the kit's `auto` device on the CPU
        policy, eos_bias = qwen05b_policy(device, eos_bias=8.0)
        label = f"Qwen2.5-0.5B-shaped (random weights, {'bf16' if device == 'cuda' else 'fp32'})"
    else:
        policy, eos_bias = str(paths.DATA / "models" / "policy-tiny"), 0.0
        label = "the shipped tiny policy (data/models/policy-tiny)"
    recipe = build_recipe(args, policy)
    load0 = os.getloadavg()[0]
    kitchen_rows, k_first, trl_rows, t_first = run_both(recipe, args, eos_bias)
    load1 = os.getloadavg()[0]
    k, t = summary(kitchen_rows, args.warmup), summary(trl_rows, args.warmup)

    print(
        f"model: {label} on {device}; torch threads {torch.get_num_threads()}; "
        f"load average {load0:.1f} → {load1:.1f}"
    )
    print(
        f"work per update: {args.tasks} jobs × K={args.k} episodes, ≤{args.turns} turns of "
        f"≤{args.max_new_tokens} tokens; preset mapo, LoRA r=16, rule-judge reward; "
        f"median of {args.iters} updates after {args.warmup} warm-up"
    )
    if args.trl_decoding == "engine":
        print(f"same episodes at the first iteration: {'yes' if k_first == t_first else 'no'}\n")
    else:
        print(
            "TRL's side decodes with transformers' generate, as GRPOTrainer does without vLLM; "
            "kitchen's with its engine (the same jobs and seeds; each row's random stream "
            "differs, so episodes are sampled apart)\n"
        )
    print("| per update | kitchen | TRL GRPOTrainer | kitchen / TRL |")
    print("|---|---:|---:|---:|")
    for key, name in (
        ("wall", "wall time (s)"),
        ("rollout", "  rollout (s)"),
        ("review", "  review (s)"),
        ("advantage", "  advantage + buffer (s)"),
        ("update", "  update: policy + reference forward, backward, step (s)"),
        ("other", "  other: step samples, metrics, bookkeeping (s)"),
    ):
        print(f"| {name} | {k[key]:.2f} | {t[key]:.2f} | {k[key] / max(t[key], 1e-9):.2f} |")
    print(
        f"| generated tokens | {k['generated']:.0f} | {t['generated']:.0f} | "
        f"{k['generated'] / max(t['generated'], 1e-9):.2f} |"
    )
    print(
        f"| generated tokens / s of wall time | {k['tok_per_s']:.0f} | {t['tok_per_s']:.0f} | "
        f"{k['tok_per_s'] / max(t['tok_per_s'], 1e-9):.2f} |"
    )
    print(
        f"| tokens per policy forward in the update | {k['update_tokens']:.0f} | "
        f"{t['update_tokens']:.0f} | {k['update_tokens'] / max(t['update_tokens'], 1):.2f} |"
    )
    if args.profile:
        for name, rows in (("kitchen", kitchen_rows), ("trl", trl_rows)):
            prof = next((r["profile"] for r in rows if "profile" in r), None)
            if prof:
                print(f"\n--- {name}: cProfile of update {args.warmup}, by own time ---")
                print(top(prof))


if __name__ == "__main__":
    main()
