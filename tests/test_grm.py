"""The GRM at work: review conversations on the engine and on `generate`, structure, windows,
budgets, flags, cascade and voting (kitchen.grm). The shipped GRM's quality is measured by
`kitchen grm calibrate` (tests/test_calibrate.py); here any causal LM will do, so the shipped
policy stands in for a reviewer where only the plumbing is under test."""

from __future__ import annotations

import pytest

from kitchen import paths
from kitchen.critique import parse_review
from kitchen.grm import GRM, GRMConfig, LineStart, merge_cascade, verdict_tensor
from kitchen.grmdata import pool
from kitchen.injection import attacks, message_turns, with_text
from kitchen.judge import judge
from kitchen.models import ModelSpec, load_model


@pytest.fixture(scope="module")
def stand_in():
    """The shipped tiny policy, as a model that writes *something* in every line."""
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def dialogues():
    return [
        (t, pc) for t, pc, _ in pool(6, "heldout", 21, {"grm": 0.5, "sft": 0.5}, long_share=0.5)
    ]


def _lines(review):
    return sorted({v.turn for v in review.verdicts})


def test_line_start_forces_the_marker_and_nothing_else():
    vocab = ["t", "1", "2", "t1", " ", "t12", "x", "1 "]
    ls = LineStart(vocab)
    allowed = {vocab[i] for i in ls.allowed("t12 ", "")}
    assert allowed == {"t", "t1", "t12"}
    assert {vocab[i] for i in ls.allowed("t12 ", "t1")} == {"2"}
    assert ls.allowed("t12 ", "t12 ") is None  # the marker is written: the rest is free
    assert ls.allowed("t12 ", "t13") is None  # diverged (only without the constraint): free


def test_every_turn_gets_one_structured_line_on_both_paths(stand_in, dialogues):
    """With structure on, each turn's line starts with its marker, so every turn is judged
    exactly once; the engine and `generate` write the same greedy lines."""
    model, tok = stand_in
    trajs, pcs = [t for t, _ in dialogues], [pc for _, pc in dialogues]
    cfg = GRMConfig(max_new_tokens=24, batch_size=4)
    fast = GRM(model, tok, cfg)
    slow = GRM(model, tok, cfg.model_copy(update={"engine": "generate"}))
    a, b = fast.review(trajs, pcs), slow.review(trajs, pcs)
    for ra, rb, t in zip(a, b, trajs, strict=True):
        assert ra.turns == len(t.turns) and _lines(ra) == list(range(len(t.turns)))
        assert [v.reason for v in ra.verdicts] == [v.reason for v in rb.verdicts]
        assert ra.table() == rb.table()
    assert fast.stats["lines"] == sum(len(t.turns) for t in trajs)


def test_a_line_cut_by_its_budget_is_masked_and_flagged(stand_in, dialogues):
    model, tok = stand_in
    (traj, pc), *_ = dialogues
    r = GRM(model, tok, GRMConfig(max_new_tokens=8)).review([traj], [pc])[0]
    cut = [f for f in r.flags if f.endswith("review budget")]
    assert cut, "an 8-token budget cuts the stand-in's lines"
    for f in cut:
        t = int(f.split(":")[0][1:])
        assert all(v.verdict is None for v in r.verdicts if v.turn == t)


def test_long_dialogues_are_reviewed_in_windows_covering_every_turn(stand_in, dialogues):
    model, tok = stand_in
    traj, pc = max(dialogues, key=lambda x: len(x[0].turns))
    assert len(traj.turns) > 6
    grm = GRM(model, tok, GRMConfig(max_new_tokens=16, max_window_turns=4))
    r = grm.review([traj], [pc])[0]
    assert _lines(r) == list(range(len(traj.turns)))
    assert grm.stats["lines"] == len(traj.turns)


def test_flags_come_from_the_rule_not_the_reviewer(stand_in, dialogues):
    model, tok = stand_in
    traj, pc = next((t, p) for t, p in dialogues if message_turns(t))
    attacked = with_text(traj, message_turns(traj)[0], attacks("heldout")[0].text)
    r = GRM(model, tok, GRMConfig(max_new_tokens=24)).review([attacked], [pc])[0]
    assert any(f.startswith(f"t{message_turns(traj)[0]}:") for f in r.flags)


def test_cascade_takes_the_rule_verdicts_and_skips_the_grm_when_nothing_is_left(
    stand_in, dialogues
):
    model, tok = stand_in
    traj, pc = dialogues[0]
    ref = judge(traj, pc)
    some = GRM(model, tok, GRMConfig(max_new_tokens=24, cascade=["A1", "T3"])).review([traj], [pc])[
        0
    ]
    for v in some.verdicts:
        if v.clause in ("A1", "T3"):
            assert v.verdict == ref.get(v.turn, v.clause).verdict
    every = GRM(model, tok, GRMConfig(cascade=list(pc.ids)))
    r = every.review([traj], [pc])[0]
    assert r.table() == ref.table() and every.stats["lines"] == 0


def test_merge_cascade_keeps_the_grm_elsewhere():
    grm = parse_review(["t0 chat => A2- T3+"], turns=[0], clauses=["A2", "T3"])
    rule = parse_review(["t0 chat => A2+ T3-"], turns=[0], clauses=["A2", "T3"])
    merged = merge_cascade(grm, rule, ["A2"])
    assert merged.table() == {(0, "A2"): "pass", (0, "T3"): "pass"} and merged.source == "cascade"


def test_sampled_reviews_are_voted_and_repeatable(stand_in, dialogues):
    model, tok = stand_in
    trajs, pcs = [t for t, _ in dialogues[:2]], [pc for _, pc in dialogues[:2]]
    cfg = GRMConfig(max_new_tokens=24, samples=3, temperature=1.0, seed=5)
    grm, twin = GRM(model, tok, cfg), GRM(model, tok, cfg)
    voted, samples = grm.review_with_samples(trajs, pcs)
    again, _ = twin.review_with_samples(trajs, pcs)
    assert [r.table() for r in voted] == [r.table() for r in again]
    assert grm.last_text == twin.last_text  # seeded: the same lines
    assert all(len(s) == 3 for s in samples)
    assert len(set(grm.last_text[0])) > 1  # the samples differ


def test_verdict_tensor_codes():
    r = parse_review(["t0 x => A1+ T3-", None], turns=range(2), clauses=["A1", "T3", "T5"])
    t = verdict_tensor([r], ["A1", "T3", "T5"])
    assert t.shape == (1, 2, 3)
    assert t[0, 0].tolist() == [1.0, -1.0, 0.0] and t[0, 1].isnan().all()
