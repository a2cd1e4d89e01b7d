"""The replay buffer: step samples kept across policy updates, so state groups have members.

docs/method.md#replay-buffer: the carrier of step-level samples is an experience-replay pool. A
multi-turn trajectory is split into one record per agent turn (`kitchen.steps.StepSamples`); for
a state the agent is in now, the pool holds earlier actions taken in the same (or a similar)
state, and that comparison set is what MAPO's local advantage normalises against — the statistic
a critic would otherwise estimate. Against "samples consumed too fast" the method asks for
de-duplication (and priority sampling, departure 4); old samples go stale as the policy moves,
hence `max_age`.

A record holds the columns of `StepSamples`: state key (exact, and an optional coarser abstract
key), task-group id, trajectory id, turn index, action token ids and their log-probs at
collection, local reward, step return, global reward, validity and policy version, and — where
the samples carry them — the turn's verdict on each clause (a [C] row; the clause weights are
stored once) and its form share and form code (`mapo.form_judged`); plus its insertion order. `kitchen.steps.advantages_for` is the one place step samples enter a buffer.

How it stays fast at 10^6 records (benchmarks/bench_buffer.py measures it):
- Columns are preallocated torch tensors in CPU memory; action tokens and log-probs are stored
  flat with (start, length) offsets. Appending writes a slice; deletion flips an `alive` flag;
  dead rows are compacted away only when the preallocated space runs out (amortised O(1) per
  record). Capacity eviction scans forward from the oldest live row, not the whole store.
- Keys (strings from the world, ints from the lab) become dense int64 codes through a dict, once
  per inserted sample (O(batch) Python); every later operation is on the codes.
- History lookup for state groups is one boolean-table gather over the stored codes
  (O(records), vectorised: about 3 ms at 10^6).
No operation loops in Python over the stored records; keys of evicted records are forgotten in
one pass over the key dict once they outnumber live records two to one (amortised).

Departures from the method (docs/method.md#replay-buffer):
1. De-duplication keeps the newest copy of an identical (exact state key, action tokens) sample:
   the older one is evicted. Counting duplicates instead would need weighted group statistics.
   Tokens are compared through a 62-bit hash (two 31-bit polynomial hashes), so a false merge
   needs a hash collision (≈ 10^-7 at 10^6 records).
2. Row indices returned by `add` stay valid until the next `add` (compaction renumbers rows).
3. Rewards that are NaN or infinite are rejected at insertion with a `KitchenError` naming the
   trajectory and turn, so one bad verdict cannot silently poison every group it joins.
4. No sampling, and so no priority sampling. The loop never draws from the buffer: the history
   of a state group is *every* live record with that state key, so there is no draw whose
   priority could matter. Against samples consumed too fast, the buffer offers what acts on
   that lookup: de-duplication, `max_age` and capacity; and the advantage can replay history
   into the gradient with truncated importance weights (`replay_in_gradient`).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from pydantic import Field

from kitchen.config import KitchenError, Problem, StrictModel
from kitchen.mapo import StepBatch
from kitchen.steps import StepSamples

Tensor = torch.Tensor
StateKey = Literal["exact", "abstract"]

_P1, _P2 = 2_147_483_647, 2_147_483_629  # two primes below 2^31 for the token hash
_GEN = torch.Generator().manual_seed(20261104)
_MULT1 = torch.randint(1, _P1, (64,), generator=_GEN)
_MULT2 = torch.randint(1, _P2, (64,), generator=_GEN)

_COLUMNS: dict[str, torch.dtype] = {
    "state": torch.long,  # exact state key code
    "abstract": torch.long,  # abstract (coarser) state key code
    "task_group": torch.long,
    "traj": torch.long,
    "run": torch.long,  # independent run (e.g. seed) the sample belongs to
    "turn": torch.int32,
    "local_reward": torch.float32,
    "ret": torch.float32,
    "global_reward": torch.float32,
    "version": torch.long,  # policy version that produced the sample
    "order": torch.long,  # insertion order, unique and increasing
    "tok_start": torch.long,
    "tok_len": torch.int32,
    "tok_hash": torch.long,
    "valid": torch.bool,  # the sample carries a local signal (see mapo.StepBatch.valid)
    "blocked": torch.bool,  # a candidate the axiom guard blocked (see mapo.StepBatch.blocked)
    "alive": torch.bool,
}


class BufferConfig(StrictModel):
    """Size and freshness of the replay buffer."""

    capacity: int = Field(
        100_000,
        ge=1,
        description="Records kept; beyond it the oldest are evicted first. 10^5 step samples "
        "of a few hundred tokens fit in well under 1 GB (see memory_per_record).",
    )
    max_age: int | None = Field(
        None,
        ge=0,
        description="Evict samples more than this many policy versions old (old samples go "
        "stale: docs/method.md#replay-buffer). None keeps them until capacity evicts them. In "
        "notebook 04 a few versions work best.",
    )
    dedup: bool = Field(
        False,
        description="Keep only the newest of identical (exact state key, action tokens) samples "
        "as history (fresh samples always train: kitchen.steps, departure 1). Off by default: in "
        "small tabular worlds identical actions are the rule, and dropping them would bias the "
        "group statistics; turn it on for text, where a repeat is a re-insert.",
    )


class _Codes:
    """Dense int64 codes for hashable keys; dead codes are dropped when they outnumber live ones."""

    def __init__(self) -> None:
        self.index: dict[Hashable, int] = {}
        self.keys: list[Hashable] = []

    def encode(self, keys: Sequence[Hashable]) -> Tensor:
        index, known = self.index, self.keys
        out = []
        for k in keys:
            c = index.get(k)
            if c is None:
                c = index[k] = len(known)
                known.append(k)
            out.append(c)
        return torch.tensor(out, dtype=torch.long)

    def lookup(self, keys: Sequence[Hashable]) -> Tensor:
        """Codes of known keys, −1 for keys never seen (or forgotten); adds nothing."""
        index = self.index
        return torch.tensor([index.get(k, -1) for k in keys], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.keys)

    def prune(self, live: Tensor) -> Tensor:
        """Keep only codes in `live`; return old → new code map (−1 for dropped)."""
        used = torch.unique(live)
        remap = torch.full((len(self.keys),), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        self.keys = [self.keys[i] for i in used.tolist()]
        self.index = {k: i for i, k in enumerate(self.keys)}
        return remap


def _as_keys(x: Sequence[Hashable] | Tensor) -> list:
    return x.tolist() if isinstance(x, Tensor) else list(x)


def _at_sample(traj: Hashable, turn: int | Tensor, message: str) -> KitchenError:
    """A `buffer.add` error located at one sample (trajectory and turn)."""
    return KitchenError(
        [Problem("buffer.add", None, f"trajectory {traj!r} turn {int(turn)}", message)]
    )


def _token_hash(flat: Tensor, lengths: Tensor) -> Tensor:
    """62-bit hash of each sample's token sequence: two polynomial hashes mod primes < 2^31."""
    n = lengths.shape[0]
    seg = torch.repeat_interleave(torch.arange(n), lengths)
    pos = torch.arange(flat.shape[0]) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    tok = flat.long() + 1
    h1 = torch.zeros(n, dtype=torch.long).index_add_(0, seg, (tok % _P1) * _MULT1[pos % 64] % _P1)
    h2 = torch.zeros(n, dtype=torch.long).index_add_(0, seg, (tok % _P2) * _MULT2[pos % 64] % _P2)
    # each term is < 2^31, so sums stay far below 2^63 for any realistic length
    return (h1 % _P1) * _P1 + (h2 % _P2) + lengths


class ReplayBuffer:
    """In-memory store of step samples with state-group lookup, eviction and sampling."""

    clause_weight: Tensor | None = None  # (a class default too: buffers pickled before it existed)

    def __init__(self, config: BufferConfig | None = None, **fields) -> None:
        self.config = config or BufferConfig(**fields)
        cap = self.config.capacity
        self._headroom = max(cap // 4, 64)
        self._alloc = 0
        self._n = 0  # rows used in the columns ([0, n): alive or dead)
        self._head = 0  # every row before head is dead
        self._alive = 0
        self._order = 0
        self.version = 0
        self._cutoff = None  # version below which samples were last evicted
        self._col: dict[str, Tensor] = {k: torch.empty(0, dtype=d) for k, d in _COLUMNS.items()}
        self._tokens = torch.empty(0, dtype=torch.int32)
        self._logp = torch.empty(0, dtype=torch.float32)
        self._tok_n = 0
        self._codes = {k: _Codes() for k in ("state", "abstract", "task_group", "traj")}
        self._dedup: dict[tuple, int] = {}
        self.clause_weight: Tensor | None = None  # [C], set by the first add that has clauses
        self.evicted = {"capacity": 0, "max_age": 0, "dedup": 0}

    # ----------------------------------------------------------------------------- insertion

    def add(self, samples: StepSamples) -> Tensor:
        """Store step samples; return the row index of each one kept ([≤ N], valid until the
        next `add`), in order.

        A sample is not kept when it is already more than `max_age` versions old, or (with
        `dedup`) when a later sample of the same call is identical to it; a stored identical
        record is evicted in favour of the new one. Raises `KitchenError` for non-finite rewards
        or log-probs, naming the trajectory and turn. `samples.run` labels independent runs kept
        in one buffer (the lab's seeds; default 0).
        """
        n = len(samples)
        state_keys = _as_keys(samples.state)
        traj_keys = _as_keys(samples.traj)
        floats = {
            "local_reward": samples.local_reward,
            "ret": samples.ret,
            "global_reward": samples.global_reward,
        }
        if samples.form_reward is not None:
            floats["form_reward"] = samples.form_reward  # checked with the rewards
        flat_tok, tok_len, flat_lp = samples.tokens, samples.tok_len, samples.logp
        self._check_finite(floats, flat_lp, tok_len, traj_keys, samples.turn)
        versions = samples.version
        cols = {
            "state": self._codes["state"].encode(state_keys),
            "abstract": self._codes["abstract"].encode(_as_keys(samples.abstract)),
            "task_group": self._codes["task_group"].encode(_as_keys(samples.task_group)),
            "traj": self._codes["traj"].encode(traj_keys),
            "run": torch.zeros(n, dtype=torch.long) if samples.run is None else samples.run,
            "turn": samples.turn.to(torch.int32),
            **floats,
            "version": versions,
            "order": torch.arange(self._order, self._order + n),
            "tok_len": tok_len.to(torch.int32),
            "tok_hash": _token_hash(flat_tok, tok_len),
            "valid": samples.valid,
            "blocked": samples.blocked_mask(),
            "alive": torch.ones(n, dtype=torch.bool),
        }
        if "blocked" not in self._col:  # a buffer pickled before the column existed
            self._col["blocked"] = torch.zeros(self._alloc, dtype=torch.bool)
        if samples.clauses is not None or self.clause_weight is not None:
            cols["clauses"] = self._clause_rows(samples)
        if samples.form_reward is not None or "form_reward" in self._col:
            cols |= self._form_rows(samples)
        self._order += n
        newest = max(self.version, int(versions.max()) if n else 0)
        keep = torch.ones(n, dtype=torch.bool)
        if self.config.max_age is not None:  # samples already too old never enter
            keep = versions >= newest - self.config.max_age
            self.evicted["max_age"] += int((~keep).sum())
        if self.config.dedup:
            keep = self._dedup_batch(state_keys, cols, keep)
        rows = self._append(
            cols, flat_tok.to(torch.int32), flat_lp, tok_len, None if keep.all() else keep
        )
        self.advance(newest)
        self._evict_capacity()
        self._prune_keys()
        return rows[self._col["alive"][rows]]

    def _clause_rows(self, samples: StepSamples) -> Tensor:
        """The samples' clause verdicts [N, C] for the `clauses` column (NaN rows for samples
        without any), creating the column at the first add that has them."""
        n = len(samples)
        if self.clause_weight is None:
            self.clause_weight = samples.clause_weight.clone()
            width = self.clause_weight.shape[0]
            self._col["clauses"] = torch.full((self._alloc, width), torch.nan)
        elif samples.clauses is not None and not torch.equal(
            samples.clause_weight, self.clause_weight
        ):
            raise KitchenError(
                [
                    Problem(
                        "buffer.add",
                        None,
                        "clause_weight",
                        f"these samples weigh their {samples.clause_weight.shape[0]} clauses "
                        f"{samples.clause_weight.tolist()}; the buffer holds "
                        f"{self.clause_weight.tolist()} (one constitution per buffer)",
                    )
                ]
            )
        if samples.clauses is None:
            return torch.full((n, self.clause_weight.shape[0]), torch.nan)
        bad = torch.isinf(samples.clauses).any(1)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise _at_sample(
                _as_keys(samples.traj)[i],
                samples.turn[i],
                "a clause verdict is infinite; verdicts are +1, −1 or NaN (n/a)",
            )
        return samples.clauses

    def _form_rows(self, samples: StepSamples) -> dict[str, Tensor]:
        """The `form_key` column of the samples (their `form_reward` goes in with the rewards),
        creating both columns at the first add that has them; samples without them read form 0
        and key −1 (a form of their own)."""
        n = len(samples)
        if "form_reward" not in self._col:
            self._col["form_reward"] = torch.zeros(self._alloc, dtype=torch.float32)
            self._col["form_key"] = torch.full((self._alloc,), -1, dtype=torch.long)
        if samples.form_reward is None:
            return {
                "form_reward": torch.zeros(n, dtype=torch.float32),
                "form_key": torch.full((n,), -1, dtype=torch.long),
            }
        return {"form_key": samples.form_key}

    def _check_finite(self, floats, flat_lp, lp_len, traj_keys, turns) -> None:
        for name, v in floats.items():
            bad = ~torch.isfinite(v)
            if bad.any():
                i = int(bad.nonzero()[0])
                raise _at_sample(
                    traj_keys[i],
                    turns[i],
                    f"{name} is {v[i].item()}; rewards must be finite numbers "
                    "(check the reward model's verdict for this turn)",
                )
        bad = ~torch.isfinite(flat_lp)
        if bad.any():
            seg = torch.repeat_interleave(torch.arange(lp_len.shape[0]), lp_len)
            i = int(seg[bad.nonzero()[0]])
            raise _at_sample(
                traj_keys[i],
                turns[i],
                "a token log-prob is not finite; store the sampler's log-probs of the "
                "tokens it actually emitted",
            )

    def _dedup_batch(self, state_keys: list, cols: dict[str, Tensor], keep: Tensor) -> Tensor:
        """Keep-newest de-duplication among the `keep` rows: drop earlier copies in the batch,
        evict stored ones. Returns the updated `keep`."""
        keep = keep.clone()
        candidates = keep.tolist()
        old_orders = []
        seen: dict[tuple, int] = {}
        for i, (k, h, o) in enumerate(
            zip(state_keys, cols["tok_hash"].tolist(), cols["order"].tolist(), strict=True)
        ):
            if not candidates[i]:
                continue
            key = (k, h)
            if key in seen:
                keep[seen[key]] = False
            seen[key] = i
            prev = self._dedup.get(key)
            if prev is not None:
                old_orders.append(prev)
            self._dedup[key] = o
        dropped_in_batch = sum(candidates) - int(keep.sum())
        if old_orders:
            orders = torch.tensor(old_orders, dtype=torch.long)
            pos = torch.searchsorted(self._col["order"][: self._n], orders)
            pos = pos[pos < self._n]
            pos = pos[torch.isin(self._col["order"][pos], orders)]
            pos = pos[self._col["alive"][pos]]
            self._kill(pos, "dedup")
        self.evicted["dedup"] += dropped_in_batch
        return keep

    def _append(self, cols, flat_tok, flat_lp, tok_len, keep) -> Tensor:
        if keep is not None:
            seg = torch.repeat_interleave(keep, tok_len)
            flat_tok, flat_lp, tok_len = flat_tok[seg], flat_lp[seg], tok_len[keep]
            cols = {k: v[keep] for k, v in cols.items()}
        b = tok_len.shape[0]
        self._ensure_rows(b)
        self._ensure_tokens(flat_tok.shape[0])
        cols["tok_start"] = self._tok_n + torch.cumsum(tok_len, 0) - tok_len
        rows = torch.arange(self._n, self._n + b)
        for k, v in cols.items():
            self._col[k][self._n : self._n + b] = v
        m = flat_tok.shape[0]
        self._tokens[self._tok_n : self._tok_n + m] = flat_tok
        self._logp[self._tok_n : self._tok_n + m] = flat_lp
        self._tok_n += m
        self._n += b
        self._alive += b
        return rows

    # ------------------------------------------------------------------------------ eviction

    def advance(self, version: int) -> None:
        """Set the current policy version (never backwards) and evict samples older than
        `max_age` versions: kept while version − sample version ≤ max_age."""
        self.version = max(self.version, int(version))
        if self.config.max_age is None:
            return
        cutoff = self.version - self.config.max_age
        if self._cutoff is not None and cutoff <= self._cutoff:
            return
        self._cutoff = cutoff
        lo = self._head
        stale = self._col["alive"][lo : self._n] & (self._col["version"][lo : self._n] < cutoff)
        self._kill(stale.nonzero().squeeze(1) + lo, "max_age")

    def _evict_capacity(self) -> None:
        """Kill the oldest live records beyond capacity: scan forward from the head in windows,
        so the cost is the number of rows passed, not the size of the store."""
        excess = self._alive - self.config.capacity
        start = self._head
        while excess > 0:
            stop = min(self._n, start + max(2 * excess, 1024))
            idx = self._col["alive"][start:stop].nonzero().squeeze(1)[:excess] + start
            self._kill(idx, "capacity")
            excess -= idx.numel()
            start = int(idx[-1]) + 1 if idx.numel() else stop
            self._head = start  # everything before it is dead now

    def _kill(self, rows: Tensor, why: str) -> None:
        if rows.numel() == 0:
            return
        self._col["alive"][rows] = False
        self._alive -= rows.numel()
        self.evicted[why] += rows.numel()

    # ------------------------------------------------------------------------------- storage

    def _ensure_rows(self, b: int) -> None:
        if self._n + b <= self._alloc:
            return
        self._compact()
        if self._n + b <= self._alloc:
            return
        target = max(
            min(2 * max(self._alloc, 1024), self.config.capacity + self._headroom), self._n + b
        )
        for k, v in self._col.items():
            grown = torch.zeros((target, *v.shape[1:]), dtype=v.dtype)
            grown[: self._n] = v[: self._n]
            self._col[k] = grown
        self._alloc = target

    def _ensure_tokens(self, m: int) -> None:
        if self._tok_n + m <= self._tokens.shape[0]:
            return
        live = int(self._col["tok_len"][: self._n][self._col["alive"][: self._n]].sum())
        if self._tok_n > 2 * live:  # mostly dead tokens: reclaim them before growing
            self._compact_tokens()
        if self._tok_n + m > self._tokens.shape[0]:
            size = max(2 * self._tokens.shape[0], self._tok_n + m, 4096)
            for name in ("_tokens", "_logp"):
                old = getattr(self, name)
                new = torch.zeros(size, dtype=old.dtype)
                new[: self._tok_n] = old[: self._tok_n]
                setattr(self, name, new)

    def _compact(self) -> None:
        """Drop dead rows (keeping insertion order) and their tokens."""
        keep = self._col["alive"][: self._n].nonzero().squeeze(1)
        for v in self._col.values():
            v[: keep.numel()] = v.index_select(0, keep)
        self._n = keep.numel()
        self._head = 0
        self._compact_tokens()

    def _prune_keys(self) -> None:
        """Forget keys (and de-dup entries) of evicted records once they outnumber live ones."""
        alive = self._col["alive"][: self._n]
        for name, codes in self._codes.items():
            if len(codes) > 2 * self._alive + 1024:
                col = self._col[name][: self._n]
                remap = codes.prune(col[alive])
                col.copy_(remap[col].clamp(min=0))  # dead rows may map to −1; park them on 0
        if self.config.dedup and len(self._dedup) > 2 * self._alive + 1024:
            keys = self._codes["state"].keys
            c = {k: self._col[k][: self._n][alive] for k in ("state", "tok_hash", "order")}
            self._dedup = {
                (keys[s], h): o
                for s, h, o in zip(
                    c["state"].tolist(), c["tok_hash"].tolist(), c["order"].tolist(), strict=True
                )
            }

    def _compact_tokens(self) -> None:
        alive = self._col["alive"][: self._n]
        start = self._col["tok_start"][: self._n]
        length = self._col["tok_len"][: self._n].long() * alive
        new_start = torch.cumsum(length, 0) - length
        src = torch.repeat_interleave(start, length) + (
            torch.arange(int(length.sum())) - torch.repeat_interleave(new_start, length)
        )
        m = src.numel()
        self._tokens[:m] = self._tokens[src]
        self._logp[:m] = self._logp[src]
        self._col["tok_start"][: self._n] = new_start
        self._tok_n = m

    # ------------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return self._alive

    def rows(self) -> Tensor:
        """Row indices of every live record, oldest first."""
        return self._col["alive"][: self._n].nonzero().squeeze(1)

    def keys_of(self, rows: Tensor, which: str = "state") -> list:
        """The original keys (strings, ints) of `rows` for one key column. O(rows) Python."""
        known = self._codes[which].keys
        return [known[c] for c in self._col[which][rows].tolist()]

    def history(
        self,
        samples: StepSamples,
        by: StateKey = "exact",
        exclude: Tensor | None = None,
        whole_task_groups: bool = False,
    ) -> Tensor:
        """Rows of every live record (but `exclude`) sharing a state key with one of `samples`.

        This is the method's "fetch by state" (docs/method.md#replay-buffer): the history that
        joins each fresh sample's state group, keyed by the exact or the abstract state. With
        `whole_task_groups`, the full task groups of those records come too (so their global
        advantages can be recomputed when they are replayed into the gradient). Returns rows
        [R], oldest first. O(records), vectorised: a boolean-table gather over the codes.
        """
        name = "state" if by == "exact" else "abstract"
        codes = self._codes[name].lookup(
            _as_keys(samples.state if by == "exact" else samples.abstract)
        )
        wanted = torch.zeros(len(self._codes[name]), dtype=torch.bool)
        wanted[codes[codes >= 0]] = True
        alive = self._col["alive"][: self._n]
        hit = wanted[self._col[name][: self._n]] & alive
        if whole_task_groups and hit.any():
            groups = self._col["task_group"][: self._n]
            tasks = torch.zeros(len(self._codes["task_group"]), dtype=torch.bool)
            tasks[groups[hit]] = True
            hit |= tasks[groups] & alive
        if exclude is not None:
            hit[exclude] = False
        return hit.nonzero().squeeze(1)

    def batch(self, samples: StepSamples, history: Tensor, by: StateKey = "exact") -> StepBatch:
        """The `mapo.StepBatch` of `samples` (fresh, first) followed by the stored `history`
        rows, keyed in one code space: states by `by`, task groups and trajectories by their keys.
        `fresh` marks the first len(samples) rows."""
        c, n = self._col, len(samples)
        name = "state" if by == "exact" else "abstract"

        def codes(which: str, keys) -> Tensor:  # fresh keys in the stored keys' codes, then history
            return torch.cat([self._codes[which].encode(_as_keys(keys)), c[which][history]])

        fresh = torch.zeros(n + history.numel(), dtype=torch.bool)
        fresh[:n] = True
        run = torch.zeros(n, dtype=torch.long) if samples.run is None else samples.run
        return StepBatch(
            local_reward=torch.cat([samples.local_reward, c["local_reward"][history]]),
            global_reward=torch.cat([samples.global_reward, c["global_reward"][history]]),
            ret=torch.cat([samples.ret, c["ret"][history]]),
            state=codes(name, samples.state if by == "exact" else samples.abstract),
            task_group=codes("task_group", samples.task_group),
            traj=codes("traj", samples.traj),
            turn=torch.cat([samples.turn, c["turn"][history].long()]),
            fresh=fresh,
            run=torch.cat([run, c["run"][history]]),
            valid=torch.cat([samples.valid, c["valid"][history]]),
            blocked=torch.cat([samples.blocked_mask(), self._blocked(history)]),
            **self._clauses_of(samples, history),
            **self._forms_of(samples, history),
        )

    def _blocked(self, rows: Tensor) -> Tensor:
        """The `blocked` column at `rows` (False for a buffer pickled before it existed)."""
        col = self._col.get("blocked")
        return torch.zeros(rows.numel(), dtype=torch.bool) if col is None else col[rows]

    def _clauses_of(self, samples: StepSamples, history: Tensor) -> dict[str, Tensor | None]:
        """`clauses` and `clause_weight` for `batch`: the fresh samples' then the history's."""
        if samples.clauses is None or self.clause_weight is None:
            return {"clauses": None, "clause_weight": None}
        rows = torch.cat([samples.clauses, self._col["clauses"][history]])
        return {"clauses": rows, "clause_weight": self.clause_weight}

    def _forms_of(self, samples: StepSamples, history: Tensor) -> dict[str, Tensor | None]:
        """`form_reward` and `form_key` for `batch`: the fresh samples' then the history's."""
        if samples.form_reward is None or "form_reward" not in self._col:
            return {"form_reward": None, "form_key": None}
        return {
            name: torch.cat([getattr(samples, name), self._col[name][history]])
            for name in ("form_reward", "form_key")
        }

    def samples(self, rows: Tensor) -> StepSamples:
        """The stored records at `rows` as step samples (keys as given to `add`)."""
        c = self._col
        start = c["tok_start"][rows]
        length = c["tok_len"][rows].long()
        offset = torch.cumsum(length, 0) - length
        at = torch.repeat_interleave(start, length) + (
            torch.arange(int(length.sum())) - torch.repeat_interleave(offset, length)
        )  # [M] positions of the rows' tokens in the flat store
        return StepSamples(
            state=self.keys_of(rows, "state"),
            abstract=self.keys_of(rows, "abstract"),
            task_group=self.keys_of(rows, "task_group"),
            traj=self.keys_of(rows, "traj"),
            turn=c["turn"][rows].long(),
            tokens=self._tokens[at].long(),
            logp=self._logp[at],
            tok_len=length,
            local_reward=c["local_reward"][rows],
            ret=c["ret"][rows],
            global_reward=c["global_reward"][rows],
            valid=c["valid"][rows],
            version=c["version"][rows],
            run=c["run"][rows],
            clauses=None if self.clause_weight is None else c["clauses"][rows],
            clause_weight=self.clause_weight,
            form_reward=c["form_reward"][rows] if "form_reward" in c else None,
            form_key=c["form_key"][rows] if "form_key" in c else None,
            blocked=self._blocked(rows),
        )

    # -------------------------------------------------------------------------------- memory

    def memory_per_record(self) -> dict[str, float]:
        """Bytes per live record: fixed columns, tokens + log-probs, and the key dictionaries."""
        n = max(self._alive, 1)
        columns = sum(torch.empty(0, dtype=d).element_size() for d in _COLUMNS.values())
        if self.clause_weight is not None:
            columns += 4 * self.clause_weight.shape[0]
        if "form_reward" in self._col:
            columns += 4 + 8  # form_reward, form_key
        tokens = self._tok_n * (self._tokens.element_size() + self._logp.element_size()) / n
        keys = 0
        for codes in self._codes.values():
            keys += sys.getsizeof(codes.index) + sys.getsizeof(codes.keys)
            keys += sum(sys.getsizeof(k) for k in codes.keys)
        if self.config.dedup:
            keys += sys.getsizeof(self._dedup) + len(self._dedup) * 2 * 64  # tuple + int
        allocated = sum(v.numel() * v.element_size() for v in self._col.values())
        allocated += self._tokens.numel() * 4 + self._logp.numel() * 4
        return {
            "columns": float(columns),
            "tokens": tokens,
            "keys": keys / n,
            "total": columns + tokens + keys / n,
            "allocated_total": (allocated + keys) / n,
        }
