"""Run reports: one self-contained HTML file per run, with its curves, evaluations and a dialogue."""

from __future__ import annotations

from html import escape

import polars as pl
import pytest
import yaml

from kitchen import report, scripted
from kitchen.config import KitchenError
from kitchen.evaluate import policy_report
from kitchen.files import write_jsonl
from kitchen.judge import judge
from kitchen.train import RewardConfig, episode_rewards
from kitchen.world import render_transcript


@pytest.fixture
def run_folder(tmp_path):
    """A run folder as `kitchen cook` writes it: metrics, one evaluation, one logged dialogue."""
    folder = tmp_path / "tiny-run"
    folder.mkdir()
    eps = scripted.episodes(3, seed=2)
    trajs, pcs = [t for t, _ in eps], [pc for _, pc in eps]
    reviews = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    pl.DataFrame(
        {
            "iteration": [0, 1, 2],
            "reward/global_mean": [0.2, 0.4, 0.5],
            "reward/local_mean": [0.1, 0.2, 0.3],
            "judge/compliance": [0.7, 0.75, 0.8],
            "judge/A1_pass_rate": [0.9, 0.95, 1.0],
            "clause/A1_pass_rate": [0.8, 0.9, 1.0],
            "kl/mean": [0.0, 0.01, 0.02],
            "reward/gap_grm_minus_judge": [0.0, 0.05, 0.1],
        }
    ).write_parquet(folder / "metrics.parquet")
    rep = policy_report(trajs, pcs, reviews)
    write_jsonl(folder / "eval.jsonl", [{"iteration": 2, **rep.model_dump(mode="json")}])
    rw = episode_rewards(trajs, reviews, pcs, RewardConfig(reviewer="judge"))[0]
    row = {
        "iteration": 2,
        "trajectory": trajs[0].model_dump(mode="json"),
        "review": reviews[0].model_dump(mode="json"),
        "local": rw.local,
        "valid": rw.valid,
        "contributions": rw.contributions,
    }
    write_jsonl(folder / "samples.jsonl", [row])
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"name": "tiny-run", "seed": 7}))
    return folder, trajs[0], reviews[0], rep, (rw.local, rw.valid)


def test_run_report_is_one_offline_file_with_every_section(run_folder):
    """The report holds the run's charts as inline SVG (no script, nothing to fetch), the
    evaluation table, the last logged dialogue with its violations, and the recipe."""
    folder, traj, review, rep, local = run_folder
    path = report.run_report(folder)
    assert path == folder / "report.html"
    html = path.read_text()
    assert "<script" not in html and 'src="http' not in html and 'href="http' not in html
    assert html.count("<svg") >= 8  # rewards, clauses ×2, advantages, KL, groups, speed, gap
    for title in ("tiny-run: rewards", "held-out evaluation", "a dialogue from iteration 2"):
        assert title in html
    assert f"<td>{rep.compliance:.3f}</td>" in html
    assert escape(render_transcript(traj)) in html
    rewards = ", ".join(
        f"t{t}: {r:+.2f}" if ok else f"t{t}: -"
        for t, (r, ok) in enumerate(zip(*local, strict=True))
    )
    assert f"local rewards per turn: {rewards}" in html
    violations = [v for v in review.verdicts if v.verdict == "violate"]
    if violations:
        assert f"t{violations[0].turn} {violations[0].clause}" in html
    assert "seed: 7" in html


def test_html_is_escaped_and_numbers_formatted(tmp_path):
    """Table cells and prose are escaped; floats print with three decimals, None as empty."""
    s = (
        report.Section("<b>title</b>")
        .text("a < b & c")
        .table(pl.DataFrame({"x": [0.123456, None], "name": ["<i>", "ok"]}))
    )
    path = report.write_html(tmp_path / "r.html", "T & <T>", [s], intro="why")
    html = path.read_text()
    assert "<b>title</b>" not in html and "&lt;b&gt;title&lt;/b&gt;" in html
    assert "a &lt; b &amp; c" in html and "<td>0.123</td>" in html and "<td></td>" in html
    assert "&lt;i&gt;" in html and "<title>T &amp; &lt;T&gt;</title>" in html


def test_a_folder_without_metrics_is_a_located_error(tmp_path):
    with pytest.raises(KitchenError, match="no metrics.parquet; give a run folder"):
        report.run_report(tmp_path)


def test_metrics_of_nothing_read_no_data(tmp_path):
    """A run whose rates were over nothing (NaN in the metrics, null in eval.jsonl) reports
    "no data" in its table and charts — never nan, and never a perfect 1.000."""
    folder = tmp_path / "empty-run"
    folder.mkdir()
    nan = float("nan")
    pl.DataFrame(
        {
            "iteration": [0, 1],
            "reward/global_mean": [0.0, 0.0],
            "judge/compliance": [nan, nan],
            "reward/local_mean": [nan, nan],
        }
    ).write_parquet(folder / "metrics.parquet")
    row = {"iteration": 1, "success": 0.0, "compliance": None, "axiom_violations": 0}
    write_jsonl(folder / "eval.jsonl", [row | {"valid_actions": None}])
    html = report.run_report(folder).read_text()
    assert "<td>no data</td>" in html and ">nan<" not in html.lower()
    assert "<td>1.000</td>" not in html
    assert html.count(">no data<") >= 3  # two table cells and the all-NaN clause charts
    assert report._fmt(nan) == "no data" and report._fmt(None) == ""
