"""Step samples: the one record every trainer fills, and the one path from it to advantages.

A step sample is one agent turn that can be trained on (docs/method.md#credit-assignment): the
state it was taken in, the action's tokens and their log-probs at collection, the turn's local
reward, its step return, its trajectory's global reward, and the keys that group it — the task
group (K rollouts of one task) and the trajectory it belongs to. `StepSamples` holds N of them as
columns whose names are the replay buffer's, so a quantity has one name from the loop to the
loss: the loop (`kitchen.train.step_samples`), the lab (`kitchen.lab`), TRL's trainer and verl's
estimator (`kitchen.integrations`) produce it, `ReplayBuffer.add` stores it, and the loss reads it.

`advantages_for(samples, config, buffer, step)` is the path from rewards to advantages that all
of them take (docs/method.md#replay-buffer, docs/method.md#mapo):

    preset without a buffer (grpo, rloo, gigpo, ...):  fresh samples → StepBatch → mapo.advantages
    preset with one (mapo):  fresh samples → buffer.add; every live record sharing a state key
                             with them (the "fetch by state") joins → StepBatch → mapo.advantages

and returns the samples the loss trains on with the advantage of each (`Scored`): every fresh
sample, in order, then — with `replay_in_gradient` — the history replayed into the gradient.

Departures:
1. Every fresh sample enters the batch and the gradient, including one the buffer drops as a
   duplicate of another (`buffer.dedup`): de-duplication decides what is *kept as history*, not
   what the current policy learns from. Dropping an on-policy repeat from the gradient would
   under-weight the actions the policy takes most often, and would make a buffer-backed preset
   differ from its peers in more than its advantage.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

import torch

from kitchen.mapo import AdvantageConfig, StepBatch, advantages, encode

if TYPE_CHECKING:
    from kitchen.buffer import ReplayBuffer

Tensor = torch.Tensor
Keys = Sequence[Hashable] | Tensor


def ragged(seqs: Sequence[Sequence[float]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-sample sequences → (flat [M], lengths [N]): the storage of tokens and log-probs."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    flat = torch.tensor([x for s in seqs for x in s], dtype=dtype)
    return flat, lengths


def _keys(k: Keys) -> list:
    return k.tolist() if isinstance(k, Tensor) else list(k)


def _cat_keys(parts: Sequence[Keys]) -> Keys:
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(list(parts))
    return list(itertools.chain.from_iterable(_keys(p) for p in parts))


def _codes(k: Keys) -> Tensor:
    """Group codes of a key column: int tensors as they are, other keys made dense."""
    return k.long() if isinstance(k, Tensor) else encode(list(k))


@dataclass
class StepSamples:
    """N step samples, one row per trainable agent turn, as columns (the buffer's names).

    Keys (`state`, `abstract`, `task_group`, `traj`) are any hashable values (strings from the
    world, ints from the lab) in a list, or an int64 tensor [N]. Action tokens and their
    log-probs are ragged: `tokens` and `logp` are flat [M] (every sample's, concatenated) and
    `tok_len` [N] says how many belong to each sample. Numbers are tensors [N]:

        local_reward  the turn's local reward (0 where `valid` is False)
        ret           its step return, `mapo.returns_for` over the whole trajectory
        global_reward the trajectory's outcome, the same on every turn of it
        valid         the turn carries a local signal (a clause applied and the reviewer spoke)
        version       the policy version (iteration) that produced it
        run           independent runs in one call (the lab's seeds), or None
        clauses       [N, C] the turn's verdict on each clause (+1 pass, −1 violate, NaN where
                      the clause does not apply), or None; `clause_weight` [C] their weights.
                      Only `local_signal: clauses` reads them (`mapo.clause_advantages`).
        form_reward   the share of `local_reward` the config's `form_clauses` gave, and
        form_key      [N] int code of the turn's verdicts on them, or None (both or neither):
                      what `mapo.form_judged` reads
        blocked       [N] bool: a candidate the axiom guard blocked (`TrainConfig.guard`),
                      trained on at its state with no global advantage; None: none is

    Lists are coerced: `turn` to int64, rewards to float32, `valid` to bool (default all True),
    an int `version` to one per sample, `abstract` None to the exact key.
    """

    state: Keys
    task_group: Keys
    traj: Keys
    turn: Tensor
    tokens: Tensor
    logp: Tensor
    tok_len: Tensor
    local_reward: Tensor
    ret: Tensor
    global_reward: Tensor
    abstract: Keys | None = None
    valid: Tensor | None = None
    version: Tensor | int = 0
    run: Tensor | None = None
    clauses: Tensor | None = None
    clause_weight: Tensor | None = None
    form_reward: Tensor | None = None
    form_key: Tensor | None = None
    blocked: Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.state)
        self.turn = torch.as_tensor(self.turn, dtype=torch.long).reshape(-1)
        for name in ("local_reward", "ret", "global_reward"):
            setattr(
                self, name, torch.as_tensor(getattr(self, name), dtype=torch.float32).reshape(-1)
            )
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.logp = torch.as_tensor(self.logp, dtype=torch.float32).reshape(-1)
        self.tok_len = torch.as_tensor(self.tok_len, dtype=torch.long).reshape(-1)
        if self.abstract is None:
            self.abstract = self.state
        self.valid = (
            torch.ones(n, dtype=torch.bool)
            if self.valid is None
            else torch.as_tensor(self.valid, dtype=torch.bool).reshape(-1)
        )
        self.version = torch.as_tensor(self.version, dtype=torch.long).expand(n).clone()
        if self.run is not None:
            self.run = torch.as_tensor(self.run, dtype=torch.long).expand(n).clone()
        for name in ("task_group", "traj", "abstract", "turn", "local_reward", "ret"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} samples")
        if len(self.global_reward) != n or len(self.valid) != n or len(self.tok_len) != n:
            raise ValueError(f"global_reward, valid and tok_len need {n} entries each")
        if (self.clauses is None) != (self.clause_weight is None):
            raise ValueError("clauses and clause_weight come together: give both or neither")
        if self.clauses is not None:
            self.clause_weight = torch.as_tensor(self.clause_weight, dtype=torch.float32)
            self.clauses = torch.as_tensor(self.clauses, dtype=torch.float32)
            width = self.clause_weight.numel()
            if self.clause_weight.dim() != 1 or self.clauses.numel() != n * width:
                raise ValueError(
                    f"clauses must be [{n} samples, {width} clauses] beside clause_weight "
                    f"{tuple(self.clause_weight.shape)}; got {tuple(self.clauses.shape)}"
                )
            self.clauses = self.clauses.reshape(n, width)
        if (self.form_reward is None) != (self.form_key is None):
            raise ValueError("form_reward and form_key come together: give both or neither")
        if self.form_reward is not None:
            self.form_reward = torch.as_tensor(self.form_reward, dtype=torch.float32).reshape(-1)
            self.form_key = torch.as_tensor(self.form_key, dtype=torch.long).reshape(-1)
            if len(self.form_reward) != n or len(self.form_key) != n:
                raise ValueError(f"form_reward and form_key need {n} entries each")
        if self.blocked is not None:
            self.blocked = torch.as_tensor(self.blocked, dtype=torch.bool).reshape(-1)
            if len(self.blocked) != n:
                raise ValueError(f"blocked has {len(self.blocked)} entries for {n} samples")
        m = int(self.tok_len.sum())
        if self.tokens.shape[0] != m or self.logp.shape[0] != m:
            raise ValueError(
                f"tokens ({self.tokens.shape[0]}) and logp ({self.logp.shape[0]}) must hold "
                f"sum(tok_len) = {m} entries"
            )

    def __len__(self) -> int:
        return len(self.state)

    @classmethod
    def concat(cls, parts: Sequence[StepSamples]) -> StepSamples:
        """One record of several, in order (e.g. every process's samples, gathered)."""
        if len(parts) == 1:
            return parts[0]
        out = {}
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if f.name in ("state", "abstract", "task_group", "traj"):
                out[f.name] = _cat_keys(vals)
            elif f.name in ("run", "clauses", "form_reward", "form_key"):
                out[f.name] = None if any(v is None for v in vals) else torch.cat(vals)
            elif f.name == "blocked":  # a part without any blocked sample has none
                out[f.name] = (
                    None
                    if all(v is None for v in vals)
                    else torch.cat([p.blocked_mask() for p in parts])
                )
            elif f.name == "clause_weight":
                same = all(v is not None and torch.equal(v, vals[0]) for v in vals)
                if vals[0] is not None and not same:
                    raise ValueError("samples to concatenate weigh their clauses differently")
                out[f.name] = vals[0] if same and out["clauses"] is not None else None
            else:
                out[f.name] = torch.cat(vals)
        return cls(**out)

    def blocked_mask(self) -> Tensor:
        """[N] bool: the samples the axiom guard blocked (all False when `blocked` is None)."""
        return torch.zeros(len(self), dtype=torch.bool) if self.blocked is None else self.blocked

    def actions(self, what: Literal["tokens", "logp"] = "tokens") -> list[list]:
        """Each sample's action tokens (or their log-probs at collection) as a list."""
        flat = self.tokens if what == "tokens" else self.logp
        return [x.tolist() for x in torch.split(flat, self.tok_len.tolist())]

    def padded(self, what: Literal["tokens", "logp"] = "tokens") -> tuple[Tensor, Tensor]:
        """Action tokens (or log-probs) right-padded: ([N, T] values, [N, T] mask)."""
        flat = self.tokens if what == "tokens" else self.logp
        width = int(self.tok_len.max()) if len(self) else 0
        mask = torch.arange(width)[None, :] < self.tok_len[:, None]  # [N, T]
        out = torch.zeros(mask.shape, dtype=flat.dtype)
        out[mask] = flat
        return out, mask

    def batch(self, by: Literal["exact", "abstract"] = "exact") -> StepBatch:
        """The `mapo.StepBatch` of these samples alone (no history), states keyed `by`."""
        return StepBatch(
            local_reward=self.local_reward,
            global_reward=self.global_reward,
            ret=self.ret,
            state=_codes(self.state if by == "exact" else self.abstract),
            task_group=_codes(self.task_group),
            traj=_codes(self.traj),
            turn=self.turn,
            run=self.run,
            valid=self.valid,
            clauses=self.clauses,
            clause_weight=self.clause_weight,
            form_reward=self.form_reward,
            form_key=self.form_key,
            blocked=self.blocked,
        )


@dataclass
class Scored:
    """What an update trains on: step samples and the advantage of each ([G] rows).

    The first `n_fresh` rows are the fresh samples, in the order they were given; any further
    rows are buffer history replayed into the gradient (`replay_in_gradient`)."""

    samples: StepSamples
    adv: Tensor  # [G]
    fresh: Tensor  # [G] bool
    metrics: dict[str, float]

    @property
    def n_fresh(self) -> int:
        return int(self.fresh.sum())


def advantages_for(
    samples: StepSamples,
    config: AdvantageConfig,
    buffer: ReplayBuffer | None = None,
    step: int = 0,
) -> Scored:
    """Step samples → the advantage of each, under `config` at policy update `step`.

    Without a buffer, or for a preset that does not use one (`config.use_buffer` False), the
    samples are the whole batch. Otherwise they are stored in `buffer` first, and every other live
    record whose state key (`config.state_key`) equals one of theirs joins the group statistics
    — with `replay_in_gradient`, the whole task groups of those records too, and the gradient.
    Returns `Scored`: the fresh samples first (all of them, see departure 1), then any replayed
    history; `metrics` are `mapo.advantages`' (α's schedule counts `step`).
    """
    n = len(samples)
    if buffer is None or not config.use_buffer:
        adv, metrics = advantages(samples.batch(config.state_key), config, step=step)
        return Scored(samples, adv, torch.ones(n, dtype=torch.bool), metrics)
    kept = buffer.add(samples)
    history = buffer.history(
        samples, by=config.state_key, exclude=kept, whole_task_groups=config.replay_in_gradient
    )
    batch = buffer.batch(samples, history, by=config.state_key)  # fresh rows first
    adv, metrics = advantages(batch, config, step=step)
    if not config.replay_in_gradient:
        return Scored(samples, adv[:n], torch.ones(n, dtype=torch.bool), metrics)
    replayed = StepSamples.concat([samples, buffer.samples(history)])
    return Scored(replayed, adv, batch.fresh, metrics)
