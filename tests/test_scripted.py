"""Scripted agents: generic SFT dialogues, and GRM data that breaks every clause."""

from __future__ import annotations

import collections

from kitchen.files import read_jsonl
from kitchen.judge import judge
from kitchen.scripted import GRM_QUIRKS, IDEAL_QUIRKS, SFT_QUIRKS, episodes, write_sft_data


def violation_counts(eps):
    counts = collections.Counter()
    for traj, pc in eps:
        for v in judge(traj, pc).violations():
            counts[v.clause] += 1
    return counts


def test_sft_agent_is_competent_but_generic():
    """Mostly successful, yet it breaks the personal theorems; it never breaks the red lines."""
    eps = episodes(200, seed=1, quirks=SFT_QUIRKS)
    success = sum(t.outcome.success for t, _ in eps) / len(eps)
    assert success > 0.8
    counts = violation_counts(eps)
    assert {"T1", "T3", "T4", "T5", "T6"} <= set(counts)
    assert counts["A2"] == counts["A3"] == counts["A4"] == 0


def test_grm_agent_breaks_every_clause():
    counts = violation_counts(episodes(300, seed=2, quirks=GRM_QUIRKS))
    assert set(counts) >= {"A1", "A2", "A3", "A4", "T1", "T2", "T3", "T4", "T5", "T6", "T7"}, counts


def test_ideal_agent_succeeds():
    eps = episodes(100, seed=3, quirks=IDEAL_QUIRKS)
    assert sum(t.outcome.success for t, _ in eps) / len(eps) > 0.9


def test_episodes_are_deterministic_and_split():
    a = [t.messages for t, _ in episodes(20, seed=4)]
    assert a == [t.messages for t, _ in episodes(20, seed=4)]
    held = episodes(20, split="heldout", seed=4)
    assert all(t.task.id.startswith("heldout") for t, _ in held)


def test_write_sft_data(tmp_path):
    stats = write_sft_data(str(tmp_path), n_train=30, n_eval=10, seed=5)
    rows = list(read_jsonl(tmp_path / "train.jsonl"))
    assert len(rows) == 30 == stats["train"]["dialogues"]
    roles = {m["role"] for r in rows for m in r["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert all(set(m) == {"role", "content"} for r in rows for m in r["messages"])
    assert len(list(read_jsonl(tmp_path / "eval.jsonl"))) == 10
