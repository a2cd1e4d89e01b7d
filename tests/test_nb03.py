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
    assert "verdicts:" in defs["raw_review"]


def test_agreement_per_clause_is_computed_on_the_pool(defs):
    report, table = defs["report"], defs["clause_table"]
    assert report.reviews == len(defs["pool"]) and report.cells > 0
    assert table.height == len(report.clauses)
    assert 0.0 <= report.decided_accuracy <= 1.0 and 0.0 <= report.accuracy <= 1.0
    # the shipped GRM is much better than chance against the judge on held-out dialogues
    assert report.kappa > 0.5


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
