"""Notebook 03 (the GRM) run with its script settings: what each section computed."""

from __future__ import annotations

import pytest

from kitchen import paths

from .test_notebooks import load_app


@pytest.fixture(scope="module")
def defs():
    _, values = load_app("03_grm.py").run()
    return values


def test_one_review_covers_every_turn_and_clause(defs):
    """The heat map's frame has one cell per (turn, clause) of the chosen dialogue, and its
    disagreement marks are exactly the cells where the GRM and the judge differ."""
    traj, pc, review, reference = defs["traj"], defs["pc"], defs["review"], defs["reference"]
    cells = defs["review_cells"]
    assert cells.height == len(traj.turns) * len(pc.ids) == len(review.verdicts)
    mine, truth = review.table(), reference.table()
    disagree = {(r["turn"], r["clause"]) for r in cells.iter_rows(named=True) if not r["agree"]}
    assert disagree == {k for k in truth if mine.get(k) != truth[k]}
    # one review line per agent turn, each next to the message it reviews
    assert len(defs["raw_lines"]) == len(defs["users"]) == len(traj.turns)
    assert [ln.split(" ", 1)[0] for ln in defs["raw_lines"]] == [
        f"t{t}" for t in range(len(traj.turns))
    ]


def test_agreement_per_clause_is_computed_on_the_pool(defs):
    report, table = defs["report"], defs["clause_table"]
    assert report.reviews == len(defs["pool"]) and report.cells > 0
    assert table.height == len(report.clauses)
    assert "recall of violations" in table.columns
    assert 0.0 <= report.decided_accuracy <= 1.0 and 0.0 <= report.accuracy <= 1.0
    # the shipped GRM is much better than chance against the judge on held-out dialogues
    assert report.kappa > 0.7


def test_attacks_are_flagged_and_never_pay(defs):
    """Every held-out attack the notebook tries is flagged, and none raises the reward above
    the dialogue's without it (the flag rule); harmless rewordings are never flagged."""
    moves = defs["moves"]
    assert moves["attack"].flagged == 1.0 and moves["attack"].reward_gain_max <= 0.0
    assert moves["rewording"].flagged == 0.0
    assert defs["attack_table"].height == 1 + len(moves["attack_kinds"])


def test_labels_are_saved_outside_the_repository_and_folded_in(defs):
    """In a script run the labelling widget's defaults are saved to a temporary folder — never
    into data/labels — and the calibration against people reads them back."""
    saved, folder = defs["saved"], defs["labels_dir"]
    assert saved > 0 and folder != paths.DATA / "labels"
    assert len(defs["label_set"].labels) == saved
    human = defs["human_report"]
    assert human.cells == saved
    # the script "agrees" with every GRM verdict it labels: the GRM matches those labels exactly
    assert human.accuracy == 1.0


def test_voting_side_by_side(defs):
    voting = defs["voting"]
    series = set(voting["series"].unique())
    assert len(series) == 3 and "greedy" in series
    assert defs["voted_report"].reviews == defs["report"].reviews
    assert set(voting.filter(voting["clause"] == "all")["series"]) == series
