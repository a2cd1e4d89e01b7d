"""Step samples and the one path from them to advantages (`kitchen.steps`)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kitchen import mapo
from kitchen.buffer import BufferConfig, ReplayBuffer
from kitchen.mapo import StepBatch
from kitchen.steps import StepSamples, advantages_for, ragged


def make(states, rewards, *, task="g", traj=None, tokens=None, version=0, outcome=None):
    n = len(states)
    tokens = tokens or [[i + 1] for i in range(n)]
    flat, lengths = ragged(tokens, torch.long)
    return StepSamples(
        state=states,
        task_group=[task] * n,
        traj=traj or [f"{task}-{i}" for i in range(n)],
        turn=[0] * n,
        tokens=flat,
        logp=torch.full((flat.numel(),), -0.5),
        tok_len=lengths,
        local_reward=rewards,
        ret=rewards,
        global_reward=outcome or [0.0] * n,
        version=version,
    )


def test_concat_padded_and_actions():
    """concat keeps order and ragged tokens; padded and actions read them back."""
    a = make(["x", "y"], [1.0, 2.0], tokens=[[1, 2, 3], [4]])
    b = make(["z"], [3.0], task="h", tokens=[[5, 6]])
    both = StepSamples.concat([a, b])
    assert both.state == ["x", "y", "z"] and both.task_group == ["g", "g", "h"]
    assert both.actions() == [[1, 2, 3], [4], [5, 6]]
    ids, mask = both.padded()
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]] and mask.sum().item() == 6
    assert both.local_reward.tolist() == [1.0, 2.0, 3.0] and len(both) == 3
    tensors = StepSamples.concat([make(torch.tensor([7, 8]), [0, 0]), make(torch.tensor([9]), [0])])
    assert tensors.state.tolist() == [7, 8, 9]


def test_without_a_buffer_fresh_samples_are_the_batch():
    """A preset without a buffer (grpo) scores the fresh samples alone; nothing is stored."""
    buf = ReplayBuffer(BufferConfig())
    s = make(["a", "b", "c", "d"], [0.0] * 4, outcome=[1.0, 0.0, 1.0, 0.0])
    s.traj = ["t0", "t1", "t2", "t3"]
    scored = advantages_for(s, mapo.PRESETS["grpo"], buf)
    want = torch.tensor([0.5, -0.5, 0.5, -0.5]) / (1 / 3) ** 0.5  # z-scores, Bessel std
    assert_close(scored.adv, want, atol=1e-5, rtol=1e-5)
    assert len(buf) == 0 and scored.n_fresh == 4 and scored.samples is s


def test_buffer_history_joins_the_state_groups():
    """mapo: the second call's state groups hold the first call's records (an independent
    oracle: the same numbers in a StepBatch built by hand)."""
    cfg = mapo.preset("mapo", alpha={"kind": "constant", "alpha0": 1.0}, singleton="zero")
    buf = ReplayBuffer(BufferConfig(max_age=4))
    first = make(["s", "u"], [1.0, 5.0], task="old", version=0)
    advantages_for(first, cfg, buf, step=0)
    second = make(["s", "s"], [2.0, 3.0], task="new", version=1)
    scored = advantages_for(second, cfg, buf, step=1)
    oracle = StepBatch(
        local_reward=torch.tensor([2.0, 3.0, 1.0]),
        global_reward=torch.zeros(3),
        ret=torch.tensor([2.0, 3.0, 1.0]),
        state=torch.tensor([0, 0, 0]),
        task_group=torch.tensor([1, 1, 0]),
        traj=torch.tensor([10, 11, 0]),
        turn=torch.zeros(3, dtype=torch.long),
        fresh=torch.tensor([True, True, False]),
    )
    want, _ = mapo.advantages(oracle, cfg, step=1)
    assert_close(scored.adv, want[:2])
    assert scored.metrics["group/history_frac"] > 0 and len(scored.samples) == 2


def test_a_duplicate_the_buffer_drops_still_trains():
    """With dedup, an identical fresh sample is kept once as history but every fresh sample gets
    its advantage and enters the gradient (kitchen.steps, departure 1)."""
    cfg = mapo.preset("mapo", alpha={"kind": "constant", "alpha0": 1.0})
    buf = ReplayBuffer(BufferConfig(dedup=True))
    s = make(["s", "s", "s"], [1.0, 1.0, 4.0], tokens=[[7], [7], [8]])
    scored = advantages_for(s, cfg, buf)
    assert len(buf) == 2 and len(scored.samples) == 3
    assert scored.adv[0] == scored.adv[1] and scored.adv[0] < 0 < scored.adv[2]


def test_replayed_history_follows_the_fresh_samples():
    """replay_in_gradient: the scored samples are the fresh ones, then the history they replay
    (whole task groups), with their stored tokens and log-probs."""
    cfg = mapo.preset("mapo", replay_in_gradient=True)
    buf = ReplayBuffer(BufferConfig(max_age=4))
    advantages_for(make(["s", "u"], [1.0, 2.0], task="old", tokens=[[3, 4], [5]]), cfg, buf)
    fresh = make(["s"], [0.0], task="new", version=1)
    scored = advantages_for(fresh, cfg, buf, step=1)
    assert scored.fresh.tolist() == [True, False, False]
    assert scored.samples.state == ["s", "s", "u"]  # the task group of the matching record
    assert scored.samples.actions() == [[1], [3, 4], [5]]
    assert scored.adv.shape == (3,)


def test_clause_verdicts_travel_with_the_samples_to_the_advantage():
    """StepSamples carry [N, C] clause verdicts beside their weights; concat keeps them; the
    buffer-backed path gives `local_signal: clauses` the fresh rows' and the history's verdicts,
    the same numbers as a StepBatch built by hand."""
    nan = float("nan")
    w = torch.tensor([3.0, 1.0])
    a = make(["s", "s"], [1.0, 0.5])
    a.clauses, a.clause_weight = torch.tensor([[1.0, 1.0], [1.0, -1.0]]), w
    b = make(["s", "u"], [-1.0, 1.0], task="h", version=1)
    b.clauses, b.clause_weight = torch.tensor([[-1.0, nan], [1.0, nan]]), w
    both = StepSamples.concat([a, b])
    assert_close(both.clauses[2:], b.clauses, equal_nan=True)
    cfg = mapo.preset("mapo", local_signal="clauses", alpha={"kind": "constant", "alpha0": 1.0})
    buf = ReplayBuffer(BufferConfig())
    advantages_for(a, cfg, buf, step=0)
    scored = advantages_for(b, cfg, buf, step=1)
    by_hand = StepBatch(
        local_reward=torch.tensor([-1.0, 1.0, 1.0, 0.5]),
        global_reward=torch.zeros(4),
        ret=torch.tensor([-1.0, 1.0, 1.0, 0.5]),
        state=torch.tensor([0, 1, 0, 0]),
        task_group=torch.tensor([1, 1, 0, 0]),
        traj=torch.tensor([0, 1, 2, 3]),
        turn=torch.zeros(4, dtype=torch.long),
        fresh=torch.tensor([True, True, False, False]),
        clauses=torch.cat([b.clauses, a.clauses]),
        clause_weight=w,
    )
    want, _ = mapo.advantages(by_hand, cfg, step=1)
    assert_close(scored.adv, want[:2])
    assert scored.adv[0] < 0
    mixed = make(["s"], [0.0])
    mixed.clauses, mixed.clause_weight = torch.tensor([[1.0, 1.0]]), torch.tensor([1.0, 1.0])
    with pytest.raises(ValueError, match="differently"):
        StepSamples.concat([a, mixed])
    with pytest.raises(ValueError, match=r"\[1 samples, 3 clauses\]"):
        StepSamples(
            **{**vars(make(["s"], [0.0])), "clauses": torch.ones(1, 2), "clause_weight": [1, 1, 1]}
        )
    with pytest.raises(ValueError, match="both or neither"):
        StepSamples(**{**vars(make(["s"], [0.0])), "clauses": torch.ones(1, 2)})


def test_form_shares_travel_with_the_samples_to_the_advantage():
    """StepSamples carry each turn's form share and form code; concat keeps them; through the
    buffer, `form_clauses` judges the fresh rows' content against the history of the same form,
    the same numbers as a StepBatch built by hand."""
    a = make(["s", "s", "s"], [0.9, -0.5, 0.1])
    a.form_reward, a.form_key = torch.tensor([0.2, 0.2, -0.2]), torch.tensor([1, 1, 2])
    b = make(["s", "s"], [-0.3, 0.8], task="h", version=1)
    b.form_reward, b.form_key = torch.tensor([0.2, -0.2]), torch.tensor([1, 2])
    both = StepSamples.concat([a, b])
    assert both.form_key.tolist() == [1, 1, 2, 1, 2]
    cfg = mapo.preset("mapo", form_clauses=["T3"], alpha={"kind": "constant", "alpha0": 1.0})
    buf = ReplayBuffer(BufferConfig())
    advantages_for(a, cfg, buf, step=0)
    scored = advantages_for(b, cfg, buf, step=1)
    by_hand = StepBatch(
        local_reward=torch.tensor([-0.3, 0.8, 0.9, -0.5, 0.1]),
        global_reward=torch.zeros(5),
        ret=torch.tensor([-0.3, 0.8, 0.9, -0.5, 0.1]),
        state=torch.zeros(5, dtype=torch.long),
        task_group=torch.tensor([1, 1, 0, 0, 0]),
        traj=torch.arange(5),
        turn=torch.zeros(5, dtype=torch.long),
        fresh=torch.tensor([True, True, False, False, False]),
        form_reward=torch.tensor([0.2, -0.2, 0.2, 0.2, -0.2]),
        form_key=torch.tensor([1, 2, 1, 1, 2]),
    )
    want, _ = mapo.advantages(by_hand, cfg, step=1)
    assert_close(scored.adv, want[:2])
    plain, _ = mapo.advantages(by_hand, mapo.preset("mapo", alpha=cfg.alpha), step=1)
    assert not torch.allclose(want, plain)  # the form strata change the numbers
    with pytest.raises(ValueError, match="both or neither"):
        StepSamples(**{**vars(make(["s"], [0.0])), "form_reward": [0.1]})
    with pytest.raises(ValueError, match="1 entries each"):
        StepSamples(**{**vars(make(["s"], [0.0])), "form_reward": [0.1, 0.2], "form_key": [1, 1]})


def test_a_blocked_candidate_gets_no_global_advantage_and_leaves_the_others_as_they_were():
    """A candidate the guard blocked (`blocked`) did not make its episode's outcome: its global
    advantage is 0 and the played turns' global advantages are those of the batch without it;
    its local advantage still ranks it in its state group. The buffer keeps the flag."""
    played = make(
        ["s", "s", "u"], [1.0, 0.5, 1.0], traj=["t0", "t1", "t1"], outcome=[1.0, 0.0, 0.0]
    )
    blocked = make(["s"], [-1.0], traj=["t0"], outcome=[1.0], tokens=[[9]])
    blocked.blocked = torch.tensor([True])
    both = StepSamples.concat([played, blocked])
    assert both.blocked.tolist() == [False, False, False, True]
    grpo = mapo.PRESETS["grpo"]
    alone, _ = mapo.advantages(played.batch(), grpo)
    with_it, _ = mapo.advantages(both.batch(), grpo)
    assert_close(with_it[:3], alone)
    assert with_it[3] == 0 and alone.abs().sum() > 0
    cfg = mapo.preset("mapo", alpha={"kind": "constant", "alpha0": 0.5})
    buf = ReplayBuffer(BufferConfig())
    scored = advantages_for(both, cfg, buf)
    local_only = mapo.preset("mapo", alpha={"kind": "constant", "alpha0": 1.0})
    a_local, _ = mapo.advantages(both.batch(), local_only)
    assert_close(scored.adv[3], 0.5 * a_local[3])
    assert scored.adv[3] < 0
    assert buf.samples(buf.rows()).blocked.tolist() == [False, False, False, True]
