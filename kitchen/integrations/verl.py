"""The kit's reward and MAPO advantage inside verl (Ray): an estimator, a reward manager, an agent
loop and a small trainer subclass, all through verl 0.9's registries.

docs/method.md#scaling. verl 0.9.1 (read from `verl/trainer/ppo/core_algos.py`, `ray_trainer.py`,
`trainer/ppo/v1/trainer_base.py`, `experimental/agent_loop/`, `experimental/reward_loop/`) trains
on one row per episode — a prompt, a response of every assistant turn with the environment's
replies in between, and `response_mask` = 1 on the policy's tokens — and offers four registries:

| piece                        | registered with                                  | name                |
|------------------------------|--------------------------------------------------|---------------------|
| `MAPOEstimator`              | `core_algos.register_adv_est`                    | `mapo`              |
| `KitchenRewardManager`       | `reward_loop.reward_manager.register`            | `kitchen_grm`       |
| `ConciergeAgentLoop`         | `agent_loop.register`                            | `kitchen_concierge` |
| `KitchenSyncTrainer`         | `trainer.ppo.v1.trainer_base.register_trainer`   | `kitchen_sync`      |

What MAPO needs and what verl's estimator interface shows it: a registered estimator is called
with `token_level_rewards` [B, L], `response_mask` [B, L], `index` (the uid: the task group) and
the `algorithm` config — nothing else (only verl's own GDPO gets the non-tensor batch). So:

1. **Turns** are the runs of 1s in `response_mask` (every action is followed by at least one
   environment token, so consecutive turns never touch).
2. **Per-turn rewards** travel in `token_level_rewards` (the *turn-reward layout*, `layout`):
   turn t owns its tokens and the environment tokens after it, and its local reward r_t sits on
   its last token; the episode's outcome R owns everything after the last action — the world's
   last reply, which `ConciergeAgentLoop` always appends — and sits on the last response token,
   where verl's reward managers put a score. Reading sums each region, so a reward placed
   anywhere in a turn's region counts for that turn.
3. **State keys and validity** (which turns carry a local signal) cannot be carried by a tensor
   of rewards. `KitchenSyncTrainer`, a ~20-line subclass of verl's sync trainer, reads them —
   and the turn rewards, which verl's reward loop can only return as one float per episode —
   from the reward manager's `reward_extra_info` just before verl's advantage step, writes the
   turn rewards into the layout and hands the keys to the estimator (a context variable: the
   same process, the same call).
4. **The advantage** is the kit's own path: the estimator turns the layout into
   `kitchen.steps.StepSamples` and calls `kitchen.steps.advantages_for`, as `kitchen cook` and
   the TRL trainer do. What must outlive one call — the number of calls (the α schedule's step)
   and the replay buffer — lives in the registered `MAPOEstimator` instance, one per process.

The limits, in the order a user meets them:
- With verl's stock trainers (`trainer.v1.trainer_mode=sync`), the reward loop returns one
  float per episode, so only R reaches the estimator: the local advantage is 0 and MAPO reduces
  to its global term, (1 − α)·A_global. Use `trainer.v1.trainer_mode=kitchen_sync`.
- Without state keys (any layout produced elsewhere, e.g. the MAPO paper's turn rewards), state
  groups fall back to *turn groups* (same uid, same turn index) and every turn counts as having
  a signal; the replay buffer's history is used only with state keys (uids never recur).
- `algorithm.use_kl_in_reward` adds −β·KL to every token and so to each turn's sum; keep the KL
  in the loss (`actor.use_kl_loss=True, kl_loss_type=low_var_kl`), as MAPO does. The loss, and
  so β, is verl's (`actor.kl_loss_coef`, fixed): `advantage.beta`, `kl_target` and `clip` are
  not read (verl clips the ratio at its own `actor.clip_ratio`, 0.2 by default),
  and verl clamps its k3 on both sides, where `mapo.kl_penalty` keeps the drifted side's gradient.
  verl's `kl_loss_type=mse` is `advantage.kl: k2` (the reverse KL's gradient, `mapo.kl_penalty`).
- The review runs in verl's reward-loop workers (CPU actors): the rule judge, or a GRM checkpoint
  small enough to load there (the tiny GRM). A large GRM served by verl's reward-model router
  is not wired in (the prompt and parser in `kitchen.grm` are the pieces to reuse).
- Truncated turns are masked out of the agent loop's rows (the loop runs without the recipe),
  so `reward.truncated = "worst"` does not reach verl: a turn that runs out of its budget is
  left out of the update there, as with "drop".
- The α schedule counts estimator calls (one per training step) in the trainer process; the
  action's tokens stand in as a hash for the buffer's de-duplication (the estimator sees no
  token ids).

Installing: `pip install 'kitchen[verl]'` gives verl's core; a GPU run needs verl's rollout
stack too (`pip install 'verl[vllm]==0.9.1'`: vLLM, TransferQueue). verl loads the kit through
its plugin entry point (`verl.plugins` → `kitchen.integrations.verl`) in every Ray process, or
through `VERL_USE_EXTERNAL_MODULES=kitchen.integrations.verl`. `kitchen.integrations.launch`
writes the launch files (`recipes/scale/verl/`).
"""

from __future__ import annotations

import contextvars
import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import torch
from pydantic import Field, model_validator

from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.config import KitchenError, StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.grm import GRM, GRMConfig
from kitchen.integrations.episodes import Job, episode_tokens, first_messages, job_pool
from kitchen.judge import judge
from kitchen.mapo import pad_steps, returns_for
from kitchen.review import clause_pass_rates
from kitchen.rollout import render_prompt
from kitchen.steps import StepSamples, advantages_for
from kitchen.train import AdvantageChoice, RewardConfig, episode_rewards, load_recipe, trainable
from kitchen.world import Task, Trajectory, World, load_menu

Tensor = torch.Tensor

ESTIMATOR = "mapo"
REWARD_MANAGER = "kitchen_grm"
AGENT_LOOP = "kitchen_concierge"
TRAINER = "kitchen_sync"
TESTED_VERL = ("0.9.1",)


class VerlSettings(StrictModel):
    """`algorithm.kitchen` in a verl config: the advantage preset and the buffer."""

    advantage: AdvantageChoice = Field(
        default_factory=AdvantageChoice, description="A kitchen preset and its overrides."
    )
    buffer: BufferConfig = Field(
        default_factory=lambda: BufferConfig(max_age=8, dedup=True),
        description="The replay buffer (used with state keys).",
    )

    @model_validator(mode="after")
    def _check(self) -> VerlSettings:
        cfg = self.advantage.resolve()
        if cfg.local_signal == "clauses":
            raise ValueError(
                "advantage local_signal 'clauses' needs each turn's per-clause verdicts, which "
                "verl's batch does not carry (one reward per turn); use 'return' or 'reward' "
                "with verl, or train with kitchen's loop or TRL"
            )
        if cfg.form_clauses:
            raise ValueError(
                "advantage form_clauses needs each turn's per-clause verdicts, which verl's "
                "batch does not carry (one reward per turn); leave it out with verl, or train "
                "with kitchen's loop or TRL"
            )
        return self


def settings_from(config: Any) -> VerlSettings:
    """`algorithm.kitchen` of a verl config (an OmegaConf node, a dataclass or a dict)."""
    node = None
    if config is not None:
        node = config.get("kitchen") if hasattr(config, "get") else getattr(config, "kitchen", None)
    if node is None:
        return VerlSettings()
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            node = OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - verl brings omegaconf
        pass
    return VerlSettings.model_validate(node)


# --------------------------------------------------------------------------------------------
# The turn-reward layout


def turn_spans(response_mask: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) runs of 1s in `response_mask` [B, L]: one per assistant turn."""
    m = response_mask.bool().to(torch.int8).cpu()
    edge = torch.diff(torch.nn.functional.pad(m, (1, 1)), dim=1)  # [B, L+1]: +1 start, −1 end
    out = []
    for row in edge:
        starts = (row == 1).nonzero().squeeze(1).tolist()
        ends = (row == -1).nonzero().squeeze(1).tolist()
        out.append(list(zip(starts, ends, strict=True)))
    return out


def layout(
    turn_rewards_: Sequence[Sequence[float]],
    outcome: Sequence[float],
    response_mask: Tensor,
    last: Sequence[int] | None = None,
) -> Tensor:
    """Token-level rewards [B, L] in the turn-reward layout: r_t on the last token of turn t,
    R on the last response token (`last[b]`, default the last position). A row with fewer
    rewards than turns leaves the extra turns at 0; the last token must lie after every turn."""
    spans = turn_spans(response_mask)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for b, (row, rs) in enumerate(zip(spans, turn_rewards_, strict=True)):
        for (_, e), r in zip(row, rs, strict=False):
            out[b, e - 1] = float(r)
        end = response_mask.shape[1] - 1 if last is None else int(last[b])
        if row and end < row[-1][1]:
            raise KitchenError(
                f"row {b}: the last response token is inside an action; the "
                "response must end with environment tokens (the world's reply)"
            )
        out[b, end] += float(outcome[b])
    return out.to(response_mask.device)


def read_layout(
    token_level_rewards: Tensor, response_mask: Tensor
) -> tuple[list[list[tuple[int, int]]], list[list[float]], list[float]]:
    """(spans, per-turn rewards, outcome) of each row: turn t's reward is the sum over its tokens
    and the environment tokens up to the next turn; the outcome is the sum after the last turn."""
    spans = turn_spans(response_mask)
    r = token_level_rewards.detach().float().cpu()
    local, outcome = [], []
    for b, row in enumerate(spans):
        bounds = [s for s, _ in row[1:]] + [row[-1][1] if row else 0]
        local.append([r[b, s:nxt].sum().item() for (s, _), nxt in zip(row, bounds, strict=True)])
        outcome.append(r[b, bounds[-1] :].sum().item() if row else r[b].sum().item())
    return spans, local, outcome


# --------------------------------------------------------------------------------------------
# The estimator

# `KitchenSyncTrainer` hands the per-row fields to the estimator it is about to call through
# verl; set and reset around that one call.
_FIELDS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "kitchen_verl_fields", default=None
)


def _key(table: Any, b: int, t: int) -> Any:
    row = table[b]
    if isinstance(row, str):
        row = json.loads(row)
    return row[t]


def layout_samples(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    uids: Sequence[str],
    cfg: Any,
    fields: dict[str, Any],
    version: int,
) -> tuple[StepSamples, list[tuple[int, int]]]:
    """The step samples of verl's batch, one per turn span, and each one's (row, span).

    `fields` are the optional per-row lists `KitchenSyncTrainer` hands over:
    `kitchen_state_keys`, `kitchen_abstract_keys`, `kitchen_valid`, `kitchen_turn_index`,
    `kitchen_action_hash`. Without state keys a turn's state is (uid, span index): turn groups.
    Returns are `returns_for(cfg)` over each row's spans (the turns verl trains on)."""
    spans, local, outcome = read_layout(token_level_rewards, response_mask)
    keys, abstract = fields.get("kitchen_state_keys"), fields.get("kitchen_abstract_keys")
    valid, turn_index = fields.get("kitchen_valid"), fields.get("kitchen_turn_index")
    hashes = fields.get("kitchen_action_hash")
    where, cols = [], {k: [] for k in ("state", "abstract", "valid", "local", "turn", "hash")}
    for b, row in enumerate(spans):
        for t in range(len(row)):
            ok = bool(_key(valid, b, t)) if valid is not None else True
            state = _key(keys, b, t) if keys is not None else f"{uids[b]}|t{t}"
            where.append((b, t))
            cols["state"].append(state)
            cols["abstract"].append(_key(abstract, b, t) if abstract is not None else state)
            cols["valid"].append(ok)
            cols["local"].append(local[b][t] if ok else 0.0)
            cols["turn"].append(int(_key(turn_index, b, t)) if turn_index is not None else t)
            cols["hash"].append(int(_key(hashes, b, t)) if hashes is not None else b * 1009 + t)
    rows = torch.tensor([b for b, _ in where], dtype=torch.long)
    lr = torch.tensor(cols["local"], dtype=torch.float32)
    ret = torch.zeros(len(where))
    if where:
        turn = torch.tensor(cols["turn"])
        padded, mask, r_idx, c_idx = pad_steps(lr, rows, turn)  # [n_rows, T]
        by_row = torch.tensor(outcome, dtype=torch.float32)
        ret = returns_for(cfg, padded, by_row[torch.unique(rows)], mask)[r_idx, c_idx]
    n = len(where)
    samples = StepSamples(
        state=cols["state"],
        abstract=cols["abstract"],
        task_group=[uids[b] for b, _ in where],
        traj=[f"{version}:{b}" for b, _ in where],
        turn=cols["turn"],
        tokens=cols["hash"],  # the action's hash stands in for its tokens (de-duplication)
        logp=[0.0] * n,
        tok_len=[1] * n,
        local_reward=lr,
        ret=ret,
        global_reward=[outcome[b] for b, _ in where],
        valid=cols["valid"],
        version=version,
    )
    return samples, where


class MAPOEstimator:
    """verl advantage estimator `mapo`: kitchen's advantage on verl's batch.

    Called as verl calls a registered estimator: `token_level_rewards`, `response_mask` [B, L]
    in the turn-reward layout (module docstring), `index` [B] uids (task groups), `config`
    verl's `algorithm` config, whose `kitchen` node is a `VerlSettings` (default: the `mapo`
    preset). Per-row fields come from `non_tensor_batch` or from `KitchenSyncTrainer`
    (`layout_samples`). Returns (advantages, returns), both [B, L]: each turn's advantage on
    its tokens, 0 elsewhere.

    The instance keeps what spans calls: `calls`, the α schedule's step, and one replay buffer
    per settings, used when state keys are given (uids never recur, so turn groups have no
    history). `register()` registers one instance per process.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.buffers: dict[str, ReplayBuffer] = {}

    def __call__(
        self,
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index: Any = None,
        config: Any = None,
        non_tensor_batch: dict[str, Any] | None = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor]:
        s = settings_from(config)
        cfg = s.advantage.resolve()
        fields = non_tensor_batch if non_tensor_batch is not None else (_FIELDS.get() or {})
        n_rows = token_level_rewards.shape[0]
        uids = [str(u) for u in (index if index is not None else range(n_rows))]
        call = self.calls
        samples, where = layout_samples(
            token_level_rewards, response_mask, uids, cfg, fields, version=call
        )
        buffer = None
        if fields.get("kitchen_state_keys") is not None:
            buffer = self.buffers.setdefault(s.model_dump_json(), ReplayBuffer(s.buffer))
        adv_tok = torch.zeros(token_level_rewards.shape, dtype=torch.float32)
        if where:
            scored = advantages_for(samples, cfg, buffer, step=call)
            spans = turn_spans(response_mask)
            for (b, t), a in zip(where, scored.adv[: len(where)].tolist(), strict=True):
                start, end = spans[b][t]
                adv_tok[b, start:end] = a
        if buffer is not None:
            buffer.advance(call + 1)
        self.calls = call + 1
        adv_tok = adv_tok.to(token_level_rewards.device) * response_mask
        return adv_tok, adv_tok


# --------------------------------------------------------------------------------------------
# The reward manager


class TurnRewards(float):
    """The episode's outcome R, a float for verl, carrying the per-turn rewards along."""

    turns: list[float]
    valid: list[bool]


def _field(nt: dict[str, Any], name: str) -> Any:
    """A per-episode field from the agent loop: at the top of the non-tensor batch (batch reward
    path) or inside `tool_extra_fields` (the agent loop's own reward call)."""
    if name in nt:
        return nt[name][0]
    extra = nt.get("tool_extra_fields")
    if extra is not None and len(extra) and isinstance(extra[0], dict) and name in extra[0]:
        return extra[0][name]
    info = nt.get("extra_info")
    if info is not None and len(info) and isinstance(info[0], dict) and name in info[0]:
        return info[0][name]
    return None


def review_episode(
    traj: Trajectory, pc: PersonalConstitution, reviewer: Any, reward: RewardConfig
) -> tuple[TurnRewards, dict[str, Any]]:
    """Review one episode: (R with its turn rewards, reward_extra_info). Extra info values are
    scalars or JSON strings, since verl stacks each key over the batch into one array."""
    review = judge(traj, pc) if reviewer is None else reviewer.review([traj], [pc])[0]
    reward = reward.model_copy(update={"truncated": "drop"})  # the rows mask them (docstring)
    rewards = episode_rewards([traj], [review], [pc], reward)[0]
    r = TurnRewards(rewards.outcome)
    trained = trainable(traj)  # the turns the agent loop's row masks in (never truncated ones)
    r.turns = [rewards.local[ti.turn] for ti in trained]
    r.valid = [bool(rewards.valid[ti.turn]) for ti in trained]
    extra = {
        "kitchen_turn_rewards": json.dumps(r.turns),
        "kitchen_valid": json.dumps(r.valid),
        "kitchen_turn_index": json.dumps([ti.turn for ti in trained]),
        "kitchen_state_keys": json.dumps([ti.exact_key for ti in trained]),
        "kitchen_abstract_keys": json.dumps([ti.abstract_key for ti in trained]),
        "kitchen_action_hash": json.dumps([_action_hash(ti.tokens) for ti in trained]),
        "kitchen_clause_pass": json.dumps(clause_pass_rates([review])),
        "kitchen/overall_pass": float(review.overall == "pass"),
        "kitchen/success": float(traj.outcome.success if traj.outcome else 0),
        "score": float(r),
    }
    return r, extra


def _action_hash(tokens: Sequence[int]) -> int:
    """A 31-bit hash of an action's token ids: what the buffer's de-duplication compares."""
    return zlib.crc32(json.dumps(list(tokens)).encode()) & 0x7FFFFFFF


def job_to_json(job: Job, seed: int = 0) -> str:
    """A job as the JSON string a verl dataset row carries in `extra_info.kitchen_job`."""
    task, pc, diner = job
    return json.dumps(
        {
            "task": task.model_dump(mode="json"),
            "pc": pc.model_dump(mode="json"),
            "diner": diner,
            "seed": seed,
        }
    )


def job_from_json(text: str) -> tuple[Job, int]:
    d = json.loads(text)
    return (
        Task.model_validate(d["task"]),
        PersonalConstitution.model_validate(d["pc"]),
        d["diner"],
    ), int(d.get("seed", 0))


def verl_rows(jobs: Sequence[Job], *, max_turns: int, seed: int = 0) -> list[dict[str, Any]]:
    """Dataset rows for verl's `RLHFDataset` (write them to parquet): `prompt` (chat messages),
    `agent_name`, `data_source`, `reward_model` and `extra_info.kitchen_job`."""
    return [
        {
            "prompt": first_messages(j),
            "agent_name": AGENT_LOOP,
            "data_source": "kitchen/concierge",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {
                "index": i,
                "kitchen_job": job_to_json(j, seed + i),
                "max_turns": max_turns,
            },
        }
        for i, j in enumerate(jobs)
    ]


def _reviewer_from(config: Any) -> tuple[Any, RewardConfig]:
    """The config's top-level `kitchen:` node → (reviewer, RewardConfig): `kitchen.reward` is a
    kitchen `RewardConfig` (reviewer 'judge' or 'grm'), `kitchen.grm` a `GRMConfig` (the GRM
    checkpoint, loaded once per reward worker)."""
    node = config.get("kitchen") if hasattr(config, "get") else None
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            node = OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - verl brings omegaconf
        pass
    node = node or {}
    reward = RewardConfig.model_validate(node.get("reward", {"reviewer": "judge"}))
    if reward.reviewer == "judge":
        return None, reward
    return GRM.load(GRMConfig.model_validate(node.get("grm", {}))), reward


# --------------------------------------------------------------------------------------------
# Registration (verl is optional: everything below needs it)


def register() -> list[str]:
    """Register the estimator, reward manager, agent loop and trainer with verl (idempotent).

    Returns the names registered; pieces whose verl module cannot be imported (the agent loop
    and trainer need verl's rollout extras) are skipped. Called on import when verl is present.
    """
    done = []
    from verl.trainer.ppo import core_algos

    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR) is None:
        core_algos.register_adv_est(ESTIMATOR)(MAPOEstimator())
    done.append(ESTIMATOR)
    if _register_reward_manager():
        done.append(REWARD_MANAGER)
    if _register_agent_loop():
        done.append(AGENT_LOOP)
    if _register_trainer():
        done.append(TRAINER)
    return done


def _register_reward_manager() -> bool:
    from verl.experimental.reward_loop.reward_manager import registry
    from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

    if REWARD_MANAGER in registry.REWARD_MANAGER:
        return True

    class KitchenRewardManager(RewardManagerBase):
        """verl reward manager `kitchen_grm`: reviews each concierge episode (rule judge or a
        GRM checkpoint) and returns R, with the turn rewards, state keys and clause pass rates
        in `reward_extra_info` (JSON strings) for `KitchenSyncTrainer` and the logs."""

        def __init__(
            self,
            config,
            tokenizer,
            compute_score=None,
            reward_router_address=None,
            reward_model_tokenizer=None,
        ):
            super().__init__(config, tokenizer, compute_score)
            self.reviewer, self.reward = _reviewer_from(config)

        async def run_single(self, data) -> dict:
            nt = data[-1:].non_tensor_batch
            traj, pc = _field(nt, "kitchen_trajectory"), _field(nt, "kitchen_constitution")
            if traj is None or pc is None:
                raise KitchenError(
                    "kitchen_grm needs the episodes of the kitchen_concierge agent "
                    "loop (extra fields kitchen_trajectory, kitchen_constitution)"
                )
            traj = Trajectory.model_validate_json(traj) if isinstance(traj, str) else traj
            pc = PersonalConstitution.model_validate_json(pc) if isinstance(pc, str) else pc
            score, extra = await self.loop.run_in_executor(
                None, lambda: review_episode(traj, pc, self.reviewer, self.reward)
            )
            return {"reward_score": score, "reward_extra_info": extra}

    KitchenRewardManager.__qualname__ = KitchenRewardManager.__name__
    registry.register(REWARD_MANAGER)(KitchenRewardManager)
    globals()["KitchenRewardManager"] = KitchenRewardManager
    return True


def _register_agent_loop() -> bool:
    try:
        from verl.experimental.agent_loop import agent_loop as al
    except ImportError:
        return False
    if AGENT_LOOP in al._agent_loop_registry:
        return True

    class ConciergeAgentLoop(al.AgentLoopBase):
        """verl agent loop `kitchen_concierge`: plays one concierge episode turn by turn through
        verl's LLM server (token in, token out), then returns it as one row with the world's
        last reply as the tail (`episodes.episode_tokens(tail=True)`)."""

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
            info = kwargs.get("extra_info") or {}
            job, seed = job_from_json(info["kitchen_job"])
            task, pc, diner = job
            max_turns = int(
                info.get("max_turns")
                or self.rollout_config.multi_turn.get("max_assistant_turns")
                or 10
            )
            tok = self.tokenizer
            world = World(load_menu(), max_turns=max_turns)
            world.reset(
                task,
                pc.dimensions,
                profile=pc.profile,
                personal_version=pc.version,
                seed=seed,
                diner=diner,
                episode=uuid4().hex,
            )
            limit = int(self.rollout_config.response_length)
            while not world.traj.done:
                ids = tok(render_prompt(tok, world.traj.messages), add_special_tokens=False)[
                    "input_ids"
                ]
                out = await self.server_manager.generate(
                    request_id=uuid4().hex, prompt_ids=ids, sampling_params=sampling_params
                )
                new = list(out.token_ids)
                closed = bool(new) and new[-1] == tok.eos_token_id
                text = tok.decode(new, skip_special_tokens=True)
                lps = list(out.log_probs) if out.log_probs else [0.0] * len(new)
                world.step(text, tokens=new, logprobs=lps, truncated=not closed)
            row = episode_tokens(tok, world.traj, tail=True)
            resp, mask, lps = row.completion_ids, row.mask, row.logprobs
            if len(resp) > limit:  # keep the row in budget; its last token stays non-policy
                resp, mask, lps = resp[:limit], mask[: limit - 1] + [0], lps[:limit]
            return al.AgentLoopOutput(
                prompt_ids=row.prompt_ids,
                response_ids=resp,
                response_mask=mask,
                response_logprobs=lps,
                num_turns=len(world.traj.messages) - 1,
                metrics=al.AgentLoopMetrics(),
                extra_fields={
                    "kitchen_trajectory": world.traj.model_dump_json(),
                    "kitchen_constitution": pc.model_dump_json(),
                    "turn_scores": [],
                    "tool_rewards": [],
                },
            )

    ConciergeAgentLoop.__qualname__ = ConciergeAgentLoop.__name__  # hydra finds it by this name
    al.register(AGENT_LOOP)(ConciergeAgentLoop)
    globals()["ConciergeAgentLoop"] = ConciergeAgentLoop
    return True


def relayout(
    rm_scores: Tensor, response_mask: Tensor, extra_fields: Sequence[Any]
) -> tuple[Tensor, dict[str, list]]:
    """`KitchenSyncTrainer`'s step: the turn rewards of each row's `reward_extra_info` written
    into verl's `rm_scores` [B, L] (R stays where verl put it), and the per-row fields for the
    estimator. Rows without kitchen fields are left as they are."""
    out = rm_scores.clone()
    fields: dict[str, list] = {
        "kitchen_state_keys": [],
        "kitchen_abstract_keys": [],
        "kitchen_valid": [],
        "kitchen_turn_index": [],
        "kitchen_action_hash": [],
    }
    spans = turn_spans(response_mask)
    for b, extra in enumerate(extra_fields):
        info = (extra or {}).get("reward_extra_info", {}) if isinstance(extra, dict) else {}
        turns = json.loads(info.get("kitchen_turn_rewards", "[]"))
        for (_, e), r in zip(spans[b], turns, strict=False):
            out[b, e - 1] += r
        n = len(spans[b])
        fields["kitchen_state_keys"].append(
            json.loads(info["kitchen_state_keys"])[:n]
            if "kitchen_state_keys" in info
            else [f"row{b}|t{t}" for t in range(n)]
        )
        fields["kitchen_abstract_keys"].append(
            json.loads(info["kitchen_abstract_keys"])[:n]
            if "kitchen_abstract_keys" in info
            else fields["kitchen_state_keys"][-1]
        )
        fields["kitchen_valid"].append(
            json.loads(info["kitchen_valid"])[:n] if "kitchen_valid" in info else [True] * n
        )
        fields["kitchen_turn_index"].append(
            json.loads(info["kitchen_turn_index"])[:n]
            if "kitchen_turn_index" in info
            else list(range(n))
        )
        fields["kitchen_action_hash"].append(
            json.loads(info["kitchen_action_hash"])[:n]
            if "kitchen_action_hash" in info
            else [b * 1009 + t for t in range(n)]
        )
    return out, fields


def _register_trainer() -> bool:
    try:
        from verl.trainer.ppo.v1 import trainer_base
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    except ImportError:
        return False
    if TRAINER in trainer_base.TRAINER_REGISTRY:
        return True

    class KitchenSyncTrainer(PPOTrainerSync):
        """verl's sync trainer plus one step before the advantage: the reward manager's turn
        rewards go into `rm_scores` at turn boundaries, and the state keys and validity go to
        the `mapo` estimator (module docstring, point 3)."""

        def _compute_advantage(self, batch, metrics):
            import transfer_queue as tq
            from verl.workers.utils.padding import response_to_nested

            data = tq.kv_batch_get(
                keys=batch.keys,
                partition_id=batch.partition_id,
                select_fields=["response_mask", "rm_scores", "extra_fields"],
            )
            nested_mask = data["response_mask"]
            mask = nested_mask.to_padded_tensor(0)
            scores = data["rm_scores"].to_padded_tensor(0.0)
            new, fields = relayout(scores, mask, list(data["extra_fields"]))
            tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields={"rm_scores": response_to_nested(new, nested_mask)},
            )
            token = _FIELDS.set(fields)
            try:
                return super()._compute_advantage(batch, metrics)
            finally:
                _FIELDS.reset(token)

    KitchenSyncTrainer.__qualname__ = KitchenSyncTrainer.__name__
    trainer_base.register_trainer(TRAINER)(KitchenSyncTrainer)
    globals()["KitchenSyncTrainer"] = KitchenSyncTrainer
    return True


def available() -> bool:
    """Whether verl can be imported here."""
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except ImportError:
        return False
    return True


def write_data(recipe_path: str, out: str, *, val_share: float = 0.1) -> list[str]:
    """The task pool of a kitchen recipe as verl parquet files `train.parquet`, `val.parquet`."""
    import pandas as pd

    recipe = load_recipe(recipe_path)
    jobs = job_pool(recipe.constitution, recipe.train.task_pool, recipe.seed)
    rows = verl_rows(jobs, max_turns=recipe.rollout.max_turns, seed=recipe.seed)
    n_val = max(1, int(len(rows) * val_share))
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, part in (("train", rows[n_val:]), ("val", rows[:n_val])):
        path = folder / f"{name}.parquet"
        pd.DataFrame(part).to_parquet(path)
        written.append(str(path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kitchen.integrations.verl data --recipe FILE --out DIR`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kitchen.integrations.verl")
    sub = parser.add_subparsers(dest="cmd", required=True)
    data = sub.add_parser("data", help="write a recipe's task pool as verl parquet files")
    data.add_argument("--recipe", required=True)
    data.add_argument("--out", default="data/verl")
    a = parser.parse_args(argv)
    for p in write_data(a.recipe, a.out):
        print(p)
    return 0


if os.environ.get("KITCHEN_VERL_NO_REGISTER") != "1" and available():
    register()

if __name__ == "__main__":
    import sys

    sys.exit(main())

__all__ = [
    "MAPOEstimator",
    "layout_samples",
    "layout",
    "read_layout",
    "register",
    "relayout",
    "review_episode",
    "turn_spans",
    "verl_rows",
    "VerlSettings",
]
