"""The kit's reward and MAPO advantage inside TRL's `GRPOTrainer` (accelerate, DeepSpeed, FSDP).

docs/method.md#scaling. A recipe that `kitchen cook` runs on one GPU runs here on many, through TRL 1.16's
documented extension points (read from `trl/trainer/grpo_trainer.py`):

1. **Multi-turn rollouts** — `GRPOTrainer(rollout_func=...)`: a callable `(prompts, trainer) ->
   {prompt_ids, completion_ids, logprobs, env_mask, **extra}`. `ConciergeRollout` plays each
   dataset row's concierge episode with the kit's batched `kitchen.rollout.rollout` and returns
   it as one token row (`episodes.episode_tokens`): the policy's turns with `env_mask` 1, the
   tool results and diner replies between them with 0. The trajectory and the personal
   constitution ride along as extra fields, which TRL hands to the reward functions.
2. **The reward** — `GRMReward`, a reward function with TRL's signature `(prompts, completions,
   completion_ids, **columns) -> list[float]`. It reviews every episode (the GRM, or the rule
   judge), returns the global reward R = (1−λ)·success + λ·[overall pass], and logs per-clause
   pass rates through the `log_metric` hook and per-episode verdicts through `log_extra` (TRL's
   extra-logging hooks); TRL reports them under `clause/<id>_pass_rate` and in its completions
   table. The per-turn local rewards are kept for the advantage (`GRMReward.last`).
3. **The advantage** — `MAPOTrainer(GRPOTrainer)` overrides `_generate_and_score_completions`:
   after TRL has generated and scored a batch, it turns the episodes into the kit's step samples
   (`kitchen.train.step_samples`), computes their advantages through the path `kitchen cook`
   takes (`kitchen.steps.advantages_for`: the replay buffer where the preset uses one, then
   `kitchen.mapo.advantages`), and writes each turn's advantage on that turn's tokens:
   `advantages` becomes [B, T] instead of GRPO's [B]. TRL's loss accepts per-token advantages
   from subclasses (`_compute_loss`: "to support subclasses that provide advantages with shape
   (B, T)").

Across several processes (one per GPU) the step samples of every process are gathered
(`StepSamples.concat`) before the advantage, so task groups and state groups span the whole batch
and every process keeps an identical buffer; each process then keeps the advantages of its own
episodes.

`python -m kitchen.integrations.trl --recipe recipes/scale/trl_tiny.yaml` trains a recipe;
`accelerate launch --config_file recipes/scale/accelerate/<zero2|zero3|fsdp2>.yaml -m
kitchen.integrations.trl --recipe ...` runs it on several GPUs and nodes (see
`kitchen.integrations.launch`). Tested with TRL 1.16.0 (`trl>=1.0,<1.17` in pyproject: the
`rollout_func` and `log_metric` hooks are marked experimental by TRL and may move).

Departures from `kitchen cook` (the kit's own loop), and why:
1. TRL trains on one row per episode, the kit on one row per turn. The advantages are equal
   (a test checks it); the loss aggregation is equal only for the `token-mean` default
   (TRL `loss_type="bnpo"`). The sequence-level modes map to TRL's per-*episode* ones
   (`seq-mean-token-mean` → "grpo", `seq-mean-token-sum` → "luspo", `seq-mean-token-sum-norm`
   → "dr_grpo"), which weigh episodes, not turns.
2. TRL's objective is PPO's clipped ratio; with the kit's on-policy settings (one pass, one
   update per batch) the ratio is exactly 1 and its gradient is the kit's REINFORCE gradient.
   `train.epochs > 1` maps to TRL's `num_iterations`, where clipping then applies (at
   `advantage.clip`'s ε where the recipe sets one, else TRL's 0.2).
3. TRL's KL term is the unclamped k3 estimator (`kl: k3`, the kit clamps it at 10); `kl: k1`
   is rejected. Replaying buffer samples into the gradient (`replay_in_gradient`) is rejected:
   TRL's batch holds only the episodes it generated; buffered history still sharpens the state
   groups (`use_buffer`), as in the kit's default.
4. Episodes with a context drift (see `kitchen.integrations.episodes`) are counted in
   `rollout/context_drift_frac`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from kitchen import paths
from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.config import KitchenError, StrictModel, read_yaml, validate_doc
from kitchen.constitution import PersonalConstitution
from kitchen.files import read_jsonl
from kitchen.grm import GRM
from kitchen.integrations.episodes import (
    EpisodeTokens,
    Job,
    episode_tokens,
    first_messages,
    job_pool,
)
from kitchen.judge import judge
from kitchen.mapo import AdvantageConfig
from kitchen.models import (
    ModelSpec,
    build_tiny_model,
    load_model,
    lora_config,
    render_chat,
    train_tokenizer,
)
from kitchen.review import Review, clause_pass_rates
from kitchen.rollout import RolloutConfig, rollout
from kitchen.steps import StepSamples, advantages_for
from kitchen.train import (
    EpisodeRewards,
    Recipe,
    RewardConfig,
    episode_rewards,
    load_recipe,
    step_samples,
)
from kitchen.world import Trajectory, load_menu

try:  # the trainer subclass needs TRL (a core dependency); the rest of the module does not
    from trl import GRPOConfig, GRPOTrainer
    from trl.models import unwrap_model_for_generation
except ImportError:  # pragma: no cover - TRL is a core dependency
    GRPOConfig = GRPOTrainer = object  # type: ignore[assignment,misc]
    unwrap_model_for_generation = None

TESTED_TRL = ("1.16.0",)

# the kit's loss aggregation → TRL's loss_type (departure 1)
LOSS_TYPES: dict[str, str] = {
    "token-mean": "bnpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


# --------------------------------------------------------------------------------------------
# The recipe: a kitchen recipe plus what only TRL and accelerate need


class TRLSettings(StrictModel):
    """What only TRL needs; everything else comes from the kitchen recipe."""

    output_dir: str | None = Field(
        None, description="Checkpoints and logs. Default: runs/<recipe name>-trl."
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimiser step. 1 keeps one update per rollout batch, as "
        "`kitchen cook` does; raise it when a batch does not fit in memory.",
    )
    bf16: Literal["auto", "on", "off"] = Field(
        "auto",
        description="bf16 mixed precision. auto: on where the GPU supports it (the policy's "
        "`dtype: auto` rule), off on CPU.",
    )
    logging_steps: int = Field(1, ge=1, description="Log every N optimiser steps.")
    save_steps: int | None = Field(
        None, ge=1, description="Checkpoint every N steps. Default: the recipe's checkpoint_every."
    )
    report_to: list[str] = Field(
        default_factory=lambda: ["none"],
        description="TRL/transformers loggers ('wandb', 'tensorboard', 'trackio'); none by "
        "default so nothing reaches the network.",
    )
    grpo: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other `trl.GRPOConfig` field, passed through last (e.g. "
        "{ds3_gather_for_generation: false}); GRPOConfig validates it.",
    )


class TRLRecipe(StrictModel):
    """A run on TRL: the same kitchen recipe `kitchen cook` reads, plus `trl:` settings."""

    recipe: str | None = Field(
        None, description="Path of a kitchen recipe YAML (e.g. recipes/tiny_mapo.yaml)."
    )
    kitchen: Recipe | None = Field(None, description="The kitchen recipe inline (or `recipe`).")
    trl: TRLSettings = Field(
        default_factory=TRLSettings,
        description="What only TRL needs (output folder, accumulation, bf16, loggers, any other "
        "GRPOConfig field); the defaults run the recipe as `kitchen cook` would.",
    )

    @model_validator(mode="after")
    def _one_recipe(self) -> TRLRecipe:
        if (self.recipe is None) == (self.kitchen is None):
            raise ValueError("give exactly one of `recipe: PATH` or an inline `kitchen:` recipe")
        return self

    def resolve(self) -> Recipe:
        """The kitchen recipe (read from `recipe` when given as a path)."""
        if self.kitchen is not None:
            return self.kitchen
        path = Path(self.recipe)
        if not path.exists() and (paths.HOME / path).exists():
            path = paths.HOME / path
        return load_recipe(path)


def load_trl_recipe(path: str) -> TRLRecipe:
    """Read and validate a TRL recipe YAML (errors name file, line and field)."""
    return validate_doc(TRLRecipe, read_yaml(path))


def check_supported(cfg: AdvantageConfig) -> None:
    """Reject advantage settings TRL cannot honour (departure 3), saying what to do instead."""
    if cfg.replay_in_gradient:
        raise KitchenError(
            "advantage.replay_in_gradient: TRL trains only on the episodes it just generated; "
            "set it to false (buffered history still enters the state groups via use_buffer)"
        )
    if cfg.beta and cfg.kl != "k3":
        raise KitchenError("advantage.kl: TRL's KL penalty is k3; set kl: k3 (or beta: 0)")
    if cfg.kl_target is not None:
        raise KitchenError(
            "advantage.kl_target: TRL's GRPOTrainer keeps beta fixed; set kl_target: null"
        )


def _checkpointing_field() -> str:
    """transformers ≥ 5.2x renamed `gradient_checkpointing` to `activation_checkpointing`."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else ("gradient_checkpointing")
    )


def grpo_config(recipe: Recipe, settings: TRLSettings | None = None, *, num_processes: int = 1):
    """The `trl.GRPOConfig` that runs `recipe`: one optimiser step per rollout batch of
    `tasks_per_iteration × k` episodes, split over `num_processes` processes."""
    settings = settings or TRLSettings()
    cfg = recipe.advantage.resolve()
    check_supported(cfg)
    if recipe.keep_checkpoints:
        raise KitchenError(
            "keep_checkpoints: TRL's Trainer keeps its newest checkpoints only (save_total_limit "
            "2, every checkpoint_every steps); set keep_checkpoints: [] and keep the ones you "
            "need by hand"
        )
    r, t = recipe.rollout, recipe.train
    episodes = t.tasks_per_iteration * r.k
    per_step = num_processes * settings.gradient_accumulation_steps
    if episodes % per_step:
        raise KitchenError(
            f"train.tasks_per_iteration × rollout.k = {episodes} episodes per iteration do not "
            f"split over {num_processes} processes × {settings.gradient_accumulation_steps} "
            "accumulation steps; change tasks_per_iteration so they divide it"
        )
    cuda = torch.cuda.is_available()
    bf16 = {"on": True, "off": False}.get(
        settings.bf16, cuda and torch.cuda.is_bf16_supported() and recipe.policy.dtype != "float32"
    )
    kwargs: dict[str, Any] = {
        "output_dir": settings.output_dir or str(paths.RUNS / f"{recipe.name}-trl"),
        "seed": recipe.seed,
        "max_steps": t.iterations,
        "num_generations": r.k,
        "per_device_train_batch_size": episodes // per_step,
        "gradient_accumulation_steps": settings.gradient_accumulation_steps,
        "num_iterations": t.epochs,
        "learning_rate": t.lr,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.grad_clip,
        # the recipe's schedule (kitchen.train.lr_at): one TRL step per kit iteration (HF falls
        # over max_steps, so its last step sits a little above lr_final · lr)
        **(
            {"lr_scheduler_type": "constant"}
            if t.lr_schedule == "constant"
            else {
                "lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": t.lr_final},
            }
        ),
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "beta": cfg.beta,
        **({} if cfg.clip is None else {"epsilon": cfg.clip}),
        "loss_type": LOSS_TYPES[cfg.loss_agg],
        "max_completion_length": r.max_new_tokens * r.max_turns,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "remove_unused_columns": False,  # the `job` column identifies each row's episode
        "bf16": bf16,
        "use_cpu": not cuda,
        _checkpointing_field(): recipe.policy.gradient_checkpointing,
        "logging_steps": settings.logging_steps,
        "save_steps": settings.save_steps or recipe.checkpoint_every,
        "save_total_limit": 2,
        "report_to": settings.report_to,
        "log_completions": False,
        "disable_dropout": False,  # the kit trains with the adapter's dropout on
    }
    if cfg.loss_agg == "seq-mean-token-sum-norm" and cfg.norm_len:
        kwargs["max_completion_length"] = cfg.norm_len
    kwargs |= settings.grpo
    return GRPOConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# The reward: a GRM review as a TRL reward function


class GRMReward:
    """The review as a TRL reward function: one global reward per episode, clause metrics logged.

    `reviewer` is "judge" (the rule judge: an oracle, and the default where no GRM is trained),
    "grm" (loads `GRMConfig()`'s checkpoint), or any object with `review(trajs, pcs) -> [Review]`
    (a loaded `kitchen.grm.GRM`). Needs the extra fields `trajectory` and `constitution`, which
    `ConciergeRollout` returns; TRL passes them as keyword arguments.
    """

    __name__ = "grm"  # TRL names the reward column after it: rewards/grm/mean

    def __init__(self, reviewer: Any = "judge", reward: RewardConfig | None = None):
        self.reward = reward or RewardConfig(reviewer="judge")
        if reviewer == "grm":
            reviewer = GRM.load()
        self.reviewer = None if reviewer == "judge" else reviewer
        self.menu = load_menu()
        self.last: dict[str, Review] = {}  # trajectory id → its review
        self.last_rewards: dict[str, EpisodeRewards] = {}  # → its rewards, for the advantage

    def review(
        self, trajs: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
    ) -> list[Review]:
        if self.reviewer is None:
            return [judge(t, pc, self.menu) for t, pc in zip(trajs, pcs, strict=True)]
        return self.reviewer.review(trajs, pcs)

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list | None = None,
        *,
        trajectory: list[Trajectory] | None = None,
        constitution: list[PersonalConstitution] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **_: Any,
    ) -> list[float]:
        if trajectory is None or constitution is None:
            raise KitchenError(
                "GRMReward needs the `trajectory` and `constitution` fields of each row: use "
                "ConciergeRollout as the trainer's rollout_func (or MAPOTrainer)"
            )
        reviews = self.review(trajectory, constitution)
        rewards = episode_rewards(trajectory, reviews, constitution, self.reward)
        self.last = {t.id: r for t, r in zip(trajectory, reviews, strict=True)}
        self.last_rewards = {t.id: rw for t, rw in zip(trajectory, rewards, strict=True)}
        out = [rw.outcome for rw in rewards]
        local = [x for rw in rewards for x, v in zip(rw.local, rw.valid, strict=True) if v]
        if log_metric is not None:
            for clause, rate in clause_pass_rates(reviews).items():
                log_metric(f"clause/{clause}_pass_rate", rate)
            log_metric("reward/local_mean", statistics.fmean(local) if local else 0.0)
            log_metric(
                "episode/success",
                statistics.fmean(t.outcome.success if t.outcome else 0 for t in trajectory),
            )
            log_metric("episode/turns", statistics.fmean(len(t.turns) for t in trajectory))
            if self.reviewer is not None:
                log_metric("grm/parsed", statistics.fmean(r.parsed_fraction for r in reviews))
        if log_extra is not None:
            log_extra("review/overall", [r.overall for r in reviews])
            log_extra(
                "review/violations",
                [" ".join(f"t{v.turn}:{v.clause}" for v in r.violations()) for r in reviews],
            )
        return out


# --------------------------------------------------------------------------------------------
# Multi-turn rollouts through TRL's rollout_func hook


@dataclass
class RolloutBatch:
    """What one `ConciergeRollout` call produced, in the order of TRL's rows."""

    trajs: list[Trajectory] = field(default_factory=list)
    pcs: list[PersonalConstitution] = field(default_factory=list)
    tokens: list[EpisodeTokens] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # task-group key of each row
    seconds: float = 0.0
    generated: int = 0  # tokens the policy generated


def job_dataset(jobs: Sequence[Job]):
    """A `datasets.Dataset` with one row per job: `prompt` (conversational) and `job` (index)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [first_messages(j) for j in jobs],
            "job": list(range(len(jobs))),
        }
    )


class ConciergeRollout:
    """TRL `rollout_func`: plays each row's concierge episode and returns it as a token row.

    TRL's sampler repeats every dataset row `num_generations` times in a row; each run of
    equal rows is one task group. With `MAPOTrainer` the rows' `job` column names the job;
    with the stock `GRPOTrainer` the job is found by its prompt (system message and request).
    Sampling is seeded by (seed, call, process), as `kitchen cook` seeds by (seed, iteration):
    on one process the first call plays the same episodes as the kit's first iteration.
    """

    def __init__(
        self, jobs: Sequence[Job], cfg: RolloutConfig, seed: int = 0, truncated: bool = False
    ):
        """`truncated`: truncated turns keep mask 1 (`RewardConfig.truncated = "worst"`: the
        kit's advantages train on them); False masks them, as the stock GRPOTrainer path does."""
        self.jobs, self.cfg, self.seed = list(jobs), cfg, seed
        self.truncated = truncated
        self.menu = load_menu()
        self.calls = 0
        self.job_ids: list[int] | None = None  # set by MAPOTrainer before each call
        self.last = RolloutBatch()
        self._by_prompt: dict[tuple[str, str], int] = {}
        for i, j in enumerate(self.jobs):
            m = first_messages(j)
            self._by_prompt.setdefault((m[0]["content"], m[1]["content"]), i)

    def _find(self, prompt: list[dict[str, Any]]) -> int:
        key = (prompt[0]["content"], prompt[-1]["content"])
        if key not in self._by_prompt:
            raise KitchenError(
                "a prompt matches no job of this rollout; build the dataset with "
                "job_dataset(jobs) from the same jobs"
            )
        return self._by_prompt[key]

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        ids = (
            self.job_ids
            if self.job_ids and len(self.job_ids) == len(prompts)
            else [self._find(p) for p in prompts]
        )
        self.job_ids = None
        proc = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        call = self.calls
        self.calls += 1
        # runs of equal rows are the task groups; play them with k = run length when all agree
        runs: list[tuple[int, int]] = []  # (job, length)
        for j in ids:
            if runs and runs[-1][0] == j:
                runs[-1] = (j, runs[-1][1] + 1)
            else:
                runs.append((j, 1))
        sizes = {n for _, n in runs}
        if len(sizes) == 1:
            jobs, k = [self.jobs[j] for j, _ in runs], sizes.pop()
        else:
            jobs, k = [self.jobs[j] for j in ids], 1
        t0 = time.perf_counter()
        with _generation_model(trainer) as model:
            trajs, stats = rollout(
                model,
                trainer.processing_class,
                jobs,
                self.cfg.model_copy(update={"k": k}),
                seed=self.seed * 10_007 + call + 1_000_003 * proc,
                menu=self.menu,
                group_prefix=f"c{call}:p{proc}:",
            )
        batch = RolloutBatch(seconds=time.perf_counter() - t0, generated=stats.tokens)
        for b, (t, j) in enumerate(zip(trajs, ids, strict=True)):
            t.id = f"c{call}:p{proc}:{b}"  # unique over processes and calls
            batch.trajs.append(t)
            batch.pcs.append(self.jobs[j][1])
            batch.tokens.append(
                episode_tokens(trainer.processing_class, t, truncated=self.truncated)
            )
            # one task group per (call, job): TRL's sampler may split a group over processes,
            # and both halves then share the key
            batch.groups.append(f"c{call}:{j}")
        self.last = batch
        return {
            "prompt_ids": [e.prompt_ids for e in batch.tokens],
            "completion_ids": [e.completion_ids for e in batch.tokens],
            "logprobs": [e.logprobs for e in batch.tokens],
            "env_mask": [e.mask for e in batch.tokens],
            "trajectory": batch.trajs,
            "constitution": batch.pcs,
        }


@contextlib.contextmanager
def _generation_model(trainer: Any):
    """The trainer's model, unwrapped for generation (DeepSpeed ZeRO-3 gathers its shards, FSDP
    summons full parameters), as TRL's own generation path does."""
    if not hasattr(trainer, "model_wrapped"):
        yield trainer.model
        return
    summon = getattr(getattr(trainer, "_dist", None), "summon_full_params", None)
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        summon(trainer.model_wrapped, recurse=False) if summon else contextlib.nullcontext(),
    ):
        yield model


# --------------------------------------------------------------------------------------------
# MAPO's advantage inside GRPOTrainer


class MAPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with concierge episodes, the GRM reward and kitchen's MAPO advantage.

    jobs: the (task, personal constitution, diner) pool (`episodes.job_pool`); advantage: a
    kitchen `AdvantageConfig` (any preset); rollout: the kit's `RolloutConfig` (its `k` must
    equal `args.num_generations`); reward: a `GRMReward`; buffer: the replay buffer's config.
    Everything else is `GRPOTrainer`'s (model, args, processing_class, peft_config, ...).

    `history` keeps the last `keep_history` batches (episodes, reviews, step samples,
    advantages) for inspection and tests.
    """

    def __init__(
        self,
        model: Any,
        *,
        jobs: Sequence[Job],
        advantage: AdvantageConfig,
        rollout: RolloutConfig,
        reward: GRMReward,
        args: Any,
        buffer: BufferConfig | None = None,
        seed: int = 0,
        keep_history: int = 2,
        train_dataset: Any = None,
        **kwargs: Any,
    ):
        check_supported(advantage)
        if rollout.k != args.num_generations:
            raise KitchenError(
                f"rollout.k ({rollout.k}) must equal GRPOConfig.num_generations "
                f"({args.num_generations}): both are the task group size K"
            )
        self.kitchen_advantage = advantage
        self.kitchen_reward = reward
        self.kitchen_rollout = ConciergeRollout(
            jobs, rollout, seed, truncated=reward.reward.truncated == "worst"
        )
        self.kitchen_buffer = ReplayBuffer(buffer or BufferConfig())
        self.kitchen_calls = 0
        # the clauses of every job's constitution, in one order (`local_signal: clauses`)
        self.kitchen_clauses = {c.id: c.weight for _, pc, _ in jobs for c in pc.clauses}
        self.history: deque[dict[str, Any]] = deque(maxlen=keep_history)
        with warnings.catch_warnings():  # rollout_func is documented, and marked experimental
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental.*")
            super().__init__(
                model=model,
                reward_funcs=[reward],
                args=args,
                train_dataset=train_dataset if train_dataset is not None else job_dataset(jobs),
                rollout_func=self.kitchen_rollout,
                **kwargs,
            )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        training = self.model.training
        self.kitchen_rollout.job_ids = [int(x["job"]) for x in inputs]
        out = super()._generate_and_score_completions(inputs)
        if training:
            self._mapo_advantages(out)
        return out

    def _mapo_advantages(self, out: dict[str, Any]) -> None:
        """Replace TRL's per-episode advantages [B] by the kit's per-turn ones, on tokens [B, T]."""
        from accelerate.utils import gather_object

        cfg, batch = self.kitchen_advantage, self.kitchen_rollout.last
        reviews = [self.kitchen_reward.last[t.id] for t in batch.trajs]
        rewards = [self.kitchen_reward.last_rewards[t.id] for t in batch.trajs]
        version = self.kitchen_calls
        mine = step_samples(
            batch.trajs,
            rewards,
            cfg,
            lambda i: batch.groups[i],
            version=version,
            clause_weights=self.kitchen_clauses,
        )
        parts = gather_object([mine])  # every process's samples, in process order
        offset = sum(len(p) for p in parts[: self.accelerator.process_index])
        scored = advantages_for(StepSamples.concat(parts), cfg, self.kitchen_buffer, version)
        self.kitchen_buffer.advance(version + 1)
        self.kitchen_calls += 1
        adv = scored.adv[offset : offset + len(mine)].float()  # [N] this process's turns

        trl_adv = out["advantages"].detach().cpu()  # TRL's own GRPO advantage [B], for reference
        token_adv = torch.zeros(
            out["completion_ids"].shape, dtype=torch.float32, device=out["completion_ids"].device
        )  # [B, T]
        row = {t.id: i for i, t in enumerate(batch.trajs)}
        for key, turn, a in zip(mine.traj, mine.turn.tolist(), adv.tolist(), strict=True):
            s, e = batch.tokens[row[key]].spans[turn]
            token_adv[row[key], s:e] = a
        out["advantages"] = token_adv

        drift = sum(e.drift > 0 for e in batch.tokens) / max(len(batch.tokens), 1)
        metrics = scored.metrics | {
            "buffer/size": float(len(self.kitchen_buffer)),
            "rollout/context_drift_frac": drift,
            "rollout/seconds": batch.seconds,
            "rollout/tokens_per_s": batch.generated / max(batch.seconds, 1e-9),
        }
        for k, v in metrics.items():
            if isinstance(v, float) and math.isfinite(v):
                self._metrics["train"][k].append(v)
        self.history.append(
            {
                "trajectories": batch.trajs,
                "pcs": batch.pcs,
                "reviews": reviews,
                "rewards": rewards,
                "groups": batch.groups,
                "tokens": batch.tokens,
                "samples": mine,
                "advantages": adv,
                "all_advantages": scored.adv[: scored.n_fresh].float(),
                "token_advantages": token_adv.detach().cpu(),
                "trl_advantages": trl_adv,
                "step": version,
                "metrics": metrics,
            }
        )


# --------------------------------------------------------------------------------------------
# Building a trainer from a recipe, and the launch entry point


def demo_policy(seed: int = 0, *, eos_bias: float = 5.0) -> tuple[Any, Any]:
    """The shipped tiny policy (data/models/policy-tiny) if it is there; else a stand-in.

    The stand-in is a random tiny Qwen2 (`models.build_tiny_model`) on a tokenizer trained on
    the SFT dialogues, with `eos_bias` added to the end-of-turn logit (a forward hook on the
    output layer) so that its turns end after a handful of tokens, as a trained policy's do.
    For demos, tests and benchmarks where only the mechanics matter.
    """
    shipped = paths.DATA / "models" / "policy-tiny"
    if (shipped / "config.json").exists():
        return load_model(ModelSpec(path=str(shipped)))
    texts = [render_chat(r["messages"]) for r in read_jsonl(paths.DATA / "sft" / "train.jsonl")]
    tok = train_tokenizer(texts[:2000], vocab_size=1024)
    model = build_tiny_model(tok, seed=seed)
    eos = tok.eos_token_id

    def bias(_module, _inputs, logits):
        logits[..., eos] += eos_bias
        return logits

    model.get_output_embeddings().register_forward_hook(bias)
    return model, tok


def build_trainer(
    trl_recipe: TRLRecipe,
    *,
    model: Any = None,
    tokenizer: Any = None,
    reviewer: Any = None,
    jobs: Sequence[Job] | None = None,
    **kwargs: Any,
) -> MAPOTrainer:
    """A `MAPOTrainer` for a TRL recipe. `model`/`tokenizer` default to the recipe's policy
    (loaded without its adapter: TRL adds it from `policy.lora`); `reviewer` to the recipe's
    (`reward.reviewer`: the GRM checkpoint or the rule judge); `jobs` to the recipe's pool."""
    from accelerate import PartialState

    recipe = trl_recipe.resolve()
    if recipe.policy.lora and recipe.policy.lora.path:
        raise KitchenError(
            "policy.lora.path: TRL starts a fresh adapter from policy.lora; to continue a "
            "trained one, merge it into its base (peft merge_and_unload) and point policy.path there"
        )
    if model is None:
        spec = recipe.policy.model_copy(update={"lora": None, "path": _home(recipe.policy.path)})
        model, tokenizer = load_model(spec)
    args = grpo_config(recipe, trl_recipe.trl, num_processes=PartialState().num_processes)
    if reviewer is None:
        reviewer = "judge" if recipe.reward.reviewer == "judge" else _load_grm(recipe)
    jobs = (
        jobs
        if jobs is not None
        else job_pool(recipe.constitution, recipe.train.task_pool, recipe.seed)
    )
    return MAPOTrainer(
        model,
        jobs=jobs,
        advantage=recipe.advantage.resolve(),
        rollout=recipe.rollout,
        reward=GRMReward(reviewer, recipe.reward),
        buffer=recipe.buffer,
        seed=recipe.seed,
        args=args,
        processing_class=tokenizer,
        peft_config=lora_config(recipe.policy.lora) if recipe.policy.lora else None,
        **kwargs,
    )


def _home(path: str) -> str:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (paths.HOME / p).exists():
        return str(paths.HOME / p)
    return path


def _load_grm(recipe: Recipe) -> Any:
    return GRM.load(recipe.grm.model_copy(update={"model": _home(recipe.grm.model)}))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kitchen.integrations.trl --recipe FILE` (under `accelerate launch` on GPUs)."""
    import trl

    parser = argparse.ArgumentParser(
        prog="python -m kitchen.integrations.trl",
        description="Train a kitchen recipe with TRL's GRPOTrainer.",
    )
    parser.add_argument("--recipe", required=True, help="TRL recipe YAML (recipes/scale/*.yaml)")
    parser.add_argument("--max-steps", type=int, help="override train.iterations")
    parser.add_argument("--output-dir", help="override trl.output_dir")
    a = parser.parse_args(argv)
    try:
        tr = load_trl_recipe(a.recipe)
        if a.output_dir:
            tr.trl.output_dir = a.output_dir
        if a.max_steps:
            tr.trl.grpo = tr.trl.grpo | {"max_steps": a.max_steps}
        if trl.__version__ not in TESTED_TRL:
            warnings.warn(
                f"kitchen's TRL integration was tested with TRL {TESTED_TRL}; "
                f"found {trl.__version__}",
                stacklevel=1,
            )
        trainer = build_trainer(tr)
    except KitchenError as e:
        print(e, file=sys.stderr)
        return 2
    trainer.train()
    final = Path(trainer.args.output_dir) / "final"
    trainer.save_model(str(final))
    if trainer.accelerator.is_main_process:
        print(f"{final}: {trainer.state.global_step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
