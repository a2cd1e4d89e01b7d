"""Charts: the frames they are drawn from, the row limit they must respect, offline rendering."""

from __future__ import annotations

import math

import polars as pl

from kitchen import charts, scripted
from kitchen.judge import judge
from kitchen.report import chart_svg
from kitchen.review import ClauseVerdict


def rows_of(chart) -> list[int]:
    """Rows in each dataset a chart spec carries (what the renderer receives)."""
    return [len(v) for v in chart.to_dict().get("datasets", {}).values()]


def test_downsample_keeps_every_kth_row_under_the_limit():
    df = pl.DataFrame({"i": range(12_001)})
    small = charts.downsample(df, 5000)
    assert small.height <= 5000 and small["i"][0] == 0
    step = small["i"][1] - small["i"][0]
    assert step == 3 and (small["i"].diff().drop_nulls() == step).all()
    assert charts.downsample(df.head(10), 5000).height == 10


def test_long_run_logs_chart_under_altairs_row_limit_and_render_offline():
    """A 6,000-iteration log is thinned before charting and renders to SVG without a network;
    metrics a run did not log are left out, nulls dropped."""
    m = pl.DataFrame(
        {
            "iteration": range(6000),
            "reward/global_mean": [i / 6000 for i in range(6000)],
            "kl/mean": [None] * 3000 + [0.1] * 3000,
        }
    )
    long = charts.long_metrics(m, ["reward/global_mean", "kl/mean", "never/logged"])
    assert set(long["metric"]) == {"reward/global_mean", "kl/mean"}
    assert long.height == 6000 + 3000  # the kl nulls dropped
    chart = charts.run_curves(m, ["reward/global_mean", "kl/mean", "never/logged"])
    assert max(rows_of(chart)) <= charts.MAX_ROWS
    svg = chart_svg(chart)
    assert svg.lstrip().startswith("<svg") and 'href="http' not in svg  # nothing to fetch


def test_sample_efficiency_thins_each_curve_and_keeps_its_last_point():
    n = 6000
    curves = pl.DataFrame(
        {
            "preset": ["grpo"] * n + ["mapo"] * n,
            "horizon": [8] * (2 * n),
            "episodes": list(range(n)) * 2,
            "success": [i / n for i in range(n)] * 2,
            "low": [0.0] * (2 * n),
            "high": [1.0] * (2 * n),
        }
    )
    chart = charts.sample_efficiency(curves, target=0.6)
    data = next(iter(chart.to_dict()["datasets"].values()))
    assert len(data) <= charts.MAX_ROWS
    last = {(r["preset"], r["episodes"]) for r in data}
    assert ("grpo", n - 1) in last and ("mapo", n - 1) in last


def test_samples_to_target_draws_a_miss_at_the_budget():
    table = pl.DataFrame(
        {
            "preset": ["grpo", "mapo"],
            "horizon": [24, 24],
            "median_episodes": [math.inf, 296.0],
            "reached": [0.4, 1.0],
            "budget": [16000, 16000],
            "vs_grpo": [math.nan, 0.02],
            "bound": [False, True],
        }
    )
    data = next(iter(charts.samples_to_target(table).to_dict()["datasets"].values()))
    by = {r["preset"]: r for r in data}
    assert by["grpo"]["shown"] == 16000 and by["grpo"]["within_budget"] is False
    assert by["mapo"]["shown"] == 296.0 and by["mapo"]["within_budget"] is True
    assert "vs_grpo" not in by["mapo"]


def test_review_frame_marks_masked_cells_and_disagreements():
    traj, pc = scripted.episodes(1, seed=3)[0]
    ref = judge(traj, pc)
    applied = [v for v in ref.verdicts if v.verdict in ("pass", "violate")]
    flipped, masked = applied[0], applied[1]
    other = ref.model_copy(
        update={
            "verdicts": [
                ClauseVerdict(
                    turn=v.turn,
                    clause=v.clause,
                    verdict=(
                        None
                        if v is masked
                        else ("violate" if v.verdict == "pass" else "pass")
                        if v is flipped
                        else v.verdict
                    ),
                    reason=v.reason,
                )
                for v in ref.verdicts
            ]
        }
    )
    frame = charts.review_frame(other, ref)
    assert frame.height == len(ref.verdicts)
    assert frame.filter(~pl.col("agree")).height == 2
    cell = frame.filter((pl.col("turn") == masked.turn) & (pl.col("clause") == masked.clause))
    assert cell["verdict"][0] == "masked" and cell["reference"][0] == masked.verdict
    assert charts.review_frame(ref)["agree"].all()  # no reference: nothing to disagree with
    assert chart_svg(charts.review_heatmap(other, ref)).lstrip().startswith("<svg")


def test_compare_runs_skips_runs_without_the_metric():
    a = pl.DataFrame({"episodes": [32, 64], "judge/compliance": [0.7, 0.8]})
    b = pl.DataFrame({"episodes": [32, 64], "reward/global_mean": [0.1, 0.2]})
    data = next(
        iter(
            charts.compare_runs({"a": a, "b": b}, "judge/compliance").to_dict()["datasets"].values()
        )
    )
    assert {r["run"] for r in data} == {"a"} and [r["value"] for r in data] == [0.7, 0.8]
    empty = charts.compare_runs({"b": b}, "judge/compliance")
    assert chart_svg(empty).lstrip().startswith("<svg")


def test_turn_advantages_shows_at_most_the_first_episodes():
    frame = pl.DataFrame(
        {
            "episode": [f"ep{i // 2}" for i in range(20)],
            "turn": [i % 2 for i in range(20)],
            "mapo": [0.1 * i for i in range(20)],
            "grpo": [0.5] * 20,
        }
    )
    data = next(iter(charts.turn_advantages(frame, max_episodes=3).to_dict()["datasets"].values()))
    assert sorted({r["episode"] for r in data}) == ["ep0", "ep1", "ep2"] and len(data) == 6


def test_derivation_layout_places_theorems_after_their_axioms(concierge):
    """Every theorem sits to the right of the clauses it derives from, and the graph renders."""
    layout = charts.derivation_layout(concierge)
    depth = dict(zip(layout["id"], layout["x"], strict=True))
    assert set(depth) == {c.id for c in concierge.axioms} | {t.id for t in concierge.theorems}
    for th in concierge.theorems:
        assert all(depth[th.id] > depth[a] for a in th.derives_from), th.id
    assert chart_svg(charts.derivation_graph(concierge)).lstrip().startswith("<svg")


def test_a_chart_of_metrics_over_nothing_says_no_data():
    """NaN points (metrics over nothing) are left out; a chart with none left says "no data"
    instead of empty axes, and still renders offline."""
    nan = float("nan")
    m = pl.DataFrame({"iteration": [0, 1, 2], "a": [nan, nan, nan], "b": [0.1, nan, 0.3]})
    some = charts.run_curves(m, ["a", "b"])
    data = next(iter(some.to_dict()["datasets"].values()))
    assert [(r["metric"], r["value"]) for r in data] == [("b", 0.1), ("b", 0.3)]
    for chart in (
        charts.run_curves(m, ["a"], "only NaN"),
        charts.clause_curves(m.rename({"a": "judge/A1_pass_rate"}), "judge/"),
        charts.compare_runs({"r": m.rename({"iteration": "episodes"})}, "a"),
    ):
        spec = chart.to_dict()
        assert spec["mark"]["type"] == "text"
        assert next(iter(spec["datasets"].values())) == [{"text": "no data"}]
        assert "no data" in chart_svg(chart)
