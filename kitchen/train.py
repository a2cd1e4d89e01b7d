"""The training loop: personal constitutions → rollouts → reviews → step samples → MAPO.

One iteration of the method (docs/method.md#policy-update), as `Run.step` reads:

    sample jobs (task, personal constitution, diner) → roll out K episodes per job
    → review every episode (the GRM, batched; the rule judge alongside, for metrics)
    → rewards: a local reward per turn, a global reward per episode (`episode_rewards`)
    → step samples, one per trainable turn, with their returns (`step_samples`)
    → advantages, through the replay buffer where the preset uses one (`steps.advantages_for`)
    → REINFORCE + KL on the action tokens, one optimiser step per minibatch (`Run._update`)
    → metrics from what the iteration produced (`iteration_metrics`)
    → (every few iterations) held-out evaluation with the rule judge

A run is described by a declarative `Recipe` (YAML; `kitchen cook RECIPE`) and writes to
`runs/<name>/`:

    recipe.yaml          the recipe as resolved (defaults filled in)
    metrics.parquet      one row per iteration, namespaced metric columns (polars)
    samples.jsonl        a few trajectories per iteration with their reviews and advantages
    eval.jsonl           evaluation reports
    checkpoints/it-NNNN/ the policy adapter (peft format), optimiser, buffer, RNG and loop state
    checkpoints/latest   the name of the newest complete checkpoint

Checkpoints are written to a temporary folder and renamed into place, then `latest` is replaced
atomically, so a crash or a kill at any moment leaves the previous checkpoint intact.
`kitchen cook --resume runs/<name>` restarts from the newest checkpoint; since every random draw
of an iteration is seeded by (recipe seed, iteration), the resumed run reaches the same result as
an uninterrupted one.

The KL reference is the policy's base with its adapter switched off (`models.adapters_disabled`):
no second copy of the weights. On one GPU the GRM may be a second adapter on the same base
(`grm.adapter`).

A recipe's `compare:` block names other advantage estimators to run against it with everything
else held (`Recipe.variant`, `mapo.one_factor`): how the main job compares MAPO with GRPO.

Departures from the method:
1. Turns on which no clause gives a verdict (e.g. a search for a request that named its cuisine),
   and turns whose verdicts the GRM failed to produce, carry no local signal: their local
   advantage is 0 and they stay out of the state-group statistics; only the global advantage
   moves them (docs/method.md#rewards: no reward signal is not a zero reward).
2. Truncated turns (token budget hit) and turns the axiom guard replaced are never trained on.
3. An "entropy collapse" alarm (docs/method.md#validation: entropy must not plunge) fires when the
   policy's mean token entropy drops below `entropy_alarm` × its value at the first iteration.
4. A run that cannot learn stops with an error at the recipe field to change instead of logging
   empty iterations: the recipe's own checks (`recipe_problems`: every advantage choice
   resolves, K ≥ 2 for an estimator that normalises within a task's K episodes; `file_problems`),
   a pre-flight before the first iteration (`Run.preflight`: empty task pool or held-out set,
   a token budget the context cannot hold, a GRM that writes no verdicts), and during the run
   `train.max_untrained_iterations` iterations in a row without a trainable turn, a run that
   ends without one, or an update whose loss or gradient is not finite (`untrained_problem`,
   `diverged`). Metrics over nothing are NaN, never 0 or 1 (`iteration_metrics`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import torch
import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator

from kitchen import paths
from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.config import (
    KitchenError,
    Loc,
    Located,
    Problem,
    StrictModel,
    pydantic_problems,
    read_yaml,
    validate_doc,
)
from kitchen.constitution import PersonalConstitution, PersonalizationCache, load_constitution
from kitchen.evaluate import (
    EvalConfig,
    eval_jobs,
    json_ready,
    mean,
    policy_report,
    reward_gap,
    share,
    show,
)
from kitchen.files import atomic_write_bytes, atomic_write_text, read_jsonl, write_jsonl
from kitchen.grm import GRM, GRMConfig
from kitchen.guard import AxiomGuard
from kitchen.injection import flags as injection_flags
from kitchen.jobs import Job, pair_jobs
from kitchen.judge import judge
from kitchen.mapo import (
    PRESETS,
    SHARED_FIELDS,
    AdvantageConfig,
    adaptive_beta,
    mapo_loss,
    preset,
    returns_for,
)
from kitchen.models import (
    LoraSpec,
    ModelSpec,
    adapters_disabled,
    add_adapter,
    bf16_is_native,
    load_adapter,
    load_model,
    save_adapter,
    takes_tree,
    token_logprobs,
    use_adapter,
)
from kitchen.profile import split_profiles
from kitchen.review import (
    Review,
    clause_pass_rates,
    clause_scores,
    global_reward,
    turn_rewards,
    worst_reward,
)
from kitchen.rollout import RolloutConfig, RolloutStats, render_prompt, rollout
from kitchen.steps import Scored, StepSamples, advantages_for, ragged
from kitchen.world import Trajectory, load_menu


class AdvantageChoice(StrictModel):
    """A preset of `kitchen.mapo.PRESETS` and the fields to change in it."""

    preset: str = Field(
        "mapo",
        description="grpo, dr_grpo, rloo, reinforce_pp, gigpo, mapo_paper or mapo. Default mapo "
        "(the method: docs/method.md#mapo). `kitchen.mapo.describe(name)` prints what each "
        "applies.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of `AdvantageConfig` to change, e.g. {beta: 0.02}. Default none: "
        "the preset as its source defines it.",
    )

    def resolve(self) -> AdvantageConfig:
        try:
            return preset(self.preset, **self.overrides)
        except KeyError as e:
            raise ValueError(str(e).strip("'\"")) from None


class RewardConfig(StrictModel):
    """How reviews become rewards (docs/method.md#rewards)."""

    reviewer: Literal["grm", "judge"] = Field(
        "grm",
        description="Who reviews for the training reward: the GRM (the method), or the "
        "rule judge (an oracle, for ablations: it measures what a perfect GRM would give).",
    )
    local_mode: Literal["mean", "sum", "violations"] = Field(
        "mean",
        description="A turn's local reward: the weighted mean of its clause verdicts (default: "
        "a turn where many clauses apply is not rewarded more for it), or their sum, or "
        "'violations': minus the weight of what it broke over the weight of every clause (a "
        "turn that breaks nothing, a tool call too, gets 0). See kitchen.review, departures 1 "
        "and 5.",
    )
    red_lines: Literal["weigh", "veto"] = Field(
        "weigh",
        description="How an axiom violation scores a turn: 'weigh' (default) counts it in the "
        "weighted mean with the axiom's weight; 'veto' gives the turn the lowest local reward "
        "whatever else it kept, so no theorem pass buys a red line back. See kitchen.review, "
        "departure 4.",
    )
    flagged: Literal["keep", "turn", "trajectory"] = Field(
        "trajectory",
        description="A review with flags (text that tried to steer the reviewer: fake verdicts, "
        "instructions, control tokens, fake delimiters; or a review that ran out of budget): "
        "'trajectory' (default) gives every turn the lowest local reward and the episode a "
        "failure's global reward, so an attempt never pays whatever the GRM made of the other "
        "turns; 'turn' punishes the flagged turn only; 'keep' trusts the verdicts. See "
        "kitchen.review, departure 3.",
    )
    outcome: Literal["success", "progress"] = Field(
        "success",
        description="What the world's outcome contributes to the global reward: 'success' (0 or "
        "1; the default, as GRPO's verifiable reward) or 'progress', the share of the request "
        "fulfilled (`world.Outcome.progress`: a meal's fitting courses, less any other order, "
        "over the courses asked; a single dish, its success). On meals success is rare (16% for "
        "the SFT policy), so most task groups are all failures and their global advantage is 0: "
        "the local term then trains alone, and measured on the main job it learnt thoroughness "
        "that ran out of turns (courses ordered 0.66 → 0.57). Progress keeps the global term "
        "informative there; evaluation still counts success.",
    )
    global_blend: float = Field(
        0.0,
        ge=0,
        le=1,
        description="λ in R = (1−λ)·outcome + λ·[overall pass]. 0: the world's outcome only.",
    )
    step_progress: float = Field(
        0.0,
        ge=0,
        le=10,
        description="μ in r_t + μ·(p_t − p_(t−1)): a turn's local reward gains μ times the share "
        "of the request it fulfilled (`progress_gains`; p is `Outcome.progress` so far, so only "
        "orders move it). The verdicts alone are myopic: a check that keeps its clauses scores "
        "as well as the order it delays. Only turns with verdicts are paid; one scored the "
        "worst (a red-line veto, a flag, a truncation) is never paid up, and a review flagged "
        "under `flagged: trajectory` gets nothing. Needs a local signal that reads the reward "
        "(not `local_signal: clauses`). 0 (default): the verdicts only.",
    )
    unread_reviews: Literal["skip", "review"] = Field(
        "skip",
        description="When no advantage reads a per-turn reward (GRPO, RLOO, Dr. GRPO: α 0 "
        "throughout, an outcome-only global term; `AdvantageConfig.reads_local_reward`) and "
        "`global_blend` is 0, the GRM's reviews change nothing the update sees. 'skip' "
        "(default): the GRM is neither loaded nor run; the rule judge's verdicts stand in for "
        "its reviews in the per-turn metrics, and the injection flags, which are rules, still "
        "reach the global reward (`flagged`). 'review': review with the GRM anyway, to watch "
        "what it says of such a run.",
    )
    truncated: Literal["worst", "drop"] = Field(
        "worst",
        description="A turn that ran out of its token budget before its end-of-turn token: "
        "'worst' (default) trains on it with the lowest local reward (as if it broke every "
        "clause); 'drop' leaves it out of the update. Measured on the main job (seed 2): with "
        "'drop' nothing pushed back on rambling, and turns looping `It is vegetarian. It is "
        "vegetarian. ...` to the budget rose from 0 to 20-30% of all turns.",
    )


class TrainConfig(StrictModel):
    """The training budget and the optimiser."""

    iterations: int = Field(30, ge=1, description="Rollout → update cycles.")
    tasks_per_iteration: int = Field(
        4,
        ge=1,
        le=10_000,
        description="(task, profile) jobs per iteration; each is played K times (rollout.k). "
        "At most 10,000 (and K × this at most 65,536 episodes an iteration).",
    )
    task_pool: int = Field(
        200,
        ge=1,
        le=5_000,
        description="Training tasks drawn once; jobs sample from "
        "them, so states recur and the buffer's state groups fill. At most 5,000: the pool is "
        "drawn before the first iteration (2,000 take ~10 s on a CPU).",
    )
    long_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the task pool that are meals (long tasks: several courses, "
        "12–20 turns, played with `rollout.long_max_turns`). 0: single dishes only.",
    )
    guard: Literal["off", "play", "learn"] = Field(
        "off",
        description="The axiom guard during training rollouts (kitchen.guard): 'off' (default) "
        "plays every action the policy samples; 'play' plays behind the guard (a candidate that "
        "breaks a red line is regenerated, up to the guard's budget, then replaced by its "
        "fallback) and drops what it blocked; 'learn' also trains on each blocked candidate as "
        "a step sample at the very state it was written in, with the lowest local reward and "
        "no global advantage (it did not make its episode's outcome): an exact-state negative "
        "beside the policy's own next try (only where that try was played, not the fallback). "
        "The guard decides by the rule judge, so with 'learn' the red lines' training signal "
        "comes from the rules the evaluation counts with. Measured on the main job: 0.86, 0.95 "
        "and 0.88x the SFT policy's axiom violations in seeds 0, 1 and 2, the recipe without it "
        "0.97, 0.78 and 0.65x (docs/results.md, 'Training behind the guard').",
    )
    guard_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="With `guard` on: the share of each job's K rollouts played behind the "
        "guard (at least one); the rest play without it. 1 (default): all of them. Below 1 a "
        "task group holds both: the guarded episodes give 'learn' its exact-state negatives, "
        "the unguarded ones the states the policy's own breaks lead to (which a guard never "
        "lets it meet). Measured on the main job with 'learn' at 0.5: 0.97, 0.82 and 0.87x "
        "the SFT policy's axiom violations in seeds 0, 1 and 2 (docs/results.md, 'Training "
        "behind the guard').",
    )
    guard_budget: int = Field(
        2,
        ge=0,
        le=16,
        description="With `guard` on: how many times a blocked candidate is regenerated before "
        "the guard's fallback message plays instead (kitchen.guard; 2, the guard's default). "
        "With 'learn', candidates blocked at a turn where every try was blocked are not "
        "trained on (nothing of the policy's was played beside them), so a larger budget "
        "turns more of them into negatives, at the cost of the regenerations. Measured on "
        "the main job with 'learn' at 5: 0.96, 0.93 and 0.87x the SFT policy's axiom "
        "violations in seeds 0, 1 and 2 (docs/results.md, 'Training behind the guard').",
    )
    lr: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="AdamW learning rate of the LoRA adapter. 2e-4: the QLoRA paper's value; "
        "lower it if training wobbles (docs/method.md#faq).",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="The learning rate over iterations (`lr_at`): 'constant', or 'cosine' from "
        "`lr` down to `lr_final`·`lr` at the last iteration. Constant keeps old recipes as they "
        "were; cosine lets a short run take large early steps without its last ones undoing "
        "them (measured on the main job: at a constant 2e-3 the policy improved for 16 "
        "iterations, then its KL went from 0.5 to 3.5 and its messages collapsed to a word).",
    )
    lr_final: float = Field(
        0.1,
        ge=0,
        le=1,
        description="With `lr_schedule: cosine`, the last iteration's learning rate as a share "
        "of `lr` (0.1: a tenth).",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="AdamW weight decay of the adapter. 0: a LoRA adapter starts at zero and "
        "the KL term already keeps it near the reference.",
    )
    grad_clip: float = Field(
        1.0, gt=0, description="Max gradient norm (1.0, the usual RL fine-tuning value)."
    )
    minibatch: int = Field(
        64,
        ge=1,
        description="Step samples per optimiser step (whole trajectories are kept together, so a "
        "minibatch may hold a few more).",
    )
    epochs: int = Field(
        1,
        ge=1,
        le=100,
        description="Passes over an iteration's step samples. 1 keeps "
        "the update on-policy (REINFORCE's assumption); at most 100.",
    )
    entropy_alarm: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="Alarm when mean entropy falls below this fraction of its first value.",
    )
    autocast: Literal["none", "bfloat16", "fast"] = Field(
        "none",
        description="The update's forward and backward passes (the policy's and the reference's "
        "log-probs) under torch's bfloat16 autocast: 'bfloat16' always, 'fast' where the device "
        "multiplies bfloat16 in hardware (a CUDA GPU that supports it, a CPU with AMX; "
        "`models.bf16_is_native`) and float32 elsewhere, 'none' (default) in the weights' "
        "own dtype. The adapter's weights, the optimiser and the loss stay float32. Measured "
        "by benchmarks/bench_update.py (one thread, AMX): the main job's update 0.74x the time "
        "a token; per-token log-probs within 0.013 of float32 on average, log π − log π_ref "
        "within 0.017, its mean unchanged.",
    )
    kl_metric: bool = Field(
        True,
        description="Score the reference (adapter off) even when β = 0, to report kl/mean: one "
        "extra no-grad forward per minibatch.",
    )
    max_untrained_iterations: int = Field(
        3,
        ge=1,
        description="Stop the run with an error after this many iterations in a row in which no "
        "turn could be trained on (every turn truncated or guarded, or every episode over before "
        "its first turn); a run that ends without training on a single turn is an error too. "
        "3: one empty iteration can be bad luck, three in a row is a recipe that cannot learn.",
    )


class Recipe(StrictModel):
    """Everything a training run needs, in one YAML file (`kitchen cook RECIPE`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Run name: runs/<name>/.")
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="Seeds every draw of the run (jobs, rollouts, minibatch order) per "
        "iteration, so a resumed run ends where an uninterrupted one does. In [0, 2^32).",
    )
    policy: ModelSpec = Field(
        default_factory=lambda: ModelSpec(path="data/models/policy-tiny", lora=LoraSpec()),
        description="The policy: the shipped tiny SFT checkpoint by default, with a fresh LoRA "
        "adapter (the KL reference is the base with the adapter off).",
    )
    grm: GRMConfig = Field(
        default_factory=GRMConfig,
        description="The generative reward model (reward.reviewer: grm): the shipped tiny GRM "
        "by default, or a second adapter on the policy's base (grm.adapter).",
    )
    constitution: str = Field(
        "constitutions/concierge.yaml",
        description="The constitution every job's personal constitution is made from.",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="How the policy samples: K episodes per job, turn and token budgets.",
    )
    advantage: AdvantageChoice = Field(
        default_factory=AdvantageChoice,
        description="The advantage estimator and loss: a preset and its overrides.",
    )
    compare: dict[str, AdvantageChoice] = Field(
        default_factory=dict,
        description="Other estimators to compare with this recipe's, by name, e.g. {grpo: "
        "{preset: grpo}}: `Recipe.variant(name)` is this recipe with that estimator and this "
        "one's state key and loss (mapo.SHARED_FIELDS; an arm's own overrides win), so the runs "
        "differ in the advantage alone. `kitchen cook` ignores it; `kitchen demo` runs each arm. "
        "Default none.",
    )
    buffer: BufferConfig = Field(
        default_factory=lambda: BufferConfig(max_age=8, dedup=True),
        description="The replay buffer (used by presets with use_buffer: mapo). Default: 8 "
        "versions of history, duplicates kept once.",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="How reviews become rewards."
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig, description="Iterations, batch sizes and the optimiser."
    )
    eval: EvalConfig = Field(
        default_factory=lambda: EvalConfig(tasks=12, samples=1),
        description="Held-out evaluation during training (rule judge): 12 tasks × 1 sample by "
        "default, small enough to run every few iterations.",
    )
    eval_every: int = Field(
        10,
        ge=0,
        description="Evaluate every N iterations (0: never; the "
        "last iteration is always evaluated when > 0).",
    )
    checkpoint_every: int = Field(
        5,
        ge=1,
        description="Write a checkpoint every N iterations (and after the last one); a resumed "
        "run restarts from the newest. The newest two are kept.",
    )
    keep_checkpoints: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Iterations whose checkpoints are also written (off the checkpoint_every "
        "grid too) and never removed: the policy as it was after that many iterations, e.g. "
        "the main job keeps every run at half its iterations to measure sample efficiency.",
    )
    samples_per_iteration: int = Field(
        4, ge=0, description="Trajectories logged to samples.jsonl per iteration."
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads for torch (None: torch's default, one per core). "
        "The tiny models' small matrices gain little from threads and lose a lot when another "
        "process holds a core: 1 was 5-8x faster than 2 on a busy 2-core machine.",
    )

    _source: Located | None = PrivateAttr(None)  # the YAML it was read from (`load_recipe`)

    @field_validator("policy")
    @classmethod
    def _needs_adapter(cls, v: ModelSpec) -> ModelSpec:
        if v.lora is None:
            raise ValueError(
                "the policy needs `lora:` — the KL reference is its base with the "
                "adapter switched off; add `lora: {}` for the defaults"
            )
        return v

    def variant(self, arm: str, name: str | None = None) -> Recipe:
        """This recipe with the advantage estimator of `compare[arm]` and everything else held:
        the arm's preset and overrides, over this recipe's state key and loss
        (`mapo.SHARED_FIELDS`). Named `name` (default `<name>-<arm>`); its `compare` is empty."""
        if arm not in self.compare:
            raise KitchenError(
                f"compare: no arm {arm!r}; this recipe compares {', '.join(self.compare) or 'none'}"
            )
        base = self.advantage.resolve().model_dump(mode="json")
        choice = self.compare[arm]
        held = {k: base[k] for k in SHARED_FIELDS}
        doc = self.model_dump(mode="json", by_alias=True) | {
            "name": name or f"{self.name}-{arm}",
            "advantage": {"preset": choice.preset, "overrides": held | choice.overrides},
            "compare": {},
        }
        return Recipe.model_validate(doc)

    @property
    def grm_reviews(self) -> bool:
        """Does a run of this recipe review with the GRM? Only where something reads the
        reviews: the reward's reviewer is the GRM and an advantage reads per-turn rewards or
        the global reward blends the overall verdict in (`reward.unread_reviews`)."""
        if self.reward.reviewer != "grm":
            return False
        read = self.advantage.resolve().reads_local_reward or self.reward.global_blend > 0
        return read or self.reward.unread_reviews == "review"

    def problem(self, loc: Loc, message: str) -> Problem:
        """A problem at `loc` of this recipe: file and line when it was read from a file."""
        return (self._source or Located(None, f"recipe {self.name}")).problem(loc, message)


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe YAML (errors name file, line and field): the models, then
    `recipe_problems` — each advantage choice resolved and fit for the rollout's K."""
    doc = read_yaml(path)
    recipe = validate_doc(Recipe, doc)
    recipe._source = doc
    problems = recipe_problems(recipe)
    if problems:
        raise KitchenError(problems)
    return recipe


def choice_problems(
    recipe: Recipe, choice: AdvantageChoice, loc: Loc, held: dict[str, Any] | None = None
) -> list[Problem]:
    """What is wrong with one advantage choice of `recipe` (`advantage`, or an arm of `compare`
    at `loc`, resolved over the base's `held` fields), each problem at its place in the file: a
    bad override at `<loc>.overrides.<field>`, a combination of fields at the override it names."""
    if choice.preset not in PRESETS:
        return [
            recipe.problem(loc, f"unknown preset {choice.preset!r}; known: {', '.join(PRESETS)}")
        ]
    try:
        preset(choice.preset, **((held or {}) | choice.overrides))
    except ValidationError as err:
        doc = recipe._source or Located(None, f"recipe {recipe.name}")
        at = loc + ("overrides",)
        out = pydantic_problems(err, doc, AdvantageConfig, at)
        for i, e in enumerate(err.errors(include_url=False)):
            if not e["loc"]:  # a rule across fields: place it at the first override it names
                named = [k for k in choice.overrides if re.search(rf"\b{re.escape(k)}", e["msg"])]
                if named:
                    out[i] = doc.problem(at + (named[0],), out[i].message)
        return out
    return []


MAX_EPISODES = 65_536  # episodes one iteration may play (K × tasks_per_iteration)
MAX_LORA_SCALE = 100  # alpha / r of the policy's adapter (usual: 1-2)


def group_normalised(cfg: AdvantageConfig) -> str | None:
    """The term of `cfg` that normalises within one task's K episodes — and so is 0 for every
    sample when K = 1 — or None. The global term with task groups (GRPO, RLOO, GiGPO, MAPO); a
    local term grouped inside a task with nothing to fall back on (`singleton: zero`)."""
    a = cfg.alpha
    alphas = (a.alpha0,) if a.kind == "constant" else (a.alpha0, a.alpha1)
    if (cfg.mix == "additive" or min(alphas) < 1) and cfg.global_groups == "task":
        return "its global term normalises outcomes among each task's K episodes"
    in_task = cfg.local_groups in ("state_in_task", "turn") and cfg.singleton == "zero"
    if max(alphas) > 0 and in_task:
        return "its local term compares steps within one task's K episodes"
    return None


def recipe_problems(recipe: Recipe) -> list[Problem]:
    """What in `recipe` no run could learn from, found without loading a model: an advantage
    choice that does not resolve (`choice_problems`), K < 2 with an estimator that normalises
    within a task's K episodes (every advantage would be 0), more than `MAX_EPISODES` episodes an
    iteration. `load_recipe` reports them; `cook` checks recipes built in code too."""
    out = choice_problems(recipe, recipe.advantage, ("advantage",))
    if out:
        return out
    base = recipe.advantage.resolve()
    held = {k: v for k, v in base.model_dump(mode="json").items() if k in SHARED_FIELDS}
    arms = {"advantage": base}
    for arm, choice in recipe.compare.items():
        found = choice_problems(recipe, choice, ("compare", arm), held)
        out += found
        if not found:
            arms[f"compare.{arm}"] = preset(choice.preset, **(held | choice.overrides))
    k = recipe.rollout.k
    if k < 2:
        for block, cfg in arms.items():
            why = group_normalised(cfg)
            if why:
                out.append(
                    recipe.problem(
                        ("rollout", "k"),
                        f"k: {k} episode per task with {block} preset {cfg.name!r}: {why}, so "
                        "a group of one gives every sample advantage 0 and nothing is learnt; "
                        "set k: 2 or more (8 is usual), or use a preset without task groups "
                        "(reinforce_pp, mapo_paper)",
                    )
                )
                break
    if recipe.reward.step_progress:
        for block, cfg in arms.items():
            if cfg.local_signal == "clauses":
                out.append(
                    recipe.problem(
                        ("reward", "step_progress"),
                        f"step_progress: {recipe.reward.step_progress:g} pays a turn's local "
                        f"reward, but {block} compares each clause's verdicts on their own "
                        "(local_signal: clauses) and never reads it; set step_progress: 0 or "
                        "another local_signal",
                    )
                )
                break
    lora = recipe.policy.lora
    if lora is not None and lora.alpha / lora.r > MAX_LORA_SCALE:
        out.append(
            recipe.problem(
                ("policy", "lora", "alpha"),
                f"alpha / r = {lora.alpha / lora.r:g} scales the adapter's update by more than "
                f"{MAX_LORA_SCALE}: one optimiser step would swamp the base; alpha = 2 r is usual",
            )
        )
    t = recipe.train
    idle = [  # off their defaults: a saved recipe (recipe.yaml of a run) holds every field
        f
        for f in ("guard_share", "guard_budget")
        if getattr(t, f) != TrainConfig.model_fields[f].default
    ]
    if t.guard == "off" and idle:
        out.append(
            recipe.problem(
                ("train", idle[0]),
                f"{', '.join(idle)} set while train.guard is 'off': no rollout plays behind the "
                "guard, so it would change nothing; set guard: learn (or play), or remove it",
            )
        )
    late = [i for i in recipe.keep_checkpoints if i > recipe.train.iterations]
    if late:
        out.append(
            recipe.problem(
                ("keep_checkpoints",),
                f"iterations {late} lie beyond the run's last iteration "
                f"({recipe.train.iterations}); such a checkpoint would never be written",
            )
        )
    episodes = k * recipe.train.tasks_per_iteration
    if episodes > MAX_EPISODES:
        out.append(
            recipe.problem(
                ("rollout", "k"),
                f"k × train.tasks_per_iteration = {episodes} episodes an iteration, more than "
                f"{MAX_EPISODES}; lower one of them",
            )
        )
    return out


def recipe_schema() -> dict[str, Any]:
    return Recipe.model_json_schema(by_alias=True)


def _home(path: str) -> str:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (paths.HOME / p).exists():
        return str(paths.HOME / p)
    return path


def lr_at(iteration: int, train: TrainConfig) -> float:
    """The learning rate of iteration `iteration` (0-based) of `train.iterations`:

        constant:  lr
        cosine:    lr · (f + (1 − f) · (1 + cos(π·p)) / 2),  p = iteration / (iterations − 1),
                   f = lr_final

    per iteration rather than per optimiser step, since the number of minibatches an iteration
    holds varies with its episodes' lengths; a resumed run gets the same rate back. A run of one
    iteration has no fall: it trains at `lr`."""
    if train.lr_schedule == "constant":
        return train.lr
    p = min(iteration / max(train.iterations - 1, 1), 1.0)
    f = train.lr_final
    return train.lr * (f + (1 - f) * (1 + math.cos(math.pi * p)) / 2)


# --------------------------------------------------------------------------------------------
# Rewards and step samples


@dataclass
class EpisodeRewards:
    """One episode's rewards from its review (docs/method.md#rewards), per turn and in all."""

    local: list[float]  # [T] local reward of each assistant turn (0 where not valid)
    valid: list[bool]  # [T] the turn carries a local signal
    contributions: list[dict[str, float]]  # [T] clause id → its share of local[t]
    outcome: float  # R, the global reward
    truncated: bool = False  # truncated turns are trained on (with the worst local reward)
    scores: list[dict[str, float]] | None = None  # [T] clause id → +1 / −1 (`clause_scores`)
    blocked: float | None = None  # the local reward of a guard-blocked candidate (None: dropped)


def episode_rewards(
    trajs: Sequence[Trajectory],
    reviews: Sequence[Review],
    pcs: Sequence[PersonalConstitution],
    reward: RewardConfig,
    blocked: bool = False,
) -> list[EpisodeRewards]:
    """Each episode's local rewards per turn and its global reward, as `reward` defines them;
    with `blocked`, the local reward the guard's blocked candidates are trained on (the
    lowest: `TrainConfig.guard == "learn"`)."""
    out = []
    for t, r, pc in zip(trajs, reviews, pcs, strict=True):
        local, valid, contrib = turn_rewards(
            r, pc, reward.local_mode, reward.flagged, reward.red_lines
        )
        done = (
            (t.outcome.progress if reward.outcome == "progress" else t.outcome.success)
            if t.outcome
            else 0
        )
        outcome = global_reward(done, r, reward.global_blend, reward.flagged)
        scores = clause_scores(r, pc, reward.flagged, reward.red_lines)
        worst = worst_reward(pc, reward.local_mode)
        keep = reward.truncated == "worst"
        if keep:
            for ti in t.turns:
                if ti.truncated and ti.turn < len(local):
                    local[ti.turn], valid[ti.turn] = worst, True
                    contrib[ti.turn] = {"truncated": worst}
                    scores[ti.turn] = {c.id: -1.0 for c in pc.clauses}
        if reward.step_progress and not (reward.flagged == "trajectory" and r.flags):
            for ti, gain in zip(t.turns, progress_gains(t), strict=True):
                i = ti.turn
                if not gain or i >= len(local) or not valid[i]:
                    continue  # a turn without verdicts gets no pay on their behalf either
                if local[i] <= worst:  # vetoed, flagged, truncated: nothing buys it back
                    gain = min(gain, 0.0)
                bonus = reward.step_progress * gain
                local[i] += bonus
                contrib[i] = {**contrib[i], "progress": bonus}
        local = [x if v else 0.0 for x, v in zip(local, valid, strict=True)]
        out.append(
            EpisodeRewards(local, valid, contrib, outcome, keep, scores, worst if blocked else None)
        )
    return out


def progress_gains(traj: Trajectory) -> list[float]:
    """Each turn's share of the request fulfilled: Δp_t = p_t − p_(t−1), p_(−1) = 0.

    p_t is `TurnInfo.progress`, the world's `Outcome.progress` after turn t, so the gains sum
    to the episode's final progress and only orders carry one: the steps of a meal's progress
    (+1/n for an order that fills one of its n courses, −1/n for one that counts against it: a
    misfit, a second dish for a course, a course not asked for; 0 while the floor at 0 holds),
    1 for a single dish ordered right. Summed over an episode the pay is μ times its final
    progress, the quantity `reward.outcome: progress` ranks episodes by, moved onto the turns
    that made it (shaping with the progress as its potential, Ng et al. 1999, exactly so for
    an undiscounted return). Episodes recorded before turns carried their progress are an
    error, not silently unpaid."""
    before, gains = 0.0, []
    for ti in traj.turns:
        gains.append(ti.progress - before)
        before = ti.progress
    if traj.outcome and traj.outcome.progress > 0 and not any(gains):
        raise KitchenError(
            f"episode {traj.id}: its outcome has progress {traj.outcome.progress:g} but no turn "
            "records any (TurnInfo.progress); it was recorded before turns carried their "
            "progress: play it again for reward.step_progress"
        )
    return gains


def trainable(traj: Trajectory, truncated: bool = False) -> list:
    """The turns of `traj` a policy update trains on: sampled and not guarded; complete, or
    truncated too with `truncated` (`RewardConfig.truncated == "worst"`)."""
    return [ti for ti in traj.turns if ti.trainable(truncated)]


def step_samples(
    trajs: Sequence[Trajectory],
    rewards: Sequence[EpisodeRewards],
    config: AdvantageConfig,
    group_of: Callable[[int], Hashable],
    version: int = 0,
    clause_weights: dict[str, float] | None = None,
) -> StepSamples:
    """The step samples of a batch of episodes: one per trainable turn, in episode order.

    A turn's step return is `returns_for(config)` over *all* turns of its episode (an
    untrainable turn still passes its reward back); `group_of(i)` is episode i's task group.
    With `clause_weights` (clause id → weight: the constitution's clauses, in a fixed order) the
    samples also carry each turn's verdict per clause (`StepSamples.clauses`), which
    `local_signal: clauses` normalises. With `config.form_clauses`, each sample carries the
    share of its local reward those clauses gave and a code of its verdicts on them
    (`form_share`), which `mapo.form_judged` reads.

    With `rw.blocked` set, each candidate the guard blocked (`Trajectory.blocked`) at a turn
    the policy's own later try was played at follows its episode's turns as a sample of its
    own: the state of that turn, the local reward and step return `rw.blocked`, a violation of
    each axiom it broke, and `blocked` True (no global advantage: `mapo.advantages`). Where
    the guard's fallback was played instead, no try of the policy's stands beside them, and
    they are left out."""
    cols: dict[str, list] = {k: [] for k in ("state", "abstract", "group", "traj", "turn")}
    tokens, logp, local, ret, outcome, valid, verdicts = [], [], [], [], [], [], []
    forms: list[tuple[float, int]] = []
    blocked: list[bool] = []
    ids = list(clause_weights or {})

    def add(t, i, ti, *, toks, lps, reward, ok, g, scores, form, was_blocked=False) -> None:
        cols["state"].append(ti.exact_key)
        cols["abstract"].append(ti.abstract_key)
        cols["group"].append(group_of(i))
        cols["traj"].append(t.id)
        cols["turn"].append(ti.turn)
        tokens.append(toks)
        logp.append(lps)
        local.append(reward)
        valid.append(ok)
        ret.append(g)
        outcome.append(rewards[i].outcome)
        if clause_weights is not None:
            verdicts.append([scores.get(c, math.nan) for c in ids])
        if config.form_clauses:
            forms.append(form)
        blocked.append(was_blocked)

    for i, (t, rw) in enumerate(zip(trajs, rewards, strict=True)):
        if not t.turns:
            continue
        g = returns_for(config, torch.tensor([rw.local]), torch.tensor([rw.outcome]))[0]  # [T]
        for ti in trainable(t, rw.truncated):
            turn = rw.scores[ti.turn] if rw.scores and ti.turn < len(rw.scores) else {}
            form = form_share(rw, ti.turn, config.form_clauses) if config.form_clauses else None
            add(
                t,
                i,
                ti,
                toks=ti.tokens,
                lps=ti.logprobs,
                reward=rw.local[ti.turn],
                ok=rw.valid[ti.turn],
                g=float(g[ti.turn]),
                scores=turn,
                form=form,
            )
        if rw.blocked is None:
            continue
        for b in t.blocked:  # only beside a try of the policy's that the guard let through
            if b.turn < len(t.turns) and b.tokens and not t.turns[b.turn].guarded:
                add(
                    t,
                    i,
                    t.turns[b.turn],
                    toks=b.tokens,
                    lps=b.logprobs,
                    reward=rw.blocked,
                    ok=True,
                    g=rw.blocked,
                    scores=dict.fromkeys(b.clauses, -1.0),
                    form=(0.0, 0),
                    was_blocked=True,
                )
    flat_tokens, tok_len = ragged(tokens, torch.long)
    clauses = None
    if clause_weights is not None:
        clauses = torch.tensor(verdicts, dtype=torch.float32).reshape(len(local), len(ids))
    flat_logp, _ = ragged(logp, torch.float32)
    return StepSamples(
        state=cols["state"],
        abstract=cols["abstract"],
        task_group=cols["group"],
        traj=cols["traj"],
        turn=cols["turn"],
        tokens=flat_tokens,
        logp=flat_logp,
        tok_len=tok_len,
        local_reward=local,
        ret=ret,
        global_reward=outcome,
        valid=valid,
        version=version,
        clauses=clauses,
        clause_weight=None if clause_weights is None else list(clause_weights.values()),
        form_reward=[f for f, _ in forms] if config.form_clauses else None,
        form_key=[k for _, k in forms] if config.form_clauses else None,
        blocked=blocked if any(blocked) else None,
    )


def form_share(rw: EpisodeRewards, turn: int, form_clauses: Sequence[str]) -> tuple[float, int]:
    """(the share of turn `turn`'s local reward that `form_clauses` gave, a code of its verdicts
    on them): digit j of the code in base 3 is clause j's verdict (0 n/a, 1 pass, 2 violate).
    A turn scored as a whole (flagged, truncated, an axiom vetoed) gives its form no share."""
    share = rw.contributions[turn] if turn < len(rw.contributions) else {}
    scores = rw.scores[turn] if rw.scores and turn < len(rw.scores) else {}
    f = sum(share.get(c, 0.0) for c in form_clauses) if rw.valid[turn] else 0.0
    code = sum(
        3**j * {1.0: 1, -1.0: 2}.get(scores.get(c, 0.0), 0) for j, c in enumerate(form_clauses)
    )
    return f, code


# --------------------------------------------------------------------------------------------
# Scoring step samples: packed sequences


class Unit(NamedTuple):
    """One packed sequence: its token ids, the step samples it scores as spans (sample, start,
    length: the action's tokens are ids[start : start + length]), and its branches (start,
    length, prompt length): tokens after the main dialogue that continue an earlier prefix of it
    (`pack_units`; `unit_tree` builds their positions and attention)."""

    ids: list[int]
    spans: list[tuple[int, int, int]]
    branches: tuple[tuple[int, int, int], ...] = ()


def pack_units(
    tok: Any, items: Sequence[tuple[str, int, str, Sequence[int]]], branches: bool = True
) -> list[Unit]:
    """Pack step samples into sequences, one per trajectory where possible.

    `items` are (trajectory key, turn, prompt text, action ids). The turns of one trajectory
    share their history, so a single sequence — the last prompt plus its action — holds every
    earlier turn's prompt and action: one forward pass scores them all, instead of re-reading
    the history once per turn (3–5x fewer tokens on concierge dialogues). That is exact only when
    each later prompt's tokens start with the earlier prompt's tokens followed by the action ids
    actually sampled; it is checked, and where it fails (the world stores an action re-rendered —
    stripped of the leading space the policy sampled, say — and the next turn's prompt holds that
    rendering) the sequence ends and a new one starts from that turn's own prompt, so every action
    is scored after exactly the prompt the policy saw. (Ending the whole trajectory's packing at
    the first mismatch instead — one sequence per turn from there — put 77% of an iteration's
    update tokens into the 15% of trajectories with such a turn.)

    An action whose prompt is a prefix of a sequence already packed — a candidate the axiom
    guard blocked, whose state the played turn shares — becomes, with `branches`, a branch of
    that sequence: the prompt's last token again, then the action, after the main dialogue,
    placed at the prompt's positions and seeing only the prompt (`unit_tree`). Without
    `branches` (a model whose attention takes no custom mask), or when nothing matches, it
    starts a sequence of its own; a blocked candidate then re-reads its whole prompt, and the
    played turns after it start another.
    """
    by_traj: dict[str, list[int]] = {}
    for i, (key, _, _, _) in enumerate(items):
        by_traj.setdefault(key, []).append(i)
    units: list[Unit] = []
    for members in by_traj.values():
        members.sort(key=lambda i: items[i][1])
        # open sequences of this trajectory: [main ids, spans, pending branches (sample, prompt)]
        open_: list[tuple[list[int], list[tuple[int, int, int]], list[tuple[int, int]]]] = []
        for i in members:
            prompt = tok(items[i][2], add_special_tokens=False)["input_ids"]
            action = list(items[i][3])
            cur = open_[-1] if open_ else None
            if cur is not None and prompt[: len(cur[0])] == cur[0]:  # it extends the dialogue
                cur[1].append((i, len(prompt), len(action)))
                cur[0][len(cur[0]) :] = prompt[len(cur[0]) :] + action
                continue
            host = next(
                (u for u in reversed(open_) if branches and u[0][: len(prompt)] == prompt), None
            )
            if host is not None and prompt:
                host[2].append((i, len(prompt)))
            else:
                open_.append((prompt + action, [(i, len(prompt), len(action))], []))
        for main, spans, pending in open_:
            ids, spans, forks = list(main), list(spans), []
            for i, n in pending:
                action = list(items[i][3])
                start = len(ids)
                ids += [main[n - 1], *action]
                spans.append((i, start + 1, len(action)))
                forks.append((start, 1 + len(action), n))
            units.append(Unit(ids, spans, tuple(forks)))
    return units


def unit_tree(units: Sequence[Unit], device: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Position ids [U, T] and a boolean attention mask [U, 1, T, T] (True: attends) for units
    with branches, as `token_logprobs(tree=...)` takes them; None when no unit has one.

    The main dialogue is causal from position 0. A branch (start, length, n) repeats the
    prompt's last token at position n − 1 and continues from there: it attends to the prompt's
    first n − 1 tokens and causally to itself, so it scores its action exactly as the
    prompt alone would. Padding attends to itself only."""
    if not any(u.branches for u in units):
        return None
    width = max(len(u.ids) for u in units)
    pos = torch.zeros((len(units), width), dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(units), 1, 1)  # [U, T, T]
    for u, unit in enumerate(units):
        main = unit.branches[0][0] if unit.branches else len(unit.ids)
        pos[u, :main] = torch.arange(main)
        mask[u, :main, :main] = torch.ones(main, main, dtype=torch.bool).tril()
        for start, length, n in unit.branches:
            end = start + length
            pos[u, start:end] = torch.arange(n - 1, n - 1 + length)
            mask[u, start:end, : n - 1] = True
            mask[u, start:end, start:end] = torch.ones(length, length, dtype=torch.bool).tril()
    return pos.to(device), mask[:, None].to(device)


def minibatches(units: Sequence[Unit], order: Sequence[int], size: int) -> list[list[Unit]]:
    """Groups of units holding about `size` step samples each, of similar length, in a random
    order: the units are sorted by length (ties in `order`), cut into consecutive groups, and
    the groups visited in the order of their first unit in `order`. Similar lengths waste
    little padding — a minibatch is padded to its longest sequence, and a meal's sequence is
    four times a single dish's."""
    rank = {u: i for i, u in enumerate(order)}
    by_length = sorted(order, key=lambda u: (len(units[u][0]), rank[u]))
    groups: list[list[int]] = []
    cur: list[int] = []
    count = 0
    for u in by_length:
        cur.append(u)
        count += len(units[u][1])
        if count >= size:
            groups.append(cur)
            cur, count = [], 0
    if cur:
        groups.append(cur)
    groups.sort(key=lambda g: min(rank[u] for u in g))
    return [[units[u] for u in g] for g in groups]


def unit_tensors(
    units: Sequence[Unit], pad: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [U, T], attention mask [U, T], and the positions that score an action
    token [U, T-1] (position p scores token p+1), for `token_logprobs(positions=...)`."""
    width = max(len(u.ids) for u in units)
    ids = torch.full((len(units), width), pad, dtype=torch.long)
    attn = torch.zeros((len(units), width), dtype=torch.long)
    at = torch.zeros((len(units), width - 1), dtype=torch.bool)
    for u, (seq, spans, _) in enumerate(units):
        ids[u, : len(seq)] = torch.tensor(seq)
        attn[u, : len(seq)] = 1
        for _, start, length in spans:
            at[u, start - 1 : start - 1 + length] = True
    return ids.to(device), attn.to(device), at.to(device)


def spans_of(
    values: torch.Tensor, units: Sequence[Unit]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Per-step-sample rows of `values` [U, T-1] (as `token_logprobs` returns: position p scores
    token p+1). Returns (sample indices, [B, L] values at each action's tokens, mask [B, L])."""
    rows, idx = [], []
    for u, unit in enumerate(units):
        for sample, start, length in unit.spans:
            rows.append(values[u, start - 1 : start - 1 + length])  # [length]
            idx.append(sample)
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, L], keeps the graph
    lengths = torch.tensor([r.shape[0] for r in rows], device=values.device)
    mask = torch.arange(out.shape[1], device=values.device)[None, :] < lengths[:, None]
    return idx, out, mask


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Iteration:
    """What one iteration produced, in the order `Run.step` makes it."""

    it: int
    trajs: list[Trajectory]
    pcs: list[PersonalConstitution]
    rollout: RolloutStats
    reviews: list[Review]  # the training reviewer's (GRM, or the judge)
    judged: list[Review]  # the rule judge's, for metrics
    review_seconds: float
    rewards: list[EpisodeRewards]
    samples: StepSamples
    scored: Scored | None  # None when no turn could be trained on
    update: dict[str, float]


def _var(xs: Sequence[float]) -> float:
    return statistics.pvariance(xs) if xs else math.nan


def iteration_metrics(x: Iteration, buffer: ReplayBuffer, grm: bool) -> dict[str, Any]:
    """The metrics row of one iteration (names explained in docs/metrics.md). A rate or a mean
    over nothing is NaN, never 0 or 1: `rollout/truncated_frac` with no turn, `reward/local_*`
    with no turn that carries a local signal, `judge/compliance` when no clause applied,
    `grm/parsed` when no review had a verdict to write. `train/step_samples` counts the step
    samples trained on: 0 for an iteration that trained on nothing (the update metrics are
    then absent)."""
    outcomes = [rw.outcome for rw in x.rewards]
    success = [t.outcome.success if t.outcome else 0 for t in x.trajs]
    valid = x.samples.valid
    local = x.samples.local_reward[valid].tolist()
    m: dict[str, Any] = {
        "iteration": x.it,
        "speed/rollout_tokens_per_s": x.rollout.tokens_per_second,
        "rollout/truncated_frac": share(x.rollout.truncated, x.rollout.turns),
        "rollout/turns_mean": share(x.rollout.turns, len(x.trajs)),
    }
    if grm:
        m["grm/parsed"] = mean(r.parsed_fraction for r in x.reviews if r.verdicts)
        m["grm/flagged_frac"] = mean(bool(r.flags) for r in x.reviews)
        m["reward/gap_grm_minus_judge"] = reward_gap(x.reviews, x.judged, x.pcs)
    m["speed/reviews_per_s"] = len(x.trajs) / x.review_seconds if x.review_seconds else 0.0
    m |= {
        "reward/global_mean": mean(outcomes),
        "reward/global_var": _var(outcomes),
        "reward/local_mean": mean(local),
        "reward/local_var": _var(local),
        "reward/local_valid_frac": share(int(valid.sum()), len(valid)),
        "episode/success": mean(success),
        "episode/progress": mean(t.outcome.progress if t.outcome else 0.0 for t in x.trajs),
        "episode/turns": mean(len(t.turns) for t in x.trajs),
        "train/step_samples": 0,
        "guard/blocked": sum(len(t.blocked) for t in x.trajs),
        "train/blocked_samples": int(x.samples.blocked_mask().sum()),
    }
    m |= {f"clause/{c}_pass_rate": v for c, v in clause_pass_rates(x.reviews).items()}
    m |= {f"judge/{c}_pass_rate": v for c, v in clause_pass_rates(x.judged).items()}
    judged = policy_report(x.trajs, x.pcs, x.judged)
    m["judge/compliance"] = judged.compliance
    m["judge/axiom_violations"] = judged.axiom_violations
    if x.scored is not None:
        m |= x.update | x.scored.metrics
    m["buffer/size"] = len(buffer)
    m |= {f"buffer/evicted_{k}": v for k, v in buffer.evicted.items()}
    return m


def unread_note(recipe: Recipe) -> str:
    """What a run whose advantage reads no review says when it starts (`reward.unread_reviews`)."""
    return (
        f"{recipe.name}: the advantage ({recipe.advantage.resolve().name}) reads no per-turn "
        "reward and the global reward is the world's outcome, so the GRM is not run; the rule "
        "judge's verdicts fill the per-turn metrics (reward.unread_reviews: review runs it)"
    )


class Run:
    """One training run: state, one iteration at a time, checkpoints."""

    def __init__(
        self, recipe: Recipe, folder: str | os.PathLike | None = None, *, progress: bool = True
    ):
        self.recipe = recipe
        self.folder = Path(folder) if folder else paths.RUNS / recipe.name
        self.progress = progress
        self.adv_cfg = recipe.advantage.resolve()
        self.constitution = load_constitution(_home(recipe.constitution))
        self.clause_weights = {
            c: self.constitution.clause(c).weight for c in self.constitution.clause_ids
        }
        self.cache = PersonalizationCache()
        self.menu = load_menu()
        spec = recipe.policy.model_copy(update={"path": _home(recipe.policy.path)})
        if recipe.torch_threads:
            torch.set_num_threads(recipe.torch_threads)
        torch.manual_seed(recipe.seed)
        with located(recipe, ("policy",)):
            self.model, self.tok = load_model(spec)
        self.adapter = spec.lora.name
        with located(recipe, ("grm",)):
            self.grm = self._load_grm() if recipe.grm_reviews else None
        if recipe.reward.reviewer == "grm" and self.grm is None and progress:
            from tqdm.auto import tqdm

            tqdm.write(unread_note(recipe))
        params = [p for p in self.model.parameters() if p.requires_grad]  # the policy adapter
        self.opt = torch.optim.AdamW(
            params, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay
        )
        self.buffer = ReplayBuffer(recipe.buffer)
        self.iteration = 0
        self.updates = 0
        self.first_entropy: float | None = None
        self.beta = self.adv_cfg.beta  # the KL coefficient now (adapted if kl_target is set)
        self.metrics: list[dict[str, Any]] = []
        self.trajs: dict[str, tuple[Trajectory, PersonalConstitution]] = {}
        split_profiles("train")  # no training diner: a located error, not a crash in the draw
        self.pool = pair_jobs(
            "train",
            recipe.train.task_pool,
            recipe.seed,
            self.constitution,
            cache=self.cache,
            long_share=recipe.train.long_share,
        )
        # the last iteration's episodes, reviews and per-turn advantages (notebooks browse them)
        self.last: dict[str, Any] = {}

    def _load_grm(self) -> GRM:
        """The GRM: its own checkpoint, or (on one GPU) a second adapter on the policy's base."""
        cfg = self.recipe.grm.model_copy(update={"model": _home(self.recipe.grm.model)})
        if not cfg.adapter:
            return GRM.load(cfg)
        folder = Path(cfg.model)
        if (folder / "adapter_config.json").exists():
            self.model = load_adapter(self.model, folder, cfg.adapter, trainable=False)
        else:  # no trained GRM adapter given: a fresh one (for sizing and speed runs only)
            self.model = add_adapter(self.model, cfg.adapter)
        use_adapter(self.model, self.adapter)  # the policy stays the trained adapter
        return GRM(self.model, self.tok, cfg)

    # -- before the first iteration ---------------------------------------------------------

    def preflight(self) -> list[Problem]:
        """What would make this run learn nothing, checked before its first iteration (each a
        problem at the recipe field to change): an empty task pool or held-out set; a first
        prompt that leaves no room for `rollout.max_new_tokens` in the policy's context (every
        such episode would end before its first turn); a GRM whose context has no room for a
        prompt beside `grm.max_new_tokens`, or that produces fewer than `PREFLIGHT_PARSED` of
        its verdicts on two scripted dialogues (a wrong checkpoint). About 2 s with the GRM."""
        r = self.recipe
        out: list[Problem] = []
        if not self.pool:
            out.append(
                r.problem(
                    ("train", "task_pool"),
                    "no training job: no task of the pool is feasible for a training diner; "
                    "check data/splits.yaml and the constitution",
                )
            )
        held = eval_jobs(r.eval, self.constitution) if r.eval_every else []
        if r.eval_every and not held:
            out.append(r.problem(("eval", "tasks"), "no held-out job to evaluate on"))
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(limit, int):
            first = max(map(len, self._first_prompts(self.pool + held)), default=0)
            need = first + r.rollout.max_new_tokens
            if need > limit:
                room = limit - first
                fix = (
                    f"lower it to at most {room} (the longest scripted message is ~40 tokens)"
                    if room > 0
                    else "use a policy with a longer context"
                )
                out.append(
                    r.problem(
                        ("rollout", "max_new_tokens"),
                        f"{r.rollout.max_new_tokens} new tokens after a first prompt of up to "
                        f"{first} tokens need {need} positions, but the policy has "
                        f"{limit} (max_position_embeddings): such episodes would end before "
                        f"their first turn and train on nothing; {fix}",
                    )
                )
        if self.grm is not None:
            out += self._grm_preflight()
        return out

    def _first_prompts(self, jobs: Sequence[Job]) -> list[list[int]]:
        """The token ids of each distinct prompt the policy reads before its first turn."""
        from kitchen.rollout import prompt_ids
        from kitchen.world import World

        w = World(self.menu, max_turns=self.recipe.rollout.max_turns)
        seen: dict[str, list[dict[str, Any]]] = {}
        for task, pc, diner in jobs:
            w.reset(task, pc.dimensions, profile=pc.profile, diner=diner)
            seen.setdefault(json.dumps(w.traj.messages, sort_keys=True), w.traj.messages)
        return [prompt_ids(self.tok, m) for m in seen.values()]

    def _grm_preflight(self) -> list[Problem]:
        from kitchen.scripted import episodes

        r, g = self.recipe, self.grm
        unknown = [c for c in r.grm.cascade if c not in self.constitution.clause_ids]
        if unknown:
            return [
                r.problem(
                    ("grm", "cascade"),
                    f"no clause {', '.join(map(repr, unknown))} in the constitution; its "
                    f"clauses: {', '.join(self.constitution.clause_ids)}",
                )
            ]
        limit = getattr(getattr(g.model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and limit - g.cfg.max_new_tokens < 64:
            return [
                r.problem(
                    ("grm", "max_new_tokens"),
                    f"{g.cfg.max_new_tokens} review tokens leave {limit - g.cfg.max_new_tokens} "
                    f"of the GRM's {limit} positions for the dialogue; lower it (640 fits the "
                    "tiny GRM's longest review)",
                )
            ]
        eps = episodes(2, split="train", seed=r.seed, constitution=self.constitution)
        with torch.random.fork_rng(devices=[]):  # the run's own draws stay as they were
            reviews = g.review([t for t, _ in eps], [pc for _, pc in eps])
        ruled = set(g.cfg.ruled)  # the rule judge's verdicts are not the GRM's writing
        own = [v.verdict is not None for x in reviews for v in x.verdicts if v.clause not in ruled]
        parsed = mean(own) if own else 1.0
        if not parsed >= PREFLIGHT_PARSED:
            return [
                r.problem(
                    ("grm", "model"),
                    f"the GRM {r.grm.model} wrote {show(parsed, '.0%')} of its verdicts on 2 "
                    f"scripted dialogues (at least {PREFLIGHT_PARSED:.0%} expected): every "
                    "unwritten verdict is masked, so the rewards would be mostly empty. Is it "
                    "a GRM checkpoint (the shipped one: data/models/grm-tiny; `kitchen grm "
                    "train` makes one)? Compare with `kitchen grm calibrate --grm PATH`",
                )
            ]
        return []

    def _jobs(self, it: int) -> list[Job]:
        """The jobs of iteration `it`: a seeded draw from the task pool."""
        rng = random.Random(f"jobs:{self.recipe.seed}:{it}")
        return rng.sample(self.pool, min(self.recipe.train.tasks_per_iteration, len(self.pool)))

    def _guard(self, pc: PersonalConstitution) -> AxiomGuard:
        """The axiom guard of one job's training rollouts (`train.guard`), at the recipe's
        regeneration budget."""
        return AxiomGuard(pc, budget=self.recipe.train.guard_budget)

    # -- one iteration ----------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        """Run one iteration of the algorithm (module docstring); returns its metrics row."""
        r, it, k = self.recipe, self.iteration, self.recipe.rollout.k
        torch.manual_seed(r.seed * 100_003 + it)  # dropout, minibatch order: replayable
        # 1. roll out K episodes per job
        jobs = self._jobs(it)
        pcs = [pc for _, pc, _ in jobs for _ in range(k)]
        t_roll = time.perf_counter()
        trajs, stats = rollout(
            self.model,
            self.tok,
            jobs,
            r.rollout,
            seed=r.seed * 10_007 + it,
            menu=self.menu,
            group_prefix=f"it{it}:",
            guard=None if r.train.guard == "off" else self._guard,
            guarded=max(1, round(r.train.guard_share * k)),
        )
        rollout_seconds = time.perf_counter() - t_roll
        # 2. review every episode (the rule judge too: it is what the metrics trust)
        t0 = time.perf_counter()
        judged = [judge(t, pc, self.menu) for t, pc in zip(trajs, pcs, strict=True)]
        if self.grm is not None:
            reviews = self.grm.review(trajs, pcs)
        elif r.reward.reviewer == "grm":  # nothing reads the GRM's verdicts: the judge's stand in
            reviews = [
                j.model_copy(update={"flags": injection_flags(t)})
                for j, t in zip(judged, trajs, strict=True)
            ]
        else:
            reviews = judged
        review_seconds = time.perf_counter() - t0
        # 3. rewards per turn and per episode → one step sample per trainable turn
        rewards = episode_rewards(trajs, reviews, pcs, r.reward, r.train.guard == "learn")
        samples = step_samples(
            trajs,
            rewards,
            self.adv_cfg,
            lambda i: f"it{it}:job{i // k}",
            version=it,
            clause_weights=self.clause_weights,
        )
        # 4. advantages (through the buffer where the preset uses one), 5. REINFORCE + KL
        scored, update = None, {}
        if len(samples):
            scored = advantages_for(samples, self.adv_cfg, self.buffer, step=it)
            self.trajs |= {t.id: (t, pc) for t, pc in zip(trajs, pcs, strict=True)}
            update = self._update(scored)
        self.buffer.advance(it + 1)

        # bookkeeping: metrics from what the iteration produced, what notebooks browse, logs
        x = Iteration(
            it, trajs, pcs, stats, reviews, judged, review_seconds, rewards, samples, scored, update
        )
        m = iteration_metrics(x, self.buffer, grm=self.grm is not None)
        m["time/rollout_s"], m["time/review_s"] = rollout_seconds, review_seconds
        played: dict[tuple[str, int], float] = {}
        blocked: list[tuple[tuple[str, int], float]] = []
        if scored is not None:
            for key, turn, a, b in zip(
                samples.traj,
                samples.turn.tolist(),
                scored.adv[: scored.n_fresh].tolist(),
                samples.blocked_mask().tolist(),
                strict=True,
            ):
                if b:
                    blocked.append(((key, turn), a))
                else:
                    played[(key, turn)] = a
        self.last = {
            "trajectories": trajs,
            "reviews": reviews,
            "judged": judged,
            "pcs": pcs,
            "rewards": rewards,
            "advantages": played,  # (trajectory, turn) → the played turn's advantage
            "blocked_advantages": blocked,  # ((trajectory, turn), advantage) of each blocked one
        }
        if r.samples_per_iteration:
            self._log_samples(x)
        self.iteration += 1
        self.metrics.append(m)
        return m

    def _update(self, scored: Scored) -> dict[str, float]:
        """REINFORCE (or, with `advantage.clip`, PPO's clipped surrogate) + KL on the scored step
        samples (`mapo_loss`), `train.epochs` passes of minibatches; each trajectory's turns are
        scored in one packed sequence."""
        r, cfg, s = self.recipe, self.adv_cfg, scored.samples
        old, _ = s.padded("logp")  # [G, T] log-probs at collection: π_old of replay and clip
        items = [
            (key, turn, render_prompt(self.tok, self.trajs[key][0].prompt_messages(turn)), a)
            for key, turn, a in zip(s.traj, s.turn.tolist(), s.actions(), strict=True)
        ]
        units = pack_units(self.tok, items, branches=takes_tree(self.model))

        self.model.train()
        dev = self.model.device
        lr = lr_at(self.iteration, r.train)
        for group in self.opt.param_groups:
            group["lr"] = lr
        tokens_seen = 0
        t0 = time.perf_counter()
        stats: dict[str, list[float]] = {}
        autocast = update_autocast(r.train.autocast, dev)
        for _ in range(r.train.epochs):
            order = torch.randperm(len(units)).tolist()
            for chunk in minibatches(units, order, r.train.minibatch):
                ids, attn, at = unit_tensors(chunk, self.tok.pad_token_id, dev)
                tree = unit_tree(chunk, dev)
                with autocast:
                    logp_all, ent_all = token_logprobs(
                        self.model, ids, attn, positions=at, tree=tree
                    )
                idx, logp, mask = spans_of(logp_all, chunk)
                ref = None
                if cfg.beta > 0 or r.train.kl_metric:
                    with torch.no_grad(), adapters_disabled(self.model), autocast:
                        ref_all, _ = token_logprobs(self.model, ids, attn, positions=at, tree=tree)
                    _, ref, _ = spans_of(ref_all, chunk)
                _, ent, _ = spans_of(ent_all, chunk)
                loss, lm = mapo_loss(
                    logp,
                    scored.adv[idx].to(dev),
                    mask.float(),
                    ref_logp=ref,
                    old_logp=old[idx][:, : logp.shape[1]].to(dev) if cfg.reads_old_logp else None,
                    **cfg.loss_kwargs() | {"beta": self.beta},
                )
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.requires_grad], r.train.grad_clip
                )
                if not (math.isfinite(lm["loss/total"]) and math.isfinite(float(gn))):
                    raise KitchenError([diverged(r, self.iteration, lm["loss/total"], float(gn))])
                self.opt.step()
                self.updates += 1
                tokens_seen += int(attn.sum())
                lm["policy/entropy"] = share((ent * mask).sum().item(), mask.sum().item())
                lm["policy/grad_norm"] = float(gn)
                if "kl/mean" not in lm and ref is not None:  # β = 0: still report the drift
                    lm["kl/mean"] = float(
                        ((logp.detach() - ref) * mask).sum() / mask.sum().clamp(min=1)
                    )
                for key, v in lm.items():
                    stats.setdefault(key, []).append(v)
        out = {key: statistics.fmean(v) for key, v in stats.items()}
        out["time/update_s"] = time.perf_counter() - t0
        out["speed/update_tokens_per_s"] = tokens_seen / max(out["time/update_s"], 1e-9)
        out["train/step_samples"] = len(items)
        out["train/lr"] = lr
        out["kl/beta"] = self.beta
        if cfg.kl_target is not None:
            self.beta = adaptive_beta(
                self.beta, out.get("kl/mean", math.nan), cfg.kl_target, cfg.beta
            )
        ent = out.get("policy/entropy", math.nan)
        if self.first_entropy is None and math.isfinite(ent):
            self.first_entropy = ent
        first = self.first_entropy
        out["alarm/entropy_collapse"] = float(
            first is not None and ent < r.train.entropy_alarm * first
        )
        return out

    def _log_samples(self, x: Iteration) -> None:
        rng = random.Random(f"samples:{self.recipe.seed}:{x.it}")
        n = min(self.recipe.samples_per_iteration, len(x.trajs))
        rows = [
            {
                "iteration": x.it,
                "trajectory": x.trajs[i].model_dump(mode="json"),
                "review": x.reviews[i].model_dump(mode="json"),
                "local": x.rewards[i].local,
                "valid": x.rewards[i].valid,
                "contributions": x.rewards[i].contributions,
            }
            for i in rng.sample(range(len(x.trajs)), n)
        ]
        write_jsonl(self.folder / "samples.jsonl", rows, append=True)

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(
        self, episodes: tuple[Sequence[Trajectory], Sequence[Any]] | None = None
    ) -> dict[str, Any]:
        """Held-out evaluation of the current policy (rule judge); appends to eval.jsonl.
        `episodes`: the held-out jobs already played by this policy (`held_out_episodes`), to
        read them without playing them again."""
        t0 = time.perf_counter()
        played = episodes
        if played is None:
            played = held_out_episodes(self.model, self.tok, self.recipe, self.constitution)
        rep, kinds = reports_of(*played)
        row = json_ready({"iteration": self.iteration, **rep.model_dump(mode="json")})
        row["by_kind"] = {k: json_ready(r.model_dump(mode="json")) for k, r in kinds.items()}
        write_jsonl(self.folder / "eval.jsonl", [row], append=True)
        out = {
            "eval/success": rep.success,
            "eval/compliance": rep.compliance,
            "eval/axiom_violations": rep.axiom_violations,
            "eval/valid_actions": rep.valid_actions,
            "time/eval_s": time.perf_counter() - t0,
        }
        out |= {f"eval/{c}_pass_rate": v for c, v in rep.clause_pass.items()}
        if len(kinds) > 1:  # a mixed held-out set: each kind's curve too
            for kind, r in kinds.items():
                out |= {f"eval/{kind}_compliance": r.compliance, f"eval/{kind}_success": r.success}
        return out

    # -- persistence ------------------------------------------------------------------------

    def write_metrics(self) -> None:
        import polars as pl  # the loop itself runs without the notebook stack

        frame = pl.DataFrame(self.metrics, infer_schema_length=None)
        buf = io.BytesIO()
        frame.write_parquet(buf)
        atomic_write_bytes(self.folder / "metrics.parquet", buf.getvalue())

    def save(self) -> Path:
        """Write a complete checkpoint atomically and point `latest` at it."""
        ck = self.folder / "checkpoints"
        name = f"it-{self.iteration:04d}"
        tmp = ck / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_adapter(self.model, self.adapter, tmp / "adapter")
        state = {
            "optimizer": self.opt.state_dict(),
            "buffer": self.buffer,
            "updates": self.updates,
            "iteration": self.iteration,
            "first_entropy": self.first_entropy,
            "beta": self.beta,
            "metrics": self.metrics,
            "trajs": {
                k: (t.model_dump(mode="json"), pc.model_dump(mode="json"))
                for k, (t, pc) in self._live_trajs().items()
            },
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        blob = io.BytesIO()
        torch.save(state, blob)
        atomic_write_bytes(tmp / "state.pt", blob.getvalue())
        final = ck / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(ck / "latest", name + "\n")
        kept = {f"it-{i:04d}" for i in self.recipe.keep_checkpoints}
        for old in sorted(ck.glob("it-*"))[:-2]:  # keep the newest two and the ones asked for
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _live_trajs(self) -> dict[str, tuple[Trajectory, PersonalConstitution]]:
        """Trajectories some live buffer record still points at (for prompts on replay)."""
        live = set(self.buffer.keys_of(self.buffer.rows(), "traj")) if len(self.buffer) else set()
        self.trajs = {k: v for k, v in self.trajs.items() if k in live}
        return self.trajs

    def load(self, checkpoint: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = torch.load(checkpoint / "state.pt", weights_only=False)
        weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.model, weights, adapter_name=self.adapter)
        self.opt.load_state_dict(state["optimizer"])
        self.buffer = state["buffer"]
        self.updates, self.iteration = state["updates"], state["iteration"]
        self.first_entropy, self.metrics = state["first_entropy"], state["metrics"]
        self.beta = state.get("beta", self.adv_cfg.beta)  # checkpoints before kl_target: fixed β
        self.trajs = {
            k: (Trajectory.model_validate(t), PersonalConstitution.model_validate(pc))
            for k, (t, pc) in state["trajs"].items()
        }
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])


def run_checkpoint(where: str | os.PathLike) -> tuple[Path, Path | None]:
    """(run folder, checkpoint folder) for `where`: a run folder (its newest checkpoint; None
    before the first) or one of its checkpoints (`<run>/checkpoints/it-0030`)."""
    where = Path(where)
    if (where / "state.pt").exists() and where.parent.name == "checkpoints":
        return where.parent.parent, where
    return where, latest_checkpoint(where)


def load_run_policy(folder: str | os.PathLike) -> tuple[Any, Any]:
    """The policy of a run's newest checkpoint (or of the checkpoint folder given): its base with
    the trained adapter, in eval mode."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder, ck = run_checkpoint(folder)
    if ck is None:
        raise KitchenError(f"{folder}: no checkpoint yet; run `kitchen cook` first")
    recipe = load_recipe(folder / "recipe.yaml")
    spec = recipe.policy.model_copy(update={"path": _home(recipe.policy.path)})
    model, tok = load_model(spec)
    weights = load_file(str(ck / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights, adapter_name=spec.lora.name)
    model.eval()
    return model, tok


def held_out_episodes(
    model: Any, tok: Any, recipe: Recipe, constitution: Any = None
) -> tuple[list[Trajectory], list[Any]]:
    """`recipe.eval`'s held-out jobs played by `model` (the recipe's rollout settings, k =
    `eval.samples`): the episodes and each one's personal constitution."""
    cfg = recipe.eval
    jobs = eval_jobs(cfg, constitution)
    rcfg = recipe.rollout.model_copy(update={"k": cfg.samples})
    trajs, _ = rollout(model, tok, jobs, rcfg, seed=cfg.seed, group_prefix="eval:")
    return trajs, [pc for _, pc, _ in jobs for _ in range(cfg.samples)]


def reports_of(trajs: Sequence[Trajectory], pcs: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """The rule judge's report of held-out episodes, and the same episodes' report per task kind
    (`{"short": report, "long": report}`; a kind they lack is left out)."""
    report = policy_report(trajs, pcs)
    kinds = {}
    for kind, meal in (("short", False), ("long", True)):
        idx = [i for i, t in enumerate(trajs) if bool(t.task.courses) == meal]
        if idx:
            kinds[kind] = policy_report([trajs[i] for i in idx], [pcs[i] for i in idx])
    return report, kinds


PREFLIGHT_PARSED = 0.5  # share of verdicts a GRM must write on scripted dialogues (`preflight`)


@contextlib.contextmanager
def located(recipe: Recipe, block: Loc) -> Iterator[None]:
    """Problems raised while loading what `block` of `recipe` names (a model, an adapter) are
    placed at the field they are about (`path`, `device`, `quantization`, `lora.*`)."""
    try:
        yield
    except KitchenError as e:
        raise KitchenError(
            [recipe.problem(_field_of(block, p.message), p.message) for p in e.problems]
        ) from None
    except ValueError as e:  # peft: target modules the model does not have
        if "target" not in str(e).lower():
            raise
        msg = f"{str(e).splitlines()[0]}; name modules the model has, or 'all-linear'"
        loc = block + ("lora", "target_modules") if block == ("policy",) else block
        raise KitchenError([recipe.problem(loc, msg)]) from None


def _field_of(block: Loc, message: str) -> Loc:
    if message.startswith("device"):
        return block + ("device",)
    if "bitsandbytes" in message:
        return block + ("quantization",)
    return block + (("path",) if block == ("policy",) else ("model",))


def autocast_mode(mode: str, device: torch.device) -> str:
    """`TrainConfig.autocast` on `device`: 'fast' becomes 'bfloat16' where bfloat16 is multiplied
    in hardware and 'none' elsewhere; the other modes stay."""
    if mode == "fast":
        return "bfloat16" if bf16_is_native(device) else "none"
    return mode


def update_autocast(mode: str, device: torch.device) -> torch.autocast:
    """`TrainConfig.autocast` → the autocast context the update's passes run in (disabled for
    'none', and for 'fast' where bfloat16 is not multiplied in hardware)."""
    enabled = autocast_mode(mode, device) == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def diverged(recipe: Recipe, iteration: int, loss: float, grad_norm: float) -> Problem:
    """The error of an update whose loss or gradient is not finite (before the step is taken:
    NaN weights would make every later rollout garbage)."""
    return recipe.problem(
        ("train", "lr"),
        f"the update of iteration {iteration} diverged (loss {loss}, gradient norm {grad_norm}) "
        f"before its optimiser step; lower the learning rate ({recipe.train.lr:g}) or "
        "train.grad_clip",
    )


def untrained_problem(run: Run) -> Problem | None:
    """The error of `train.max_untrained_iterations` (the field's description): the last
    iterations trained on nothing, or the run is over and never trained. The problem sits at the
    field the last iteration's episodes point to — turns cut by the token budget, episodes over
    before their first turn, turns the guard replaced — and says what happened."""
    r = run.recipe
    idle = 0
    for m in reversed(run.metrics):
        if m.get("train/step_samples", 0) > 0:
            break
        idle += 1
    over = run.iteration >= r.train.iterations
    if idle < r.train.max_untrained_iterations and not (over and idle == len(run.metrics)):
        return None
    trajs = run.last.get("trajectories", [])
    turns = [ti for t in trajs for ti in t.turns]
    truncated = sum(ti.truncated for ti in turns)
    guarded = sum(ti.guarded for ti in turns)
    ends = sorted({t.end for t in trajs if not t.turns})
    first = run.iteration - idle
    span = f"iteration {first}" if idle == 1 else f"iterations {first}-{run.iteration - 1}"
    head = f"{span} trained on nothing (no turn a policy update can use)"
    last = f"in iteration {run.iteration - 1}"
    if not turns:
        loc = ("rollout",)
        why = f"{last} every episode ended before its first turn ({', '.join(ends)})"
    elif truncated == len(turns):
        loc = ("rollout", "max_new_tokens")
        why = (
            f"{last} all {len(turns)} turns ran out of the {r.rollout.max_new_tokens}-token "
            "budget before their end-of-turn token (reward.truncated = drop leaves them out); "
            "raise it, or train on them with reward.truncated = worst"
        )
    else:
        loc = ("rollout",)
        why = f"{last} {truncated} of {len(turns)} turns were truncated, {guarded} guarded"
    tail = (
        f"; the run stops after train.max_untrained_iterations = "
        f"{r.train.max_untrained_iterations} such iterations in a row, or when it ends without "
        "training on a single turn"
    )
    return r.problem(loc, f"{head}: {why}{tail}")


def latest_checkpoint(folder: Path) -> Path | None:
    pointer = folder / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    ck = folder / "checkpoints" / pointer.read_text().strip()
    return ck if (ck / "state.pt").exists() else None


def cook(
    recipe: Recipe | None = None,
    *,
    resume: str | os.PathLike | None = None,
    progress: bool = True,
    on_iteration: Callable[[Run, dict], None] | None = None,
) -> Run:
    """Run a recipe to the end (or continue the run in `resume`); returns the finished `Run`."""
    from tqdm.auto import tqdm

    if resume is not None:
        folder = Path(resume)
        if not (folder / "recipe.yaml").exists():
            raise KitchenError(f"{folder}: not a run folder (no recipe.yaml); give runs/<name>")
        saved = load_recipe(folder / "recipe.yaml")
        if recipe is not None and recipe.model_dump() != saved.model_dump():
            raise KitchenError(
                f"{folder}: the recipe differs from the run being resumed; resume "
                "without a recipe, or start a new run name"
            )
        recipe = saved
        problems = file_problems(recipe)
        if problems:
            raise KitchenError(problems)
        run = Run(recipe, folder, progress=progress)
        ck = latest_checkpoint(folder)
        if ck is not None:
            run.load(ck)
    else:
        if recipe is None:
            raise KitchenError("give a recipe, or --resume runs/<name>")
        problems = recipe_problems(recipe) + file_problems(recipe)
        if problems:
            raise KitchenError(problems)
        folder = paths.RUNS / recipe.name
        if latest_checkpoint(folder) is not None:
            raise KitchenError(
                f"{folder} already holds a run; continue it with "
                f"`kitchen cook --resume {folder}` or choose another name"
            )
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        atomic_write_text(
            folder / "recipe.yaml",
            yaml.safe_dump(recipe.model_dump(mode="json", by_alias=True), sort_keys=False),
        )
        run = Run(recipe, folder, progress=progress)
    r = run.recipe
    if run.iteration < r.train.iterations:
        problems = run.preflight()
        if problems:
            raise KitchenError(problems)
    # a crash after the last checkpoint may have left rows of later iterations in the logs
    _truncate_log(run.folder / "samples.jsonl", run.iteration)
    _truncate_log(run.folder / "eval.jsonl", run.iteration, inclusive=run.iteration > 0)
    if r.eval_every and run.iteration == 0:  # the starting policy: where held-out curves begin
        run.evaluate()
    bar = tqdm(
        total=r.train.iterations,
        initial=run.iteration,
        desc=f"cook {r.name}",
        disable=not progress,
        unit="it",
    )
    while run.iteration < r.train.iterations:
        m = run.step()
        last = run.iteration == r.train.iterations
        if r.eval_every and (run.iteration % r.eval_every == 0 or last):
            m |= run.evaluate()
        run.write_metrics()
        stuck = untrained_problem(run)
        if stuck is not None:
            bar.close()
            raise KitchenError([stuck])
        if run.iteration % r.checkpoint_every == 0 or last or run.iteration in r.keep_checkpoints:
            run.save()
        if on_iteration:
            on_iteration(run, m)
        bar.update(1)
        bar.set_postfix(
            {
                k.split("/")[-1]: f"{m[k]:.3f}"
                for k in ("reward/global_mean", "reward/local_mean", "kl/mean", "policy/entropy")
                if k in m and isinstance(m[k], float) and math.isfinite(m[k])
            }
        )
        if m.get("alarm/entropy_collapse"):
            bar.write(
                f"iteration {m['iteration']}: policy entropy collapsed below "
                f"{r.train.entropy_alarm:.0%} of its start (see troubleshooting)"
            )
    bar.close()
    return run


def _truncate_log(path: Path, iteration: int, inclusive: bool = False) -> None:
    """Drop rows written after the checkpoint we resumed from."""
    if not path.exists():
        return
    keep = [
        row
        for row in read_jsonl(path)
        if row.get("iteration", 0) < iteration or (inclusive and row["iteration"] == iteration)
    ]
    atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in keep))


def file_problems(recipe: Recipe) -> list[Problem]:
    """The files a recipe names that are not there: the constitution, the policy's checkpoint
    and the GRM's (a hub name is checked when it loads)."""
    from kitchen.models import find_checkpoint

    out = []
    c = Path(_home(recipe.constitution))
    if not c.is_file():
        out.append(
            recipe.problem(
                ("constitution",),
                f"no such file: {recipe.constitution}; the shipped one is "
                "constitutions/concierge.yaml",
            )
        )
    else:
        out += form_clause_problems(recipe, c)
    models = [(("policy", "path"), recipe.policy.path)]
    if recipe.grm_reviews and not recipe.grm.adapter:
        models.append((("grm", "model"), recipe.grm.model))
    for loc, path in models:
        try:
            find_checkpoint(path)
        except KitchenError as e:
            out += [recipe.problem(loc, p.message) for p in e.problems]
    return out


def form_clause_problems(recipe: Recipe, constitution: Path) -> list[Problem]:
    """`advantage.overrides.form_clauses` (and each arm's) naming a clause the constitution lacks."""
    choices = {("advantage",): recipe.advantage} | {
        ("compare", arm): choice for arm, choice in recipe.compare.items()
    }
    wanted = {loc: choice.overrides.get("form_clauses") for loc, choice in choices.items()}
    wanted = {loc: ids for loc, ids in wanted.items() if isinstance(ids, list) and ids}
    if not wanted:  # (a value of the wrong type is reported where the recipe loads)
        return []
    try:
        known = set(load_constitution(constitution).clause_ids)
    except KitchenError:
        return []  # the constitution's own problems are reported where it loads
    return [
        recipe.problem(
            (*loc, "overrides", "form_clauses"),
            f"{c!r} is not a clause of {recipe.constitution}; it has {', '.join(sorted(known))}",
        )
        for loc, ids in wanted.items()
        for c in ids
        if c not in known
    ]


def cook_main(recipe_path: str | None, *, resume: str | None = None) -> int:
    """`kitchen cook RECIPE` / `kitchen cook --resume runs/<name>`: the recipe checked
    (`load_recipe`, `file_problems`), the run's pre-flight (`Run.preflight`), then the run; every
    problem is `PATH:LINE: field: what and how to fix` (exit 2)."""
    recipe = load_recipe(recipe_path) if recipe_path else None
    run = cook(recipe, resume=resume)
    last = run.metrics[-1] if run.metrics else {}
    print(
        f"{run.folder}: {run.iteration} iterations; "
        + ", ".join(
            f"{k} {show(last[k])}"
            for k in ("reward/global_mean", "judge/compliance", "eval/success", "eval/compliance")
            if k in last
        )
    )
    return 0
