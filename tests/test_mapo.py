"""MAPO's advantages and loss: hand-computed values, the peers' published conventions, gradients."""

from __future__ import annotations

import math
from statistics import mean, stdev

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch.testing import assert_close

from kitchen import mapo
from kitchen.mapo import (
    PRESETS,
    AdvantageConfig,
    AlphaSchedule,
    Norm,
    StepBatch,
    aggregate,
    alpha_at,
    global_advantages,
    group_normalize,
    kl_penalty,
    local_advantages,
    mapo_loss,
    mix,
    step_returns,
    truncated_is_weights,
)


def t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def g(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def outcome_batch(rewards: list[float], groups: list[int]) -> StepBatch:
    """Single-turn rollouts (one step each), as TRL and verl see GRPO: one row per completion."""
    n = len(rewards)
    r = torch.tensor(rewards)
    return StepBatch(
        local_reward=torch.zeros(n),
        global_reward=r,
        ret=torch.zeros(n),
        state=torch.arange(n),
        task_group=torch.tensor(groups),
        traj=torch.arange(n),
        turn=torch.zeros(n, dtype=torch.long),
    )


# ------------------------------------------------------------------------ group normalisation


def test_z_score_small_group_by_hand():
    """[1, 0, 0, 1, 1]: mean 0.6, Bessel std sqrt(0.3); advantages (r − 0.6) / (std + 1e-6)."""
    adv, stats = group_normalize(t(1, 0, 0, 1, 1), g(0, 0, 0, 0, 0))
    sd = math.sqrt(0.3)
    assert_close(adv, t(0.4, -0.6, -0.6, 0.4, 0.4) / (sd + 1e-6))
    assert stats.size.tolist() == [5] * 5 and stats.n_groups == 1
    assert_close(stats.std, torch.full((5,), sd, dtype=torch.float32))


def test_population_std_and_mean_only():
    """unbiased=False divides the variance by n; scale='none' only centres."""
    adv, _ = group_normalize(t(1, 3), g(7, 7), unbiased=False)
    assert_close(adv, t(-1, 1) / (1.0 + 1e-6))
    adv, _ = group_normalize(t(1, 3, 10), g(0, 0, 1), scale="none")
    assert_close(adv, t(-1, 1, 0))


def test_leave_one_out_baseline_by_hand():
    """RLOO: r_i minus the mean of the others; [1, 2, 3, 6] → 6 − 2 = 4, 1 − 11/3 = −8/3."""
    adv, _ = group_normalize(t(1, 2, 3, 6), g(0, 0, 0, 0), baseline="loo", scale="none")
    assert_close(adv, t(1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2))


def test_singletons_and_zero_variance_give_zero_and_are_flagged():
    """A group of one and a group of equal values both give advantage exactly 0."""
    adv, stats = group_normalize(t(5, 0.1, 0.1, 0.1, 2, 4), g(0, 1, 1, 1, 2, 2))
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert stats.singleton.tolist() == [True, False, False, False, False, False]
    assert stats.zero_var.tolist() == [False, True, True, True, False, False]
    assert_close(adv[4:], t(-1, 1) / (math.sqrt(2) + 1e-6))


def test_batch_scale_keeps_each_groups_spread():
    """scale='batch': centred in the group, divided by one std of the batch's live centred values.
    Groups [0, 2] and [0, 0.2] centre to ±1 and ±0.1; a singleton and an equal pair stay 0 and
    do not enter the spread (Bessel over the four live values: sqrt(2.02 / 3)). Under 'std' both
    pairs would be ±0.707: the wide group no longer pushes ten times as hard."""
    values, groups = t(0, 2, 0, 0.2, 5, 3, 3), g(0, 0, 1, 1, 2, 3, 3)
    adv, _ = group_normalize(values, groups, scale="batch")
    sd = math.sqrt((1 + 1 + 0.01 + 0.01) / 3)
    assert_close(adv, t(-1, 1, -0.1, 0.1, 0, 0, 0) / (sd + 1e-6))
    z, _ = group_normalize(values, groups)
    assert_close(z[0:2].abs(), z[2:4].abs())
    assert float(adv[1] / adv[3]) == pytest.approx(10.0)


def test_eps_inside_the_square_root():
    """eps_mode='var' is verl's masked_whiten: (x − mean) / sqrt(var + eps)."""
    adv, _ = group_normalize(t(0, 1), g(0, 0), eps=1e-8, eps_mode="var")
    assert_close(adv, t(-0.5, 0.5) / math.sqrt(0.5 + 1e-8))


def test_key_rows_group_on_every_column():
    """[N, 2] keys group on (a, b) pairs."""
    _, stats = group_normalize(t(1, 2, 3, 4), torch.tensor([[0, 0], [0, 1], [0, 0], [1, 1]]))
    assert stats.size.tolist() == [2, 1, 2, 1]


def test_non_finite_rewards_raise():
    """NaN or inf never silently turns into an advantage."""
    with pytest.raises(ValueError, match="value 1 is nan"):
        group_normalize(t(0, float("nan")), g(0, 0))
    with pytest.raises(ValueError, match="inf"):
        group_normalize(t(float("inf"), 0), g(0, 0))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40),
    st.randoms(use_true_random=False),
)
def test_z_scores_are_finite_for_any_finite_rewards(rewards, rnd):
    """Any finite float32 rewards in any grouping give finite z-scored advantages."""
    groups = torch.tensor([rnd.randrange(4) for _ in rewards])
    adv, _ = group_normalize(torch.tensor(rewards, dtype=torch.float32), groups)
    assert torch.isfinite(adv).all()
    adv, _ = group_normalize(torch.tensor(rewards, dtype=torch.float32), groups, baseline="loo")
    assert torch.isfinite(adv).all()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=2, max_size=40),
    st.randoms(use_true_random=False),
)
def test_z_scored_groups_have_zero_mean(rewards, rnd):
    """Within every group the z-scored advantages sum to zero (mean baseline)."""
    groups = torch.tensor([rnd.randrange(3) for _ in rewards])
    adv, stats = group_normalize(torch.tensor(rewards, dtype=torch.float64), groups)
    sums = torch.zeros(3, dtype=torch.float64).index_add_(0, groups, adv)
    assert_close(sums, torch.zeros(3, dtype=torch.float64), atol=1e-6, rtol=0)
    adv, _ = group_normalize(torch.tensor(rewards), groups, scale="none")
    assert torch.isfinite(adv).all()


# -------------------------------------------------------------------------------- returns


def test_discounted_returns_by_hand():
    """G_t = r_t + γ G_(t+1); padding gets 0; an outcome lands on the last real step."""
    r = t(1, 0, 2, 1, 1, 0).reshape(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = step_returns(r, 0.5, mask)
    assert_close(out, t(1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2, 1 + 0.5, 1, 0).reshape(2, 3))
    out = step_returns(r, 0.5, mask, outcome=t(10, 20))
    assert_close(out, t(1 + 0.25 * 12, 0.5 * 12, 12, 1 + 0.5 * 21, 21, 0).reshape(2, 3))
    assert_close(step_returns(r, 0.0, mask), r * mask)


def test_pad_steps_round_trip():
    """Flat rows in any order → [B, T] by trajectory and turn, and back."""
    vals = t(10, 11, 20, 12)
    traj, turn = g(1, 1, 2, 1), g(0, 1, 0, 2)
    padded, mask, row, col = mapo.pad_steps(vals, traj, turn)
    assert padded.tolist() == [[10, 11, 12], [20, 0, 0]]
    assert mask.sum().item() == 4
    assert_close(padded[row, col], vals)


# --------------------------------------------------------------------- local, global, the mix


def test_singleton_fallbacks():
    """A lone state takes 0, its turn group's advantage, or the batch's, as configured."""
    signal = t(1, 3, 5, 0)
    states = g(0, 0, 1, 2)  # rows 2 and 3 are alone in their state
    turns = g(0, 0, 1, 1)
    adv, stats = local_advantages(signal, states, singleton="zero")
    assert adv[2:].tolist() == [0.0, 0.0] and stats.singleton.tolist() == [0, 0, 1, 1]
    adv, _ = local_advantages(signal, states, singleton="turn", turn_groups=turns)
    assert_close(adv[2:], t(2.5, -2.5) / (math.sqrt(12.5) + 1e-6))
    adv, _ = local_advantages(signal, states, singleton="batch")
    sd = stdev([1, 3, 5, 0])
    assert_close(adv[2:], t(5 - 2.25, 0 - 2.25) / (sd + 1e-6))
    assert_close(adv[:2], t(-1, 1) / (math.sqrt(2) + 1e-6))  # non-singletons untouched


def test_global_advantage_per_trajectory_or_per_step():
    """'trajectory' counts each rollout once; 'step' weighs long rollouts more (GiGPO)."""
    outcome = t(1, 1, 1, 0)  # trajectory 0 has 3 steps, trajectory 1 has one
    traj, task = g(0, 0, 0, 1), g(0, 0, 0, 0)
    adv, _ = global_advantages(outcome, task, traj=traj, unit="trajectory")
    assert_close(adv, t(0.5, 0.5, 0.5, -0.5) / (math.sqrt(0.5) + 1e-6))
    adv, _ = global_advantages(outcome, task, unit="step")
    assert_close(adv, t(0.25, 0.25, 0.25, -0.75) / (0.5 + 1e-6))
    with pytest.raises(ValueError, match="differs between steps"):
        global_advantages(t(1, 0), g(0, 0), traj=g(0, 0))


def test_mix_convex_and_additive():
    """Convex: α·L + (1−α)·G; additive (GiGPO): G + ω·L."""
    loc, glo = t(1, -1), t(2, 0)
    assert_close(mix(loc, glo, 0.25), t(0.25 + 1.5, -0.25))
    assert_close(mix(loc, glo, 0.5, "additive"), t(2.5, -0.5))
    assert_close(mix(loc, glo, 0.0), glo)


def test_alpha_schedules():
    """Constant, linear and cosine schedules from α0 to α1, held after `steps`."""
    lin = AlphaSchedule(kind="linear", alpha0=0.2, alpha1=0.6, steps=100)
    cos = AlphaSchedule(kind="cosine", alpha0=0.2, alpha1=0.6, steps=100)
    assert alpha_at(0, lin) == pytest.approx(0.2)
    assert alpha_at(50, lin) == pytest.approx(0.4)
    assert alpha_at(25, cos) == pytest.approx(0.2 + 0.4 * (1 - math.cos(math.pi / 4)) / 2)
    assert alpha_at(50, cos) == pytest.approx(0.4)
    assert alpha_at(1000, lin) == alpha_at(1000, cos) == pytest.approx(0.6)
    assert alpha_at(7, AlphaSchedule(alpha0=0.3)) == 0.3


def test_mixed_alpha_by_hand():
    """advantages() with α = 0.5 averages the state-group and task-group advantages."""
    cfg = AdvantageConfig(local_signal="reward", alpha=AlphaSchedule(alpha0=0.5))
    batch = StepBatch(
        local_reward=t(1, 0, 4, 2),
        global_reward=t(1, 1, 0, 0),
        ret=torch.zeros(4),
        state=g(0, 0, 1, 1),
        task_group=g(0, 0, 0, 0),
        traj=g(0, 0, 1, 1),
        turn=g(0, 1, 0, 1),
    )
    adv, m = mapo.advantages(batch, cfg)
    loc = torch.cat([t(0.5, -0.5) / (math.sqrt(0.5) + 1e-6), t(1, -1) / (math.sqrt(2) + 1e-6)])
    glo = t(0.5, 0.5, -0.5, -0.5) / (math.sqrt(0.5) + 1e-6)
    assert_close(adv, 0.5 * loc + 0.5 * glo)
    assert m["alpha"] == 0.5 and m["group/local_size_mean"] == 2.0
    assert m["group/global_count"] == 1.0


def test_metrics_count_singletons_and_zero_variance_groups():
    """group/*_singleton_frac and *_zero_var_frac are fractions of groups; adv/* are moments."""
    cfg = AdvantageConfig(local_signal="reward", alpha=AlphaSchedule(alpha0=1.0))
    batch = StepBatch(
        local_reward=t(1, 1, 3, 7),
        global_reward=t(0, 0, 0, 0),
        ret=torch.zeros(4),
        state=g(0, 0, 1, 2),  # group 0: zero variance; groups 1, 2: singletons
        task_group=g(0, 0, 0, 0),
        traj=g(0, 1, 2, 3),
        turn=g(0, 0, 0, 0),
    )
    adv, m = mapo.advantages(batch, cfg)
    assert adv.tolist() == [0, 0, 0, 0]
    assert m["group/local_singleton_frac"] == pytest.approx(2 / 3)
    assert m["group/local_zero_var_frac"] == pytest.approx(1 / 3)
    assert "adv/global_mean" not in m  # α = 1 throughout: the global term is not computed
    cfg = cfg.model_copy(update={"alpha": AlphaSchedule(alpha0=0.5)})
    _, m = mapo.advantages(batch, cfg)
    assert m["group/global_zero_var_frac"] == 1.0
    assert {"adv/local_mean", "adv/local_std", "adv/global_mean", "adv/global_std"} <= set(m)
    _, m = mapo.advantages(batch, PRESETS["grpo"])
    assert "group/local_count" not in m and "group/global_count" in m


# ----------------------------------------------------------------- the peers, by definition


def test_grpo_matches_verl_definition():
    """verl compute_grpo_outcome_advantage: (r − mean) / (torch.std(r) + 1e-6) per uid."""
    rewards, groups = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 1.0], [0, 0, 0, 0, 1, 1, 1]
    adv, m = mapo.advantages(outcome_batch(rewards, groups), PRESETS["grpo"])
    expected = []
    for r, k in zip(rewards, groups, strict=True):
        members = [x for x, j in zip(rewards, groups, strict=True) if j == k]
        expected.append((r - mean(members)) / (stdev(members) + 1e-6))
    assert_close(adv, torch.tensor(expected))
    assert m["group/global_size_mean"] == 3.5


def test_grpo_matches_trl_definition():
    """TRL GRPOTrainer (scale_rewards='group'): (r − mean) / (nanstd(r) + 1e-4), Bessel."""
    rewards, groups = [0.2, 0.9, 0.4, 1.0], [0, 0, 0, 0]
    cfg = mapo.preset("grpo", global_norm={"eps": 1e-4})
    adv, _ = mapo.advantages(outcome_batch(rewards, groups), cfg)
    expected = [(r - mean(rewards)) / (stdev(rewards) + 1e-4) for r in rewards]
    assert_close(adv, torch.tensor(expected))


def test_dr_grpo_and_rloo_definitions():
    """Dr. GRPO: r − mean (no std). RLOO (verl vectorised): (n·r − Σr) / (n − 1)."""
    rewards, groups = [1.0, 0.0, 0.0, 3.0], [0, 0, 0, 0]
    adv, _ = mapo.advantages(outcome_batch(rewards, groups), PRESETS["dr_grpo"])
    assert_close(adv, torch.tensor([r - 1.0 for r in rewards]))
    adv, _ = mapo.advantages(outcome_batch(rewards, groups), PRESETS["rloo"])
    assert_close(adv, torch.tensor([(4 * r - 4.0) / 3 for r in rewards]))


def test_reinforce_pp_matches_verl_whitening():
    """REINFORCE++ (verl): γ = 1 returns of the outcome, whitened over the whole batch with
    (x − mean) * rsqrt(var_Bessel + 1e-8)."""
    cfg = PRESETS["reinforce_pp"]
    local = torch.zeros(3, 2)
    outcome = t(1, 0, 0)
    ret = mapo.returns_for(cfg, local, outcome)  # [3, 2]: the outcome on every step
    assert_close(ret, t(1, 1, 0, 0, 0, 0).reshape(3, 2))
    batch = StepBatch(
        local_reward=local.reshape(-1),
        global_reward=outcome.repeat_interleave(2),
        ret=ret.reshape(-1),
        state=torch.arange(6),
        task_group=g(0, 0, 0, 0, 1, 1),
        traj=g(0, 0, 1, 1, 2, 2),
        turn=g(0, 1, 0, 1, 0, 1),
    )
    adv, _ = mapo.advantages(batch, cfg)
    x = ret.reshape(-1).tolist()
    expected = [(v - mean(x)) / math.sqrt(stdev(x) ** 2 + 1e-8) for v in x]
    assert_close(adv, torch.tensor(expected))


def test_reinforce_pp_whitens_over_turns_not_tokens_as_documented():
    """mapo.py departure 5, its example: returns 1 and 0 on turns of 3 and 1 tokens. The preset
    whitens the two turns (±0.707); verl's token-level whitening would give +0.5 and −1.5."""
    cfg = PRESETS["reinforce_pp"]
    batch = StepBatch(
        local_reward=t(1, 0),
        global_reward=t(0, 0),
        ret=t(1, 0),
        state=g(0, 1),
        task_group=g(0, 0),
        traj=g(0, 0),
        turn=g(0, 1),
    )
    adv, _ = mapo.advantages(batch, cfg)
    assert_close(adv, t(1, -1) * 0.5 / math.sqrt(0.5 + 1e-8))
    tokens = t(1, 1, 1, 0)  # the same returns, one value per response token
    verl = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    assert_close(verl, t(0.5, 0.5, 0.5, -1.5), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(adv[0], verl[0])


def test_gigpo_matches_verl_agent_definition():
    """GiGPO (verl-agent core_gigpo.py, mean_std_norm, ω = 1, γ = 0.95):
    A = A_E + A_S. A_E: episode reward z-scored over every step row of the task group
    (torch.std, eps 1e-6). A_S: discounted step returns z-scored within (task group, anchor
    state); a lone anchor state gives 0."""
    cfg = PRESETS["gigpo"]
    # task group 0: trajectory A (2 steps, states s0 s1), B (2 steps, s0 s2), C (1 step, s0)
    local = torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    outcome = t(1, 0, 1)
    ret = mapo.returns_for(cfg, local, outcome, mask)
    assert_close(ret, t(0.5 + 0.95, 1, 0, 0, 1, 0).reshape(3, 2))
    rows = mask.reshape(-1).bool()
    batch = StepBatch(
        local_reward=local.reshape(-1)[rows],
        global_reward=outcome.repeat_interleave(2)[rows],
        ret=ret.reshape(-1)[rows],
        state=g(0, 1, 0, 2, 0),
        task_group=g(0, 0, 0, 0, 0),
        traj=g(0, 0, 1, 1, 2),
        turn=g(0, 1, 0, 1, 0),
    )
    adv, _ = mapo.advantages(batch, cfg)
    ep = [1, 1, 0, 0, 1]
    a_e = [(x - mean(ep)) / (stdev(ep) + 1e-6) for x in ep]
    s0 = [1.45, 0.0, 1.0]
    a_s0 = [(x - mean(s0)) / (stdev(s0) + 1e-6) for x in s0]
    a_s = [a_s0[0], 0.0, a_s0[1], 0.0, a_s0[2]]
    assert_close(adv, torch.tensor([e + s for e, s in zip(a_e, a_s, strict=True)]))


def test_mapo_paper_turn_and_batch_levels():
    """MAPO paper: 0.4 · z(return | task group, turn) + 0.6 · z(return | batch), γ = 0.85."""
    cfg = PRESETS["mapo_paper"]
    local = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    outcome = t(1, 0)
    ret = mapo.returns_for(cfg, local, outcome)
    assert_close(ret, t(1 + 0.85, 1, 0 + 0.85 * 2, 2).reshape(2, 2))
    batch = StepBatch(
        local_reward=local.reshape(-1),
        global_reward=outcome.repeat_interleave(2),
        ret=ret.reshape(-1),
        state=torch.arange(4),
        task_group=g(0, 0, 0, 0),
        traj=g(0, 0, 1, 1),
        turn=g(0, 1, 0, 1),
    )
    adv, _ = mapo.advantages(batch, cfg)
    x = ret.reshape(-1).tolist()
    batch_z = [(v - mean(x)) / (stdev(x) + 1e-6) for v in x]

    def pair_z(a, b):
        return [(a - b) / 2 / (stdev([a, b]) + 1e-6), (b - a) / 2 / (stdev([a, b]) + 1e-6)]

    turn0, turn1 = pair_z(x[0], x[2]), pair_z(x[1], x[3])
    turn_z = [turn0[0], turn1[0], turn0[1], turn1[1]]
    assert_close(
        adv, torch.tensor([0.4 * a + 0.6 * b for a, b in zip(turn_z, batch_z, strict=True)])
    )


def test_mapo_state_groups_span_task_groups_and_history():
    """The method's MAPO: one state group across task groups and buffer history; history rows only
    add statistics (they are not in the gradient by default)."""
    cfg = mapo.preset("mapo", alpha={"kind": "constant", "alpha0": 1.0})
    batch = StepBatch(
        local_reward=t(1, 0, 3, 2),
        global_reward=t(0, 0, 0, 0),
        ret=t(1, 0, 3, 2),
        state=g(5, 5, 5, 5),
        task_group=g(0, 1, 2, 3),
        traj=g(0, 1, 2, 3),
        turn=g(0, 0, 0, 0),
        fresh=torch.tensor([True, True, False, False]),
    )
    adv, m = mapo.advantages(batch, cfg)
    assert_close(adv, (t(1, 0, 3, 2) - 1.5) / (stdev([1, 0, 3, 2]) + 1e-6))
    assert m["group/history_frac"] == 0.5
    assert mapo.gradient_mask(batch, cfg).tolist() == [True, True, False, False]
    assert mapo.gradient_mask(batch, mapo.preset("mapo", replay_in_gradient=True)).all()


def test_every_preset_documents_its_source_and_runs():
    """Each preset names its source and gives finite advantages on a small multi-turn batch."""
    gen = torch.Generator().manual_seed(0)
    local = torch.randn(6, 3, generator=gen)
    outcome = (torch.rand(6, generator=gen) > 0.5).float()
    for name, cfg in PRESETS.items():
        assert cfg.name == name and len(cfg.source) > 40
        ret = mapo.returns_for(cfg, local, outcome)
        batch = StepBatch(
            local_reward=local.reshape(-1),
            global_reward=outcome.repeat_interleave(3),
            ret=ret.reshape(-1),
            state=torch.randint(4, (18,), generator=gen),
            task_group=torch.arange(6).repeat_interleave(3) // 3,
            traj=torch.arange(6).repeat_interleave(3),
            turn=torch.arange(3).repeat(6),
        )
        adv, m = mapo.advantages(batch, cfg, step=10)
        assert torch.isfinite(adv).all() and adv.shape == (18,)
        assert "adv/mixed_std" in m


def test_reads_local_reward_says_whether_the_per_turn_rewards_move_any_advantage():
    """For every preset, at the start and the end of its α schedule, and for an outcome-only
    MAPO, a local-only one and GRPO on step returns: the advantages change with the per-turn rewards
    (and the step returns made of them) exactly where `reads_local_reward` says they do."""
    gen = torch.Generator().manual_seed(1)
    outcome = (torch.rand(8, generator=gen) > 0.5).float()
    state = torch.randint(3, (24,), generator=gen)
    configs = dict(PRESETS)
    configs["mapo_outcome_only"] = mapo.preset("mapo", alpha=AlphaSchedule(alpha0=0.0))
    configs["local_only"] = mapo.preset("mapo", alpha=AlphaSchedule(alpha0=1.0))
    configs["grpo_on_returns"] = mapo.preset(  # α 0, but its global term sums per-turn rewards
        "grpo", gamma=1.0, global_signal="return", global_unit="step"
    )
    assert not configs["mapo_outcome_only"].reads_local_reward

    def adv(cfg, local, step):
        ret = mapo.returns_for(cfg, local, outcome)
        batch = StepBatch(
            local_reward=local.reshape(-1),
            global_reward=outcome.repeat_interleave(3),
            ret=ret.reshape(-1),
            state=state,
            task_group=torch.arange(8).repeat_interleave(3) // 4,
            traj=torch.arange(8).repeat_interleave(3),
            turn=torch.arange(3).repeat(8),
        )
        return mapo.advantages(batch, cfg, step=step)[0]

    a, b = torch.randn(8, 3, generator=gen), torch.randn(8, 3, generator=gen)
    readers = set()
    for name, cfg in configs.items():
        for step in (0, 10_000):
            if not torch.equal(adv(cfg, a, step), adv(cfg, b, step)):
                readers.add(name)
        assert (name in readers) == cfg.reads_local_reward, name
    assert {"grpo", "rloo", "dr_grpo", "mapo_outcome_only"}.isdisjoint(readers)
    assert {"mapo", "reinforce_pp", "gigpo", "local_only", "grpo_on_returns"} <= readers


def test_one_factor_changes_the_estimator_and_nothing_else():
    """one_factor(grpo, mapo) is grpo's advantage with mapo's state key and loss: on the same
    batch it gives grpo's advantages, and only the estimator fields differ from mapo."""
    base = mapo.preset("mapo", beta=0.02, state_key="abstract")
    arm = mapo.one_factor(PRESETS["grpo"], base)
    assert arm.loss_agg == "token-mean" != PRESETS["grpo"].loss_agg
    assert (arm.beta, arm.state_key) == (0.02, "abstract") and arm.name == "grpo"
    assert arm.loss_kwargs() == base.loss_kwargs()
    differ = {k for k in AdvantageConfig.model_fields if getattr(arm, k) != getattr(base, k)}
    assert differ and not differ & set(mapo.SHARED_FIELDS)
    assert {"alpha", "use_buffer", "singleton"} <= differ
    batch = outcome_batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    assert_close(mapo.advantages(batch, arm)[0], mapo.advantages(batch, PRESETS["grpo"])[0])


def test_describe_prints_what_each_preset_applies():
    """describe names the terms a preset uses, its groups, ε, mix and loss aggregation."""
    grpo = mapo.describe("grpo")
    assert "A_local  not used" in grpo and "A        = A_global" in grpo
    assert "std_k + 1e-06" in grpo and "seq-mean-token-mean" in grpo
    m = mapo.describe(mapo.preset("mapo", beta=0.02))
    assert "replay buffer" in m and "α from 0.2 to 0.5" in m and "0.02·k3" in m
    assert "A_global not used" in mapo.describe("reinforce_pp")
    assert "sqrt(var_g + 1e-08)" in mapo.describe("reinforce_pp")
    assert "A_global + α·A_local" in mapo.describe("gigpo")
    assert "mean of the others" in mapo.describe("rloo")
    clauses = mapo.describe(mapo.preset("mapo", local_signal="clauses"))
    assert "verdict on clause c" in clauses and "w_c the clause weights" in clauses
    lines = {name: mapo.describe(name) for name in PRESETS}
    assert len(set(lines.values())) == len(PRESETS)


def test_config_rejects_inconsistent_choices():
    """Validators say how to fix a bad combination."""
    with pytest.raises(ValidationError, match="mix 'additive'"):
        AdvantageConfig(alpha=AlphaSchedule(alpha0=1.5))
    with pytest.raises(ValidationError, match="global_unit: step"):
        AdvantageConfig(global_signal="return")
    with pytest.raises(ValidationError, match="use_buffer"):
        AdvantageConfig(replay_in_gradient=True)
    with pytest.raises(ValidationError, match="extra"):
        AdvantageConfig(alpah=0.3)
    with pytest.raises(KeyError, match="known: grpo"):
        mapo.preset("ppo")
    assert mapo.schema()["properties"]["alpha"]


# ------------------------------------------------------------------------------------ loss


def test_each_loss_aggregation_by_hand():
    """token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    loss = t(1, 2, 3, 4, 5, 6).reshape(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    # Dr. GRPO as TRL: Σ / (B · L); verl's own mode is B times this.
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(18 / 6)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 10).item() == pytest.approx(18 / 20)
    empty = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert aggregate(loss, empty, "seq-mean-token-mean").item() == pytest.approx(1.5)


def test_kl_estimators():
    """k1 = log π − log π_ref; k3 = e^d − d − 1 with d = log π_ref − log π (clamped on the exponential side)."""
    logp, ref = t(-1.0, -2.0, -30.0), t(-1.5, -1.0, -0.1)
    assert_close(kl_penalty(logp, ref, "k1"), logp - ref)
    d = ref - logp
    k3 = torch.exp(d) - d - 1
    assert_close(kl_penalty(logp, ref, "k3")[:2], k3[:2])
    assert kl_penalty(logp, ref, "k3")[2].item() == 10.0  # clamped
    assert kl_penalty(logp, ref, "k3", clamp=None)[2].item() > 1e8
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_kl_estimators_in_the_loss_follow_different_kls():
    """Differentiated through log π on tokens drawn from π (the expectation taken exactly over a
    six-token vocabulary), k2's gradient is the reverse KL's, k3's the forward KL's and k1's zero.
    The forward KL keeps the reference's tail: it pulls a suppressed token back up, k2 does not."""
    ref = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), 0)
    theta0 = torch.tensor([3.0, 0.5, 0.0, -2.0, -4.0, -3.0])  # tail tokens suppressed

    def grad(objective):
        theta = theta0.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, 0)
        objective(logp).backward()
        return theta.grad

    def expected(kind):  # E_{x~π}[k(x)], π's weights held fixed: what the loss averages
        return lambda logp: (logp.exp().detach() * kl_penalty(logp, ref, kind, None)).sum()

    reverse = grad(lambda logp: (logp.exp() * (logp - ref)).sum())
    forward = grad(lambda logp: (ref.exp() * (ref - logp)).sum())
    assert_close(grad(expected("k2")), reverse)
    assert_close(grad(expected("k3")), forward)
    assert_close(grad(expected("k1")), torch.zeros(6))
    # A descent step on k3 raises the suppressed tokens (3, 4) more than one on k2 does.
    assert (-grad(expected("k3"))[3:5] > -grad(expected("k2"))[3:5]).all()
    assert not torch.allclose(reverse, forward)


def test_kl_mean_reports_k3_whichever_estimator_the_loss_uses():
    """`kl/mean` — what the adaptive β reads — is k3's value for every estimator; the loss is not."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.4]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    reported = [
        mapo_loss(logp, adv, mask, ref_logp=ref, beta=0.1, kl=kind)[1]["kl/mean"]
        for kind in ("k1", "k2", "k3")
    ]
    assert reported[0] == pytest.approx(reported[2]) and reported[1] == pytest.approx(reported[2])
    loss_k2 = mapo_loss(logp, adv, mask, ref_logp=ref, beta=0.1, kl="k2")[0]
    loss_k3 = mapo_loss(logp, adv, mask, ref_logp=ref, beta=0.1, kl="k3")[0]
    assert loss_k2.item() != pytest.approx(loss_k3.item())


def test_k3_keeps_its_gradient_where_the_policy_drifted():
    """The clamp bounds only the exponential side (d > 0). A token the policy now prefers far
    more than the reference (d = −15, a drifted policy's sample) keeps k3 = −d − 1 = 14 and a
    gradient 1 − e^d ≈ 1 that pulls log π back down; clamped, it would have none."""
    logp = torch.tensor([-1.0, -16.0], requires_grad=True)
    ref = torch.tensor([-16.0, -1.0])  # d = −15 (drifted onto it), d = +15 (abandoned)
    k = kl_penalty(logp, ref, "k3")
    assert k[0].item() == pytest.approx(14.0, abs=1e-4) and k[1].item() == 10.0
    k.sum().backward()
    assert logp.grad[0].item() == pytest.approx(1.0, abs=1e-4)  # descent lowers log π
    assert logp.grad[1].item() == 0.0  # the clamped side: bounded value, no gradient


def test_adaptive_beta_follows_the_kl_within_bounds():
    """β ← max(β_0, β · clip(KL / target, ½, 2)): tighter when KL is high, back to β_0 when low."""
    assert mapo.adaptive_beta(0.02, 0.3, 0.15, 0.02) == pytest.approx(0.04)  # ratio 2
    assert mapo.adaptive_beta(0.02, 1.5, 0.15, 0.02) == pytest.approx(0.04)  # ratio 10, capped
    assert mapo.adaptive_beta(0.08, 0.12, 0.15, 0.02) == pytest.approx(0.064)  # loosened ×0.8
    assert mapo.adaptive_beta(0.08, 0.0, 0.15, 0.02) == pytest.approx(0.04)  # at most ×½
    assert mapo.adaptive_beta(0.03, 0.0, 0.15, 0.02) == pytest.approx(0.02)  # never below β_0
    assert mapo.adaptive_beta(0.05, math.nan, 0.15, 0.02) == 0.05
    beta, kls = 0.02, [0.3, 0.6, 0.6, 0.05, 0.05, 0.05]  # a drift, then back under the target
    trace = []
    for kl in kls:
        beta = mapo.adaptive_beta(beta, kl, 0.15, 0.02)
        trace.append(beta)
    assert trace == pytest.approx([0.04, 0.08, 0.16, 0.08, 0.04, 0.02])
    assert mapo.adaptive_beta(8.0, 5.0, 0.1, 0.02) == mapo.BETA_MAX  # never above the ceiling
    assert mapo.adaptive_beta(20.0, 5.0, 0.1, 20.0) == 20.0  # a β_0 above it stays the floor
    with pytest.raises(ValueError, match="set beta > 0"):
        mapo.AdvantageConfig(kl_target=0.1)
    assert "β adapts" in mapo.describe(mapo.preset("mapo", beta=0.02, kl_target=0.15))


def test_truncated_importance_weights():
    """Sequence level: min(Π ratio, cap); token level: min(ratio, cap); clipped flags."""
    logp = torch.log(t(0.5, 0.5, 0.9, 0.1)).reshape(2, 2)
    old = torch.log(t(0.25, 0.5, 0.9, 0.2)).reshape(2, 2)
    mask = torch.ones(2, 2)
    w, clipped = truncated_is_weights(logp, old, mask, cap=1.5)
    assert_close(w, t(1.5, 1.5, 0.5, 0.5).reshape(2, 2))
    assert clipped.tolist() == [True, False]
    w, clipped = truncated_is_weights(logp, old, mask, cap=1.5, level="token")
    assert_close(w, t(1.5, 1, 1, 0.5).reshape(2, 2))
    assert clipped.sum().item() == 1


def test_loss_gradient_is_the_reinforce_estimator():
    """On a softmax token policy, ∇ loss = −(1/B) Σ_b A_b (1/n_b) Σ_t (onehot(a_bt) − π)
    for seq-mean-token-mean: plain REINFORCE, no ratio, no clipping."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(5, generator=gen, requires_grad=True)
    tokens = torch.randint(5, (4, 3), generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = t(1.0, -0.5, 2.0, -1.0)
    logp = torch.log_softmax(theta, 0)[tokens]
    loss, m = mapo_loss(logp, adv, mask, agg="seq-mean-token-mean")
    loss.backward()
    pi = torch.softmax(theta.detach(), 0)
    expected = torch.zeros(5)
    for b in range(4):
        n = int(mask[b].sum())
        for k in range(n):
            expected -= adv[b] / n * (torch.nn.functional.one_hot(tokens[b, k], 5) - pi) / 4
    assert_close(theta.grad, expected)
    assert m["loss/pg"] == pytest.approx(loss.item())


def test_kl_term_and_importance_weights_in_the_gradient():
    """β·k3 adds β(1 − π_ref/π)∇log π per token; IS weights scale the policy term only."""
    theta = torch.tensor([0.3, -0.2], requires_grad=True)
    logp = torch.log_softmax(theta, 0)[torch.tensor([[0]])]  # [1, 1]
    ref = torch.tensor([[math.log(0.5)]])
    old = logp.detach() + math.log(2.0)  # the sample was twice as likely under the old policy
    loss, m = mapo_loss(
        logp, t(1.0), torch.ones(1, 1), ref_logp=ref, old_logp=old, beta=0.1, is_cap=1.0
    )
    loss.backward()
    pi = torch.softmax(theta.detach(), 0)
    dlogp = torch.tensor([1.0, 0.0]) - pi
    ratio = math.exp(ref.item() - logp.item())
    expected = -0.5 * dlogp + 0.1 * (1 - ratio) * dlogp
    assert_close(theta.grad, expected)
    assert m["is/clipped_frac"] == 0.0 and m["is/weight_mean"] == pytest.approx(0.5)
    assert m["kl/mean"] > 0


def test_clipped_surrogate_is_reinforce_where_the_policy_has_not_moved():
    """At π = π_old the clipped surrogate's gradient is REINFORCE's, term for term."""
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(6, generator=gen, requires_grad=True)
    tokens = torch.randint(6, (3, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    adv = t(1.5, -0.7, 0.3)

    def grad(**kw) -> torch.Tensor:
        theta.grad = None
        logp = torch.log_softmax(theta, 0)[tokens]
        loss, m = mapo_loss(logp, adv, mask, **kw)
        loss.backward()
        return theta.grad.clone(), m

    plain, _ = grad()
    old = torch.log_softmax(theta.detach(), 0)[tokens]
    clipped, m = grad(old_logp=old, clip=0.2)
    assert_close(clipped, plain)
    assert m["clip/frac"] == 0.0


def test_clip_stops_only_the_tokens_moved_past_eps_the_way_their_advantage_asks():
    """Token ratios 1.3, 1.1, 0.7, 1.3 under advantages +1, +1, −1, −1 with ε 0.2: the first
    (pushed up past 1.2) and the third (pushed down past 0.8) get no gradient; the second is
    within ε and the fourth moved against its advantage, so both get −A·ρ·∇log π."""
    logp = torch.zeros(4, 1, requires_grad=True)
    ratio = t(1.3, 1.1, 0.7, 1.3)
    old = -torch.log(ratio)[:, None]  # log π − log π_old = log ρ
    adv = t(1.0, 1.0, -1.0, -1.0)
    loss, m = mapo_loss(logp, adv, torch.ones(4, 1), old_logp=old, clip=0.2, agg="token-mean")
    loss.backward()
    expected = torch.tensor([0.0, -1.1, 0.0, 1.3]) / 4  # −A·ρ, over the token mean
    assert_close(logp.grad[:, 0], expected)
    assert m["clip/frac"] == pytest.approx(0.5)


def test_clip_is_shared_by_the_compared_arm_and_needs_the_old_log_probs_alone():
    """`one_factor` keeps the base's clip (the loss is not the factor compared); clip and
    replay's importance weights are two corrections for old samples, so both is an error, and
    clip without the log-probs of collection has nothing to clip against."""
    base = mapo.preset("mapo", clip=0.2)
    assert mapo.one_factor(mapo.preset("grpo"), base).clip == 0.2
    assert "clip(ρ, 0.8, 1.2)" in mapo.describe(base)
    with pytest.raises(ValueError, match="choose one"):
        mapo.preset("mapo", clip=0.2, replay_in_gradient=True)
    with pytest.raises(ValueError, match="give one"):
        mapo_loss(torch.zeros(1, 1), t(1.0), torch.ones(1, 1), clip=0.2, is_cap=1.0)
    with pytest.raises(ValueError, match="needs old_logp"):
        mapo_loss(torch.zeros(1, 1), t(1.0), torch.ones(1, 1), clip=0.2)


def test_loss_kwargs_follow_the_preset():
    """Dr. GRPO's preset aggregates like TRL's dr_grpo: Σ ℓ / (B · L)."""
    kw = mapo.preset("dr_grpo", norm_len=8).loss_kwargs()
    logp = torch.full((2, 4), -1.0)
    loss, _ = mapo_loss(logp, t(1.0, 2.0), torch.ones(2, 4), **kw)
    assert loss.item() == pytest.approx((4 * 1 + 4 * 2) / (2 * 8))


def test_norm_defaults_follow_verl():
    """The default normalisation is verl's GRPO one: mean, std, Bessel, eps 1e-6 on std."""
    n = Norm()
    assert (n.baseline, n.scale, n.unbiased, n.eps, n.eps_mode) == (
        "mean",
        "std",
        True,
        1e-6,
        "std",
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_advantages_and_loss_on_cuda_match_cpu():
    """Every preset's advantages and the loss run on CUDA tensors and equal the CPU results."""
    gen = torch.Generator().manual_seed(4)
    local = torch.randn(8, 3, generator=gen)
    outcome = (torch.rand(8, generator=gen) > 0.5).float()
    for cfg in PRESETS.values():
        ret = mapo.returns_for(cfg, local, outcome)
        cpu = StepBatch(
            local_reward=local.reshape(-1),
            global_reward=outcome.repeat_interleave(3),
            ret=ret.reshape(-1),
            state=torch.randint(5, (24,), generator=gen),
            task_group=torch.arange(8).repeat_interleave(3) // 4,
            traj=torch.arange(8).repeat_interleave(3),
            turn=torch.arange(3).repeat(8),
            fresh=torch.arange(24) < 18,
        )
        gpu = StepBatch(**{k: v.cuda() for k, v in vars(cpu).items() if v is not None})
        a_cpu, _ = mapo.advantages(cpu, cfg, step=5)
        a_gpu, _ = mapo.advantages(gpu, cfg, step=5)
        assert a_gpu.is_cuda
        assert_close(a_gpu.cpu(), a_cpu)
    logp = -torch.rand(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    kw = {"ref_logp": logp - 0.1, "old_logp": logp + 0.2, "beta": 0.05, "is_cap": 1.0}
    loss_cpu, _ = mapo_loss(logp, t(1, -1, 2, 0), mask, **kw)
    kw_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    loss_gpu, _ = mapo_loss(logp.cuda(), t(1, -1, 2, 0).cuda(), mask.cuda(), **kw_gpu)
    assert_close(loss_gpu.cpu(), loss_cpu)


def test_rows_without_local_signal_get_zero_local_advantage_and_stay_out_of_groups():
    """valid=False rows: A_local = 0, and the valid rows' groups are normalised without them."""
    from kitchen.mapo import StepBatch, advantages, preset

    cfg = preset("mapo", alpha={"kind": "constant", "alpha0": 1.0, "alpha1": 1.0})
    state = torch.tensor([0, 0, 0, 1])
    batch = StepBatch(
        local_reward=torch.tensor([1.0, 3.0, 100.0, 5.0]),
        global_reward=torch.zeros(4),
        ret=torch.tensor([1.0, 3.0, 100.0, 5.0]),
        state=state,
        task_group=torch.zeros(4, dtype=torch.long),
        traj=torch.arange(4),
        turn=torch.tensor([0, 0, 0, 1]),
        valid=torch.tensor([True, True, False, True]),
    )
    adv, metrics = advantages(batch, cfg)
    # group {1, 3}: mean 2, Bessel std sqrt(2); the 100 is not a member
    s = 2.0**0.5
    assert_close(adv[:2], torch.tensor([-1 / (s + 1e-6), 1 / (s + 1e-6)]))
    assert adv[2] == 0.0
    assert metrics["group/local_signal_frac"] == 0.75


# --------------------------------------------------------------------------------------------
# Decoupled clauses: each clause normalised in its group on its own


NAN = math.nan


def test_clause_advantages_by_hand():
    """Group 0: clause 0 (weight 3) reads +,+,−, clause 1 (weight 1) +,−,+; group 1: one clause
    applies, +/−. Each clause's Bessel z-score, their weighted mean, then unit population std."""
    s = t(1, 1, 1, -1, -1, 1, -1, NAN, 1, NAN).reshape(5, 2)
    a, metrics = mapo.clause_advantages(s, t(3, 1), g(0, 0, 0, 1, 1))
    hi, lo = 1 / math.sqrt(3), -2 / math.sqrt(3)  # z of [+1, +1, −1] (mean 1/3, std 2/√3)
    pair_ = 1 / math.sqrt(2)
    u = torch.tensor(
        [(3 * hi + hi) / 4, (3 * hi + lo) / 4, (3 * lo + hi) / 4, -pair_, pair_],
        dtype=torch.float64,
    )
    want = u / u.std(unbiased=False)
    assert_close(a, want.float(), atol=1e-6, rtol=1e-5)
    assert metrics["group/clause_signal_frac"] == 1.0


def test_one_varying_clause_gives_the_coupled_advantage_up_to_scale():
    """When a single clause varies (the others pass everywhere), decoupling changes nothing but
    the scale: the same signs and ratios as the z-score of the weighted-mean reward."""
    verdict = t(1, -1, -1, 1, 1, 1)
    s = torch.stack([verdict, torch.ones(6), torch.ones(6)], 1)
    w = t(3, 1, 2)
    a, _ = mapo.clause_advantages(s, w, g(0, 0, 0, 0, 1, 1))
    coupled, _ = local_advantages((s * w).sum(1) / w.sum(), g(0, 0, 0, 0, 1, 1))
    ratio = a[:4] / coupled[:4]
    assert_close(ratio, ratio[0].expand(4)) and ratio[0] > 0
    assert a[4:].tolist() == [0.0, 0.0]  # a group whose clauses never vary: no signal


def test_a_clause_that_varies_little_keeps_its_signal():
    """Eight answers to one state: A1 (weight 3) broken by half of them, T3 (weight 1) by one
    (which passes A1). Coupled, the T3 failure moves the advantage by a third of what an A1
    failure does — the weights' ratio; decoupled, by about half: each gap is in its own clause's
    standard deviations, and a rarer failure is more telling (T3's std √½, A1's √(8/7))."""
    a1 = t(1, 1, 1, 1, -1, -1, -1, -1)
    t3 = t(1, 1, 1, -1, 1, 1, 1, 1)
    s = torch.stack([a1, t3], 1)
    w = t(3, 1)
    groups = torch.zeros(8, dtype=torch.long)
    dec, _ = mapo.clause_advantages(s, w, groups)
    cou, _ = local_advantages((s * w).sum(1) / w.sum(), groups)

    def t3_over_a1(x):
        return float((x[0] - x[3]) / (x[0] - x[4]))  # T3's cost / A1's cost, same other verdicts

    assert t3_over_a1(cou) == pytest.approx(1 / 3, rel=1e-5)
    assert t3_over_a1(dec) == pytest.approx((1 / math.sqrt(0.5)) / (3 / math.sqrt(8 / 7)), rel=1e-5)


def test_clause_advantages_fall_back_per_clause_and_skip_steps_without_verdicts():
    """A lone state borrows its turn group's statistics clause by clause ('turn'); a step where no
    clause applies gets 0; bad shapes and weights are errors."""
    s = t(1, NAN, -1, NAN, 1, NAN, NAN, NAN).reshape(4, 2)
    a, metrics = mapo.clause_advantages(
        s, t(1, 1), g(0, 1, 2, 3), singleton="turn", turn_groups=g(9, 9, 9, 9)
    )
    assert a[0] > 0 > a[1] and a[2] > 0 and a[3] == 0
    zero, _ = mapo.clause_advantages(s, t(1, 1), g(0, 1, 2, 3))  # 'zero': lone states say nothing
    assert zero.tolist() == [0.0] * 4
    assert mapo.clause_advantages(s, t(1, 1), g(0, 1, 2, 3))[1]["group/clause_signal_frac"] == 0.0
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        mapo.clause_advantages(s, t(1, 1, 1), g(0, 1, 2, 3))
    with pytest.raises(ValueError, match="> 0"):
        mapo.clause_advantages(s, t(1, 0), g(0, 1, 2, 3))


def test_the_clause_signal_needs_per_turn_verdicts_and_its_own_reward():
    """local_signal 'clauses' is one turn's verdicts: a discounted return is refused at
    configuration time, and a batch without per-clause verdicts is a clear error."""
    with pytest.raises(ValidationError, match="gamma: 0"):
        mapo.preset("mapo", local_signal="clauses", gamma=0.9)
    cfg = mapo.preset("mapo", local_signal="clauses", use_buffer=False)
    batch = StepBatch(
        local_reward=t(1, 0),
        global_reward=t(1, 0),
        ret=t(1, 0),
        state=g(0, 0),
        task_group=g(0, 0),
        traj=g(0, 1),
        turn=g(0, 0),
    )
    with pytest.raises(ValueError, match="per-clause verdicts"):
        mapo.advantages(batch, cfg)
    batch.clauses, batch.clause_weight = t(1, -1).reshape(2, 1), t(2)
    adv, metrics = mapo.advantages(batch, cfg)
    assert adv[0] > adv[1] and "group/clause_signal_frac" in metrics


# --------------------------------------------------------------------------------------------
# Form credit: content compared among turns of the same form


def test_form_judged_by_hand():
    """State 0 holds two short turns (form share +0.2, strata 1) and three long ones (−0.1,
    strata 2); content is compared inside each form, the form share against the whole state.
    State 1's lone turn keeps its reward (no other turn of its form)."""
    r = t(0.2, -0.8, 0.9, 0.9, -0.1, 0.5)
    f = t(0.2, 0.2, -0.1, -0.1, -0.1, 0.5)
    state, form = g(0, 0, 0, 0, 0, 1), g(1, 1, 2, 2, 2, 7)
    out = mapo.form_judged(r, f, state, form)
    c = r - f
    short_c, long_c, all_c = c[:2].mean(), c[2:5].mean(), c[:5].mean()
    want = torch.cat([r[:2] - (short_c - all_c), r[2:5] - (long_c - all_c), r[5:]])
    assert_close(out, want)
    centred = out[:5] - out[:5].mean()
    assert_close(
        centred, (f[:5] - f[:5].mean()) + (c[:5] - torch.cat([short_c.expand(2), long_c.expand(3)]))
    )


def test_a_form_is_credited_by_its_own_clauses_only():
    """Short turns pass the form clause (+1 share) but skip a check more often (content −1 in 3
    of 4) than long ones (1 of 4): in the plain local advantage the short form earns less than
    the long one; judged within form, it earns exactly what its clause says, and a skipped
    check still costs inside each form."""
    f = t(*[0.25] * 4, *[-0.25] * 4)
    c = t(-0.75, -0.75, -0.75, 0.75, -0.75, 0.75, 0.75, 0.75)
    r, state, form = f + c, torch.zeros(8, dtype=torch.long), g(*[1] * 4, *[2] * 4)
    plain, _ = local_advantages(r, state)
    judged, _ = local_advantages(mapo.form_judged(r, f, state, form), state)
    assert plain[:4].mean() < plain[4:].mean()
    assert judged[:4].mean() > judged[4:].mean()
    assert_close(judged[:4].mean(), -judged[4:].mean())  # only the form share is left between them
    assert judged[3] > judged[0] and judged[7] > judged[4]  # a kept check still pays


def test_form_clauses_need_a_turns_own_reward_and_their_shares():
    """form_clauses split one turn's reward: 'clauses', a discounted return and a doubled clause
    are configuration errors; a batch without form shares is a clear error; with them, the
    advantage is the plain one on the adjusted signal; `describe` shows the split."""
    for bad, match in (
        ({"local_signal": "clauses"}, "local_signal 'reward'"),
        ({"gamma": 0.9}, "local_signal 'reward'"),
        ({"form_clauses": ["T3", "T3"]}, "twice"),
    ):
        with pytest.raises(ValidationError, match=match):
            mapo.preset("mapo", **({"form_clauses": ["T3"]} | bad))
    cfg = mapo.preset(
        "mapo", form_clauses=["T3"], use_buffer=False, alpha={"kind": "constant", "alpha0": 1.0}
    )
    batch = StepBatch(
        local_reward=t(1.0, -1.0, 0.5, 0.0),
        global_reward=t(0, 0, 0, 0),
        ret=t(1.0, -1.0, 0.5, 0.0),
        state=g(0, 0, 0, 0),
        task_group=g(0, 0, 0, 0),
        traj=g(0, 1, 2, 3),
        turn=g(0, 0, 0, 0),
    )
    with pytest.raises(ValueError, match="form share"):
        mapo.advantages(batch, cfg)
    batch.form_reward, batch.form_key = t(0.5, 0.5, -0.5, -0.5), g(1, 1, 2, 2)
    adv, _ = mapo.advantages(batch, cfg)
    want, _ = local_advantages(
        mapo.form_judged(batch.ret, batch.form_reward, batch.state, batch.form_key), batch.state
    )
    assert_close(adv, want)
    text = mapo.describe(cfg)
    assert "share of T3" in text and "x'" in text
    assert "share of" not in mapo.describe("mapo")
