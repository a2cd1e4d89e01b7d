"""Evaluation metrics: judge-based reports, win rates with intervals, personalisation, reward gap."""

from __future__ import annotations

import pytest

from kitchen.evaluate import (
    EvalConfig,
    bootstrap_interval,
    compliance,
    eval_jobs,
    judged_scores,
    policy_report,
    reward_gap,
    win_rate,
)
from kitchen.judge import judge
from kitchen.scripted import IDEAL_QUIRKS, SFT_QUIRKS, episodes
from kitchen.world import load_split


def test_eval_jobs_are_heldout_and_deterministic():
    cfg = EvalConfig(tasks=12)
    jobs = eval_jobs(cfg)
    assert len(jobs) == 12 and eval_jobs(cfg) == jobs
    assert all(t.id.startswith("heldout") for t, _, _ in jobs)
    held = set(load_split("heldout"))
    assert len({pc.profile for _, pc, _ in jobs}) == len(held)


def test_win_rate_and_intervals():
    assert win_rate([2, 1, 1], [1, 1, 0], n=500)[0] == pytest.approx((1 + 0.5 + 1) / 3)
    mean, lo, hi = bootstrap_interval([0.0, 1.0] * 50, n=500)
    assert mean == 0.5 and lo < 0.5 < hi and hi - lo < 0.3


def test_ideal_beats_generic_and_is_more_personal():
    ideal = episodes(120, seed=9, quirks=IDEAL_QUIRKS)
    generic = episodes(120, seed=9, quirks=SFT_QUIRKS)
    ri = policy_report([t for t, _ in ideal], [pc for _, pc in ideal])
    rg = policy_report([t for t, _ in generic], [pc for _, pc in generic])
    assert ri.compliance > rg.compliance and ri.axiom_violations == 0
    assert ri.valid_actions == 1.0
    # a personal policy writes less to brief diners than to detailed ones; a generic one does not
    assert ri.personalisation["words/detailed"] - ri.personalisation["words/brief"] > 5
    assert (
        abs(rg.personalisation["words/detailed"] - rg.personalisation["words/brief"])
        < ri.personalisation["words/detailed"] - ri.personalisation["words/brief"]
    )
    assert ri.personalisation["small_talk_first/hurried"] == 0
    assert rg.personalisation["small_talk_first/hurried"] > 0
    si = judged_scores([t for t, _ in ideal], [pc for _, pc in ideal])
    sg = judged_scores([t for t, _ in generic], [pc for _, pc in generic])
    assert win_rate(si, sg, n=500)[1] > 0.5


def test_compliance_and_reward_gap():
    traj, pc = episodes(5, seed=1, quirks=SFT_QUIRKS)[0]
    r = judge(traj, pc)
    assert 0.0 <= compliance(r, pc) <= 1.0
    assert reward_gap([r], [r], [pc]) == 0.0
    generous = r.model_copy(
        update={
            "verdicts": [
                v.model_copy(update={"verdict": "pass"}) if v.verdict == "violate" else v
                for v in r.verdicts
            ]
        }
    )
    gap = reward_gap([generous], [r], [pc])
    assert gap >= 0.0 and (gap > 0) == bool(r.violations())
