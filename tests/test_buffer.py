"""The replay buffer: storage, state-group history, eviction, max age, de-duplication."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.testing import assert_close

from kitchen import mapo
from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.config import KitchenError
from kitchen.steps import StepSamples, ragged


def samples(
    states,
    *,
    version=0,
    traj=None,
    task="t",
    tokens=None,
    rewards=None,
    abstract=None,
    turn=None,
    valid=None,
    logp=None,
) -> StepSamples:
    n = len(states)
    tokens = tokens if tokens is not None else [[i, i + 1] for i in range(n)]
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    flat, lengths = ragged(tokens, torch.long)
    lp = logp if logp is not None else [[-0.5] * len(x) for x in tokens]
    return StepSamples(
        state=states,
        abstract=abstract,
        tokens=flat,
        logp=ragged(lp, torch.float32)[0],
        tok_len=lengths,
        local_reward=rewards,
        ret=rewards,
        global_reward=[1.0] * n,
        task_group=[task] * n,
        traj=traj if traj is not None else [f"{task}-{i}" for i in range(n)],
        turn=turn if turn is not None else [0] * n,
        version=version,
        valid=valid,
    )


def add(buf: ReplayBuffer, states, **kw):
    return buf.add(samples(states, **kw))


def stored(buf: ReplayBuffer) -> StepSamples:
    return buf.samples(buf.rows())


def test_records_round_trip():
    """What goes in comes out: rewards, keys, versions, ragged tokens and their log-probs."""
    buf = ReplayBuffer(capacity=10)
    rows = add(
        buf,
        ["s1", "s2"],
        tokens=[[5, 6, 7], [8]],
        logp=[[-0.1, -0.2, -0.3], [-0.4]],
        rewards=[0.5, -1.0],
        traj=["traj-1", "traj-1"],
        turn=[0, 1],
        version=3,
    )
    assert len(buf) == 2 and rows.tolist() == [0, 1]
    back = buf.samples(rows)
    assert back.actions() == [[5, 6, 7], [8]]
    assert_close(back.padded("logp")[0][0], torch.tensor([-0.1, -0.2, -0.3]))
    assert back.padded("logp")[1].sum().item() == 4
    assert back.ret.tolist() == [0.5, -1.0] and back.version.tolist() == [3, 3]
    assert back.state == ["s1", "s2"] and back.traj == ["traj-1"] * 2
    assert back.turn.tolist() == [0, 1] and back.valid.tolist() == [True, True]


def test_history_joins_the_state_groups_of_fresh_samples():
    """`history` is every other live record sharing a state key (exact or abstract) with the
    fresh samples; with whole task groups, those records' whole task groups come too."""
    buf = ReplayBuffer(capacity=100)
    add(buf, ["x", "y", "z"], abstract=["a", "b", "a"], task="old", version=0)
    fresh = samples(["x", "w"], abstract=["c", "b"], task="new", version=1)
    kept = buf.add(fresh)
    assert buf.keys_of(buf.history(fresh, exclude=kept)) == ["x"]
    assert buf.keys_of(buf.history(fresh, "abstract", exclude=kept)) == ["y"]
    whole = buf.history(fresh, exclude=kept, whole_task_groups=True)
    assert buf.keys_of(whole) == ["x", "y", "z"]
    assert buf.history(samples(["never"]), exclude=kept).numel() == 0


def test_batch_puts_fresh_samples_first_in_one_code_space():
    """`batch(samples, history)` is a StepBatch of the fresh samples then the history rows, so a
    fresh sample and a stored one with the same key share a group."""
    buf = ReplayBuffer(capacity=100)
    add(buf, ["x", "y"], task="old", rewards=[1.0, 2.0], version=0)
    fresh = samples(["x", "w"], task="new", rewards=[3.0, 4.0], version=1)
    kept = buf.add(fresh)
    history = buf.history(fresh, exclude=kept)
    batch = buf.batch(fresh, history)
    assert batch.fresh.tolist() == [True, True, False]
    assert batch.local_reward.tolist() == [3.0, 4.0, 1.0]
    assert batch.state[0] == batch.state[2] and batch.state[1] != batch.state[0]
    assert batch.task_group[0] == batch.task_group[1] != batch.task_group[2]
    adv, m = mapo.advantages(batch, mapo.preset("mapo"))
    assert adv.shape == (3,) and m["group/history_frac"] == pytest.approx(1 / 3)


def test_capacity_evicts_the_oldest_first():
    """Beyond capacity the earliest inserted records go, whatever their keys."""
    buf = ReplayBuffer(capacity=5)
    for v in range(4):
        add(buf, [f"s{v}a", f"s{v}b"], task=f"t{v}", version=v)
    assert len(buf) == 5 and buf.evicted["capacity"] == 3
    assert stored(buf).state == ["s1b", "s2a", "s2b", "s3a", "s3b"]


def test_max_age_evicts_stale_samples():
    """Records older than max_age policy versions leave when the version advances; samples that
    arrive already too old never enter."""
    buf = ReplayBuffer(capacity=100, max_age=2)
    add(buf, ["a"], version=0, task="v0")
    add(buf, ["b"], version=1, task="v1")
    add(buf, ["c"], version=2, task="v2")
    assert len(buf) == 3
    add(buf, ["d"], version=3, task="v3")
    assert stored(buf).state == ["b", "c", "d"] and buf.evicted["max_age"] == 1
    assert add(buf, ["late"], version=0, task="late").numel() == 0
    assert "late" not in stored(buf).state
    buf.advance(10)
    assert len(buf) == 0


def test_dedup_keeps_the_newest_identical_sample():
    """Same exact state and same action tokens: the newer copy replaces the older one, within a
    batch and across batches; different tokens or states are kept."""
    buf = ReplayBuffer(capacity=100, dedup=True)
    add(buf, ["s", "s", "s"], tokens=[[1, 2], [1, 2], [2, 1]], rewards=[0.0, 1.0, 2.0])
    assert len(buf) == 2 and stored(buf).local_reward.tolist() == [1.0, 2.0]
    add(buf, ["s", "t"], tokens=[[2, 1], [2, 1]], rewards=[5.0, 6.0], task="u", version=1)
    assert stored(buf).local_reward.tolist() == [1.0, 5.0, 6.0]
    assert buf.evicted["dedup"] == 2
    plain = ReplayBuffer(capacity=100)
    add(plain, ["s", "s"], tokens=[[1, 2], [1, 2]])
    assert len(plain) == 2


def test_add_returns_the_rows_of_the_kept_samples_in_order():
    """`add` returns one row per kept sample (not a duplicate, not too old), in input order."""
    buf = ReplayBuffer(capacity=100, dedup=True, max_age=1)
    add(buf, ["x"], version=5, task="new")
    too_old = add(buf, ["s", "s", "t"], tokens=[[1, 2], [1, 2], [3]], rewards=[0.0, 1.0, 2.0])
    assert too_old.numel() == 0
    rows = add(
        buf,
        ["s", "s", "t"],
        tokens=[[1, 2], [1, 2], [3]],
        rewards=[0.0, 1.0, 2.0],
        version=5,
        task="b",
    )
    assert buf.samples(rows).local_reward.tolist() == [1.0, 2.0]  # the first copy is a duplicate


def test_non_finite_rewards_are_rejected_naming_the_sample():
    """NaN or inf rewards (and NaN log-probs) raise a KitchenError naming trajectory and turn."""
    buf = ReplayBuffer(capacity=10)
    with pytest.raises(KitchenError, match=r"trajectory 'traj-9' turn 4.*local_reward is nan"):
        add(buf, ["s"], rewards=[float("nan")], traj=["traj-9"], turn=[4])
    bad = samples(["s"])
    bad.global_reward = torch.tensor([float("inf")])
    with pytest.raises(KitchenError, match="global_reward is inf"):
        buf.add(bad)
    with pytest.raises(KitchenError, match="log-prob is not finite"):
        add(buf, ["s"], tokens=[[1, 2]], logp=[[0.0, float("nan")]])
    assert len(buf) == 0


def test_step_samples_reject_mismatched_columns():
    """A record whose columns disagree in length is refused before it reaches the buffer."""
    with pytest.raises(ValueError, match="traj has 1 entries for 2 samples"):
        samples(["a", "b"], traj=["only-one"])
    with pytest.raises(ValueError, match="sum\\(tok_len\\)"):
        StepSamples(
            state=["a"],
            task_group=["g"],
            traj=["x"],
            turn=[0],
            tokens=[1, 2],
            logp=[0.0],
            tok_len=[2],
            local_reward=[0.0],
            ret=[0.0],
            global_reward=[0.0],
        )


def test_compaction_keeps_records_and_tokens_intact():
    """Many inserts past capacity: survivors keep their rewards, tokens and order, the key tables
    stay bounded (keys of evicted records are forgotten), and so does the token store: its size
    follows the live tokens, not every token ever inserted."""
    buf = ReplayBuffer(capacity=300)
    total = 0
    for v in range(400):
        n = 7
        tokens = [[v] * (1 + (v + i) % 30) for i in range(n)]
        total += sum(map(len, tokens))
        add(
            buf,
            [f"s{v % 5}"] * n,
            traj=[f"traj{v}-{i}" for i in range(n)],
            task=f"t{v}",
            tokens=tokens,
            rewards=[v + i / 10 for i in range(n)],
            version=v,
        )
    assert len(buf) == 300
    back = stored(buf)
    v = back.local_reward.floor().long()
    i = ((back.local_reward - v) * 10).round().long()
    assert v.tolist() == sorted(v.tolist()) and v[-1].item() == 399  # oldest first, newest last
    actions = back.actions()
    assert all(
        a == [vv] * (1 + (vv + ii) % 30)
        for a, vv, ii in zip(actions, v.tolist(), i.tolist(), strict=True)
    )
    assert len(buf._codes["traj"]) <= 2 * 300 + 1024
    live = int(back.tok_len.sum())
    kept_tokens = buf.memory_per_record()["tokens"] * len(buf) / 8  # int32 id + float32 log-prob
    assert total > 4 * max(4096, 2 * (live + 7 * 30))  # so an uncompacted store fails below
    assert kept_tokens <= max(4096, 2 * (live + 7 * 30))


def test_config_validation():
    """Capacity must be positive; unknown options are errors."""
    with pytest.raises(ValidationError):
        BufferConfig(capacity=0)
    with pytest.raises(ValidationError):
        ReplayBuffer(capcity=10)
    assert ReplayBuffer(BufferConfig(capacity=7, max_age=1)).config.capacity == 7


def test_a_stale_duplicate_does_not_evict_the_stored_copy():
    """With dedup and max_age, a copy too old to enter leaves the stored one alone."""
    buf = ReplayBuffer(capacity=10, max_age=1, dedup=True)
    add(buf, ["s"], tokens=[[1]], rewards=[1.0], version=5)
    add(buf, ["s"], tokens=[[1]], rewards=[2.0], version=2, task="late")
    assert stored(buf).local_reward.tolist() == [1.0]
    assert buf.evicted == {"capacity": 0, "max_age": 1, "dedup": 0}


def test_valid_flag_round_trips_into_step_batches():
    """Samples without a local signal keep their flag through storage into StepBatch.valid."""
    buf = ReplayBuffer(capacity=10)
    first = samples(["s", "s", "t"], traj=["a", "b", "c"], valid=[True, False, True])
    buf.add(first)
    again = samples(["s"], traj=["d"], version=1)
    kept = buf.add(again)
    batch = buf.batch(again, buf.history(again, exclude=kept))
    assert batch.valid.tolist() == [True, True, False]
    assert stored(buf).valid.tolist() == [True, False, True, True]


def with_clauses(s: StepSamples, rows, weight=(3.0, 1.0)) -> StepSamples:
    s.clauses = torch.tensor(rows, dtype=torch.float32)
    s.clause_weight = torch.tensor(weight)
    return s


def test_clause_verdicts_round_trip_into_step_batches():
    """Per-clause verdicts are stored per record (NaN for n/a, and for records added without
    any), come back in `samples` and in the history rows of `batch`, survive the column's growth
    past its first allocation, and a buffer refuses samples that weigh their clauses otherwise."""
    nan = float("nan")
    buf = ReplayBuffer(capacity=5000)
    buf.add(samples(["s"], traj=["plain"]))  # before any clause: a NaN row once the column exists
    first = with_clauses(samples(["s", "t"], traj=["a", "b"]), [[1, nan], [-1, 1]])
    buf.add(first)
    again = with_clauses(samples(["s"], traj=["c"], version=1), [[-1, -1]])
    kept = buf.add(again)
    batch = buf.batch(again, buf.history(again, exclude=kept))
    assert_close(batch.clauses, torch.tensor([[-1, -1], [nan, nan], [1, nan]]), equal_nan=True)
    assert batch.clause_weight.tolist() == [3.0, 1.0]
    for v in range(3000):  # grows the columns several times
        add(buf, [f"x{v}"], traj=[f"x{v}"], version=1)
    back = stored(buf)
    assert_close(
        back.clauses[:4], torch.tensor([[nan, nan], [1, nan], [-1, 1], [-1, -1]]), equal_nan=True
    )
    assert back.clauses[4:].isnan().all() and back.clause_weight.tolist() == [3.0, 1.0]
    with pytest.raises(KitchenError, match="one constitution per buffer"):
        buf.add(with_clauses(samples(["s"], traj=["d"]), [[1, 1]], weight=(1.0, 1.0)))
    with pytest.raises(KitchenError, match="infinite"):
        buf.add(with_clauses(samples(["s"], traj=["e"]), [[float("inf"), 1]]))


def test_form_shares_round_trip_and_samples_without_them_read_a_form_of_their_own():
    """Form shares and codes are stored per record, come back in `samples` and in `batch`'s
    history, survive the columns' growth; a record added before any form reads share 0 and code
    −1, and a non-finite share is refused at the sample."""
    buf = ReplayBuffer(capacity=5000)
    buf.add(samples(["s"], traj=["plain"]))
    first = samples(["s", "t"], traj=["a", "b"])
    first.form_reward, first.form_key = torch.tensor([0.25, -0.5]), torch.tensor([1, 5])
    buf.add(first)
    again = samples(["s"], traj=["c"], version=1)
    again.form_reward, again.form_key = torch.tensor([0.1]), torch.tensor([2])
    kept = buf.add(again)
    batch = buf.batch(again, buf.history(again, exclude=kept))
    assert batch.form_key.tolist() == [2, -1, 1]
    assert_close(batch.form_reward, torch.tensor([0.1, 0.0, 0.25]))
    for v in range(3000):  # grows the columns several times
        add(buf, [f"x{v}"], traj=[f"x{v}"], version=1)
    back = stored(buf)
    assert back.form_key[:4].tolist() == [-1, 1, 5, 2] and (back.form_key[4:] == -1).all()
    assert_close(back.form_reward[:4], torch.tensor([0.0, 0.25, -0.5, 0.1]))
    assert buf.memory_per_record()["columns"] > ReplayBuffer().memory_per_record()["columns"]
    bad = samples(["s"], traj=["e"])
    bad.form_reward, bad.form_key = torch.tensor([float("nan")]), torch.tensor([1])
    with pytest.raises(KitchenError, match="form_reward is nan"):
        buf.add(bad)
