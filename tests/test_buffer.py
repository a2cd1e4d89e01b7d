"""The replay buffer: grouping, history lookup, eviction, max age, de-duplication, sampling."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.testing import assert_close

from kitchen import mapo
from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.config import KitchenError


def add(
    buf: ReplayBuffer,
    states,
    *,
    version=0,
    traj=None,
    task="t",
    tokens=None,
    rewards=None,
    abstract=None,
    turn=None,
):
    n = len(states)
    tokens = tokens if tokens is not None else [[i, i + 1] for i in range(n)]
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    return buf.add(
        state=states,
        abstract=abstract,
        tokens=tokens,
        logp=[[-0.5] * len(x) for x in tokens],
        local_reward=rewards,
        ret=rewards,
        global_reward=[1.0] * n,
        task_group=[task] * n,
        traj=traj if traj is not None else [f"{task}-{i}" for i in range(n)],
        turn=turn if turn is not None else [0] * n,
        version=version,
    )


def test_records_round_trip():
    """What goes in comes out: rewards, keys, ragged tokens and their log-probs."""
    buf = ReplayBuffer(capacity=10)
    rows = buf.add(
        state=["s1", "s2"],
        tokens=[[5, 6, 7], [8]],
        logp=[[-0.1, -0.2, -0.3], [-0.4]],
        local_reward=[0.5, -1.0],
        ret=[1.5, -1.0],
        global_reward=[1.0, 1.0],
        task_group=["task-a", "task-a"],
        traj=["traj-1", "traj-1"],
        turn=[0, 1],
        version=3,
    )
    assert len(buf) == 2 and rows.tolist() == [0, 1]
    tokens, mask = buf.padded(rows)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.sum().item() == 4
    logp, _ = buf.padded(rows, "logp")
    assert_close(logp[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert buf.column("ret").tolist() == [1.5, -1.0]
    assert buf.column("version").tolist() == [3, 3]
    assert buf.keys_of(rows) == ["s1", "s2"] and buf.keys_of(rows, "traj") == ["traj-1"] * 2
    batch = buf.batch(rows)
    assert isinstance(batch, mapo.StepBatch) and batch.turn.tolist() == [0, 1]


def test_grouping_exact_abstract_and_custom():
    """Group codes by exact key, by abstract key, or by any function of the columns."""
    buf = ReplayBuffer(capacity=10)
    rows = add(buf, ["a1", "a2", "a1", "b"], abstract=["a", "a", "a", "b"], turn=[0, 1, 2, 1])
    assert buf.groups(rows).tolist() == [0, 1, 0, 2]
    assert buf.groups(rows, "abstract").tolist() == [0, 0, 0, 1]
    assert buf.groups(rows, lambda c: c["turn"]).tolist() == [0, 1, 2, 1]


def test_history_joins_the_state_groups_of_fresh_samples():
    """with_history returns the fresh rows first, then every live record sharing a key."""
    buf = ReplayBuffer(capacity=100)
    add(buf, ["x", "y", "z"], task="old", version=0)
    fresh = add(buf, ["x", "w"], task="new", version=1)
    rows, is_fresh = buf.with_history(fresh)
    assert rows[:2].tolist() == fresh.tolist() and is_fresh.tolist() == [True, True, False]
    assert buf.keys_of(rows) == ["x", "w", "x"]
    rows, _ = buf.with_history(fresh, whole_task_groups=True)  # the old task group comes whole
    assert sorted(buf.keys_of(rows)) == ["w", "x", "x", "y", "z"]
    batch = buf.batch(rows, fresh=torch.tensor([True, True, False, False, False]))
    adv, m = mapo.advantages(batch, mapo.preset("mapo"))
    assert adv.shape == (5,) and m["group/history_frac"] == pytest.approx(0.6)


def test_capacity_evicts_the_oldest_first():
    """Beyond capacity the earliest inserted records go, whatever their keys."""
    buf = ReplayBuffer(capacity=5)
    for v in range(4):
        add(buf, [f"s{v}a", f"s{v}b"], task=f"t{v}", version=v)
    assert len(buf) == 5 and buf.evicted["capacity"] == 3
    assert buf.keys_of(buf.rows()) == ["s1b", "s2a", "s2b", "s3a", "s3b"]
    assert buf.column("order").tolist() == [3, 4, 5, 6, 7]


def test_max_age_evicts_stale_samples():
    """Records older than max_age policy versions leave when the version advances; samples that
    arrive already too old never enter."""
    buf = ReplayBuffer(capacity=100, max_age=2)
    add(buf, ["a"], version=0, task="v0")
    add(buf, ["b"], version=1, task="v1")
    add(buf, ["c"], version=2, task="v2")
    assert len(buf) == 3
    add(buf, ["d"], version=3, task="v3")
    assert buf.keys_of(buf.rows()) == ["b", "c", "d"] and buf.evicted["max_age"] == 1
    add(buf, ["late"], version=0, task="late")
    assert "late" not in buf.keys_of(buf.rows())
    buf.advance(10)
    assert len(buf) == 0


def test_dedup_keeps_the_newest_identical_sample():
    """Same exact state and same action tokens: the newer copy replaces the older one, within a
    batch and across batches; different tokens or states are kept."""
    buf = ReplayBuffer(capacity=100, dedup=True)
    add(buf, ["s", "s", "s"], tokens=[[1, 2], [1, 2], [2, 1]], rewards=[0.0, 1.0, 2.0])
    assert len(buf) == 2 and buf.column("local_reward").tolist() == [1.0, 2.0]
    add(buf, ["s", "t"], tokens=[[2, 1], [2, 1]], rewards=[5.0, 6.0], task="u", version=1)
    assert buf.column("local_reward").tolist() == [1.0, 5.0, 6.0]
    assert buf.evicted["dedup"] == 2
    plain = ReplayBuffer(capacity=100)
    add(plain, ["s", "s"], tokens=[[1, 2], [1, 2]])
    assert len(plain) == 2


def test_last_kept_maps_returned_rows_back_to_samples():
    """`last_kept` marks the samples of the last `add` that were stored (not a duplicate, not too
    old); the returned rows are theirs, in order (integrations map advantages back by it)."""
    buf = ReplayBuffer(capacity=100, dedup=True, max_age=1)
    add(buf, ["x"], version=5, task="new")
    rows = add(buf, ["s", "s", "t"], tokens=[[1, 2], [1, 2], [3]], rewards=[0.0, 1.0, 2.0])
    assert buf.last_kept.tolist() == [False, False, False]  # version 0 is too old
    rows = add(
        buf,
        ["s", "s", "t"],
        tokens=[[1, 2], [1, 2], [3]],
        rewards=[0.0, 1.0, 2.0],
        version=5,
        task="b",
    )
    assert buf.last_kept.tolist() == [False, True, True]  # the first copy is a duplicate
    assert buf.column("local_reward", rows).tolist() == [1.0, 2.0]


def test_non_finite_rewards_are_rejected_naming_the_sample():
    """NaN or inf rewards (and NaN log-probs) raise a KitchenError naming trajectory and turn."""
    buf = ReplayBuffer(capacity=10)
    with pytest.raises(KitchenError, match=r"trajectory 'traj-9' turn 4.*local_reward is nan"):
        add(buf, ["s"], rewards=[float("nan")], traj=["traj-9"], turn=[4])
    with pytest.raises(KitchenError, match="global_reward is inf"):
        buf.add(
            state=["s"],
            tokens=[[1]],
            logp=[[0.0]],
            local_reward=[0.0],
            ret=[0.0],
            global_reward=[float("inf")],
            task_group=["t"],
            traj=["x"],
            turn=[0],
            version=0,
        )
    with pytest.raises(KitchenError, match="log-prob is not finite"):
        buf.add(
            state=["s"],
            tokens=[[1, 2]],
            logp=[[0.0, float("nan")]],
            local_reward=[0.0],
            ret=[0.0],
            global_reward=[0.0],
            task_group=["t"],
            traj=["x"],
            turn=[0],
            version=0,
        )
    assert len(buf) == 0


def test_compaction_keeps_records_and_tokens_intact():
    """Many small inserts past capacity: survivors keep their rewards, tokens and order, and the
    key tables stay bounded (keys of evicted records are forgotten)."""
    buf = ReplayBuffer(capacity=300)
    for v in range(200):
        n = 7
        add(
            buf,
            [f"s{v % 5}"] * n,
            traj=[f"traj{v}-{i}" for i in range(n)],
            task=f"t{v}",
            tokens=[[v, i, v + i][: 1 + i % 3] for i in range(n)],
            rewards=[v + i / 10 for i in range(n)],
            version=v,
        )
    assert len(buf) == 300
    order = buf.column("order")
    assert (order[1:] > order[:-1]).all() and order[-1].item() == 200 * 7 - 1
    rows = buf.rows()
    tokens, mask = buf.padded(rows)
    reward = buf.column("local_reward")
    v = reward.floor().long()
    i = ((reward - v) * 10).round().long()
    assert (tokens[:, 0] == v).all() and (mask.sum(1) == 1 + i % 3).all()
    assert len(buf._codes["traj"]) <= 2 * 300 + 1024
    assert buf.memory_per_record()["total"] > 0


def test_uniform_and_priority_sampling():
    """Uniform draws are distinct live rows; |advantage| priority prefers large advantages."""
    buf = ReplayBuffer(capacity=1000)
    rows = add(buf, [f"s{i}" for i in range(100)])
    gen = torch.Generator().manual_seed(0)
    picked = buf.sample(30, generator=gen)
    assert picked.unique().numel() == 30 and len(buf.sample(500)) == 100
    adv = torch.zeros(100)
    adv[:10] = 5.0
    buf.set_priority(rows, adv)
    hits = 0
    for _ in range(20):
        hits += int((buf.sample(10, priority="abs_adv", generator=gen) < 10).sum())
    assert hits > 150  # nearly all draws come from the 10 high-advantage records
    with pytest.raises(ValueError, match="unknown priority"):
        buf.sample(3, priority="td")


def test_config_validation():
    """Capacity must be positive; unknown options are errors."""
    with pytest.raises(ValidationError):
        BufferConfig(capacity=0)
    with pytest.raises(ValidationError):
        ReplayBuffer(capcity=10)
    assert ReplayBuffer(BufferConfig(capacity=7, max_age=1)).config.capacity == 7


def test_uniform_sampling_by_rejection_is_uniform_over_live_rows():
    """Small draws from a large buffer skip dead rows, never repeat, and cover rows evenly."""
    buf = ReplayBuffer(capacity=400)
    for v in range(5):  # 500 inserted, the first 100 evicted
        add(buf, [f"s{i}" for i in range(100)], task=f"t{v}", version=v)
    live = set(buf.rows().tolist())
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(buf._n)
    for _ in range(400):
        draw = buf.sample(20, generator=gen)
        assert draw.unique().numel() == 20 and set(draw.tolist()) <= live
        counts[draw] += 1
    hit = counts[buf.rows()]
    assert hit.mean().item() == pytest.approx(20.0) and hit.min() > 5 and hit.max() < 40


def test_a_stale_duplicate_does_not_evict_the_stored_copy():
    """With dedup and max_age, a copy too old to enter leaves the stored one alone."""
    buf = ReplayBuffer(capacity=10, max_age=1, dedup=True)
    add(buf, ["s"], tokens=[[1]], rewards=[1.0], version=5)
    add(buf, ["s"], tokens=[[1]], rewards=[2.0], version=2, task="late")
    assert buf.column("local_reward").tolist() == [1.0]
    assert buf.evicted == {"capacity": 0, "max_age": 1, "dedup": 0}


def test_valid_flag_round_trips_into_step_batches():
    """Samples without a local signal keep their flag through storage into StepBatch.valid."""
    from kitchen.buffer import ReplayBuffer

    buf = ReplayBuffer(capacity=10)
    rows = buf.add(
        state=["s", "s", "t"],
        tokens=[[1], [2], [3]],
        logp=[[0.0], [0.0], [0.0]],
        local_reward=[1.0, 0.0, 2.0],
        ret=[1.0, 0.0, 2.0],
        global_reward=[0, 0, 0],
        task_group=["g"] * 3,
        traj=["a", "b", "c"],
        turn=[0, 0, 1],
        version=0,
        valid=[True, False, True],
    )
    assert buf.batch(rows).valid.tolist() == [True, False, True]
    assert buf.batch(
        buf.add(
            state=["u"],
            tokens=[[4]],
            logp=[[0.0]],
            local_reward=[0.0],
            ret=[0.0],
            global_reward=[0],
            task_group=["h"],
            traj=["d"],
            turn=[0],
            version=0,
        )
    ).valid.tolist() == [True]
