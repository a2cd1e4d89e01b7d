"""Charts for the notebooks and run reports: altair specs built from polars frames.

Every iteration of the loop ends in "metrics (polars rows) → charts (altair) → notebooks / run
report" (docs/method.md); this is that last arrow. It is the one module that imports altair and
polars at import time; the core modules never do, so the GPU and distributed paths run without them.
Every function takes plain kit objects or polars frames and returns an `alt.Chart`; none of them
computes method results (those live in the modules they chart).

Departure: long run logs are down-sampled (every k-th row, `downsample`) before charting, since
altair refuses more than 5,000 rows in a plain chart; curves keep their shape, not every point.

A metric over nothing is NaN in the run logs (docs/metrics.md): the run charts leave those points
out, and a chart left with no point at all says "no data" (`no_data`) instead of drawing empty
axes that could be read as a flat line.
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kitchen.constitution import Constitution, PersonalConstitution, derivation_edges

MAX_ROWS = 5000


def no_data(title: str = "", width: int = 420, height: int = 200) -> alt.Chart:
    """A chart that says "no data": what a chart of metrics that were never computed shows."""
    return (
        alt.Chart(pl.DataFrame({"text": ["no data"]}), title=title)
        .mark_text(size=16, color="#888")
        .encode(text="text:N")
        .properties(width=width, height=height)
    )


def derivation_layout(c: Constitution, active: PersonalConstitution | None = None) -> pl.DataFrame:
    """Node positions for the axiom → theorem graph: x = derivation depth, y = order in layer.

    `active` (a personal constitution) marks which theorems apply to that user.
    """
    depth: dict[str, int] = {a.id: 0 for a in c.axioms}
    pending = list(c.theorems)
    while pending:  # longest path from an axiom; the constitution was checked for cycles
        progressed = False
        for t in list(pending):
            if all(p in depth for p in t.derives_from):
                depth[t.id] = 1 + max(depth[p] for p in t.derives_from)
                pending.remove(t)
                progressed = True
        if not progressed:
            break
    rows, per_layer = [], {}
    texts = {a.id: a.text for a in c.axioms} | {t.id: t.text for t in c.theorems}
    kinds = {a.id: "axiom" for a in c.axioms} | {t.id: "theorem" for t in c.theorems}
    for cid in c.clause_ids:
        d = depth.get(cid, 0)
        y = per_layer.get(d, 0)
        per_layer[d] = y + 1
        is_active = True if active is None else cid in active.ids
        rows.append(
            {"id": cid, "kind": kinds[cid], "x": d, "y": y, "text": texts[cid], "active": is_active}
        )
    return pl.DataFrame(rows)


def derivation_graph(c: Constitution, active: PersonalConstitution | None = None) -> alt.Chart:
    """The derivation graph: axioms on the left, theorems to the right, edges from parents."""
    nodes = derivation_layout(c, active)
    pos = {r["id"]: (r["x"], r["y"]) for r in nodes.iter_rows(named=True)}
    edges = pl.DataFrame(
        [
            {"edge": f"{a}->{b}", "x": pos[a][0], "y": pos[a][1], "order": 0}
            for a, b in derivation_edges(c)
        ]
        + [
            {"edge": f"{a}->{b}", "x": pos[b][0], "y": pos[b][1], "order": 1}
            for a, b in derivation_edges(c)
        ],
        schema={"edge": pl.String, "x": pl.Int64, "y": pl.Int64, "order": pl.Int64},
    )
    x = alt.X("x:Q", axis=None, scale=alt.Scale(padding=40))
    y = alt.Y("y:Q", axis=None, scale=alt.Scale(reverse=True, padding=30))
    lines = (
        alt.Chart(edges).mark_line(color="#999").encode(x=x, y=y, detail="edge:N", order="order")
    )
    points = (
        alt.Chart(nodes)
        .mark_circle(size=900)
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "kind:N", scale=alt.Scale(domain=["axiom", "theorem"], range=["#c0392b", "#2e86c1"])
            ),
            opacity=alt.condition("datum.active", alt.value(1.0), alt.value(0.25)),
            tooltip=["id", "kind", "text", "active"],
        )
    )
    labels = (
        alt.Chart(nodes).mark_text(color="white", fontWeight="bold").encode(x=x, y=y, text="id")
    )
    return (lines + points + labels).properties(
        width=420, height=260, title="Derivation: axioms → theorems"
    )


def downsample(df: pl.DataFrame, max_rows: int = MAX_ROWS) -> pl.DataFrame:
    """Every k-th row so a chart stays under altair's row limit (keeps the last row)."""
    if df.height <= max_rows:
        return df
    step = -(-df.height // max_rows)
    return df.gather_every(step)


# ---------------------------------------------------------------- notebook 04: credit assignment

PRESET_ORDER = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gigpo", "mapo_paper", "mapo"]


def _thin(df: pl.DataFrame, by: list[str], max_rows: int = MAX_ROWS) -> pl.DataFrame:
    """Every k-th row within each group of `by` (keeping each group's last row)."""
    if df.height <= max_rows:
        return df
    k = -(-df.height // max_rows)
    i = pl.int_range(pl.len()).over(by)
    return df.filter((i % k == 0) | (i == pl.len().over(by) - 1))


def _preset_color(presets: list[str]) -> alt.Color:
    order = [p for p in PRESET_ORDER if p in presets] + [
        p for p in presets if p not in PRESET_ORDER
    ]
    return alt.Color("preset:N", sort=order, scale=alt.Scale(domain=order, scheme="tableau10"))


def sample_efficiency(curves: pl.DataFrame, target: float | None = None) -> alt.Chart:
    """Success rate against episodes, one line per preset (mean over seeds) with its 95% band;
    one panel per horizon. `curves` has preset, horizon, episodes, success, low, high."""
    df = _thin(curves, ["preset", "horizon"])
    if target is not None:
        df = df.with_columns(target=pl.lit(target))
    color = _preset_color(df["preset"].unique().to_list())
    base = alt.Chart(df).encode(x=alt.X("episodes:Q", title="episodes per seed"), color=color)
    band = base.mark_area(opacity=0.15).encode(y="low:Q", y2="high:Q")
    line = base.mark_line().encode(
        y=alt.Y("success:Q", title="success rate", scale=alt.Scale(domain=[0, 1])),
        tooltip=["preset", "horizon", "episodes", alt.Tooltip("success:Q", format=".2f")],
    )
    layers = band + line
    if target is not None:
        rule = alt.Chart(df).mark_rule(strokeDash=[4, 4], color="#555").encode(y="mean(target):Q")
        layers = layers + rule
    return (
        layers.properties(width=230, height=180)
        .facet(column=alt.Column("horizon:O", title="horizon (turns)"))
        .resolve_scale(x="independent")
        .properties(title="Sample efficiency: mean over seeds, 95% band")
    )


def samples_to_target(table: pl.DataFrame) -> alt.Chart:
    """Median episodes to reach the target against the horizon, one line per preset (log
    scale): how each method's cost grows with the task's length. A preset whose median did not
    reach the target is drawn at the budget as a hollow point. `table` is lab.samples_table."""
    df = table.with_columns(
        shown=pl.when(pl.col("median_episodes").is_infinite())
        .then(pl.col("budget").cast(pl.Float64))
        .otherwise(pl.col("median_episodes")),
        within_budget=pl.col("median_episodes").is_finite(),
        median_episodes=pl.when(pl.col("median_episodes").is_finite()).then(
            pl.col("median_episodes")
        ),
    ).drop([c for c in table.columns if c.startswith("vs_")])
    color = _preset_color(df["preset"].unique().to_list())
    base = alt.Chart(df).encode(
        x=alt.X("horizon:Q", title="horizon (turns)"),
        y=alt.Y("shown:Q", title="median episodes to target", scale=alt.Scale(type="log")),
        color=color,
    )
    points = base.mark_point(size=60, filled=True).encode(
        fillOpacity=alt.condition("datum.within_budget", alt.value(1.0), alt.value(0.0)),
        tooltip=["preset", "horizon", "median_episodes", "reached", "budget"],
    )
    return (base.mark_line() + points).properties(
        width=420, height=240, title="Samples to target (median over seeds)"
    )


QUALITY = {1.0: "good action", 0.0: "neutral / wrong key", -1.0: "trap"}


def advantage_histogram(snapshot: pl.DataFrame, bin_width: float = 0.25) -> alt.Chart:
    """Distribution of each preset's advantages on the same rollouts, split by what the action
    was: a preset that assigns credit well separates good actions from traps."""
    df = (
        snapshot.with_columns(
            quality=pl.col("quality").replace_strict(QUALITY, default="other"),
            bin=(pl.col("advantage").clip(-4, 4) / bin_width).floor() * bin_width,
        )
        .group_by("preset", "quality", "bin")
        .agg(count=pl.len())
        .with_columns(share=pl.col("count") / pl.col("count").sum().over("preset", "quality"))
    )
    return (
        alt.Chart(df)
        .mark_bar(opacity=0.6, binSpacing=0)
        .encode(
            x=alt.X(
                "bin:Q",
                title="advantage",
                bin=alt.Bin(binned=True, step=bin_width),
                axis=alt.Axis(values=[-4, -2, 0, 2, 4]),
            ),
            x2="bin_end:Q",
            y=alt.Y("share:Q", title="share of samples", stack=None),
            color=alt.Color(
                "quality:N",
                title="action",
                scale=alt.Scale(
                    domain=list(QUALITY.values()), range=["#2e86c1", "#aaaaaa", "#c0392b"]
                ),
            ),
            tooltip=["preset", "quality", "bin", "count"],
        )
        .transform_calculate(bin_end=f"datum.bin + {bin_width}")
        .properties(width=170, height=110)
        .facet(facet=alt.Facet("preset:N", sort=PRESET_ORDER), columns=4)
        .properties(title="Advantages of the same rollouts, by the action taken")
    )


def credit_by_turn(credit: pl.DataFrame, key_turn: int | None = None) -> alt.Chart:
    """Per turn and preset: corr(advantage, the action's judged quality) — the share of a turn's
    advantage that is about that turn's own action."""
    color = _preset_color(credit["preset"].unique().to_list())
    bars = (
        alt.Chart(credit)
        .mark_bar()
        .encode(
            x=alt.X(
                "turn:O", title="turn" + (f" (key turn {key_turn})" if key_turn is not None else "")
            ),
            xOffset=alt.XOffset("preset:N", sort=PRESET_ORDER),
            y=alt.Y(
                "credit:Q",
                title="corr(advantage, action quality)",
                scale=alt.Scale(domain=[-0.2, 1]),
            ),
            color=color,
            tooltip=["preset", "turn", alt.Tooltip("credit:Q", format=".2f")],
        )
        .properties(
            width=520,
            height=200,
            title="How much of each turn's advantage is about that turn's action",
        )
    )
    return bars


def metric_curves(metrics: pl.DataFrame, names: list[str]) -> alt.Chart:
    """Training metrics over episodes, one panel per metric name, one line per preset.
    `metrics` has preset, horizon, episodes, metric, value."""
    df = _thin(metrics.filter(pl.col("metric").is_in(names)), ["preset", "horizon", "metric"])
    color = _preset_color(df["preset"].unique().to_list())
    return (
        alt.Chart(df)
        .mark_line()
        .encode(
            x=alt.X("episodes:Q", title="episodes per seed"),
            y=alt.Y("value:Q", title=None),
            color=color,
            tooltip=["preset", "metric", "episodes", alt.Tooltip("value:Q", format=".3f")],
        )
        .properties(width=260, height=170)
        .facet(column=alt.Column("metric:N", title=None, sort=names))
        .resolve_scale(y="independent")
    )


# ------------------------------------------------------ notebooks 02 and 03: cold start and GRM

VERDICT_COLORS = {"pass": "#2e8b57", "violate": "#c0392b", "n/a": "#e8e8e8", "masked": "#8e8e8e"}


def loss_curve(log: pl.DataFrame) -> alt.Chart:
    """Train and held-out loss against the optimiser step. `log` has `step` and `loss` and/or
    `eval_loss` columns (the rows `kitchen.sft.run_sft` logs; missing values are skipped)."""
    cols = [c for c in ("loss", "eval_loss") if c in log.columns]
    long = (
        downsample(log.select(["step", *cols]))
        .unpivot(index="step", on=cols, variable_name="series", value_name="value")
        .drop_nulls("value")
        .with_columns(pl.col("series").replace({"loss": "train", "eval_loss": "held-out"}))
    )
    return (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=alt.X("step:Q", title="optimiser step"),
            y=alt.Y("value:Q", title="loss (assistant tokens)"),
            color=alt.Color("series:N", title=None),
            tooltip=["series", "step", alt.Tooltip("value:Q", format=".3f")],
        )
        .properties(width=420, height=200, title="SFT loss")
    )


def counts_bar(df: pl.DataFrame, category: str, value: str, title: str = "") -> alt.Chart:
    """A horizontal bar per category (e.g. action kinds in the SFT data)."""
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y(f"{category}:N", sort="-x", title=None),
            x=alt.X(f"{value}:Q"),
            tooltip=[category, value],
        )
        .properties(width=360, height=alt.Step(18), title=title)
    )


def review_frame(review, reference=None, clauses: list[str] | None = None) -> pl.DataFrame:
    """One row per (turn, clause) of a `Review`: verdict ("masked" when the reviewer gave none),
    its reason, and with a `reference` review (the judge) the reference verdict and agreement."""
    ref = {(v.turn, v.clause): v for v in reference.verdicts} if reference is not None else {}
    order = {c: k for k, c in enumerate(clauses or review.clauses)}
    rows = []
    for v in review.verdicts:
        r = ref.get((v.turn, v.clause))
        rows.append(
            {
                "turn": v.turn,
                "clause": v.clause,
                "order": order.get(v.clause, len(order)),
                "verdict": v.verdict or "masked",
                "reason": v.reason,
                "reference": (r.verdict or "masked") if r else "",
                "reference_reason": r.reason if r else "",
                "agree": (r is None) or (r.verdict == v.verdict),
            }
        )
    return pl.DataFrame(
        rows,
        schema={
            "turn": pl.Int64,
            "clause": pl.String,
            "order": pl.Int64,
            "verdict": pl.String,
            "reason": pl.String,
            "reference": pl.String,
            "reference_reason": pl.String,
            "agree": pl.Boolean,
        },
    )


def review_heatmap(review, reference=None, title: str = "") -> alt.Chart:
    """A review as a turn × clause grid coloured by verdict, the reasons on hover; with a
    `reference` (the judge), cells where the two disagree carry a ✗."""
    df = review_frame(review, reference)
    sort = df.sort("order")["clause"].unique(maintain_order=True).to_list()
    x = alt.X("clause:N", sort=sort, title="clause")
    y = alt.Y("turn:O", title="agent turn")
    tips = ["turn", "clause", "verdict", "reason"]
    if reference is not None:
        tips += [
            alt.Tooltip("reference:N", title="judge"),
            alt.Tooltip("reference_reason:N", title="judge's reason"),
        ]
    cells = (
        alt.Chart(df)
        .mark_rect(stroke="white")
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "verdict:N",
                scale=alt.Scale(domain=list(VERDICT_COLORS), range=list(VERDICT_COLORS.values())),
            ),
            tooltip=tips,
        )
    )
    chart = cells
    if reference is not None:
        marks = (
            alt.Chart(df.filter(~pl.col("agree")))
            .mark_text(fontSize=16, fontWeight="bold", color="black")
            .encode(x=x, y=y, text=alt.value("✗"), tooltip=tips)
        )
        chart = cells + marks
    return chart.properties(
        width=alt.Step(34), height=alt.Step(26), title=title or "review: turn × clause"
    )


def clause_bars(
    df: pl.DataFrame, value: str = "value", series: str = "series", y_title: str = "agreement"
) -> alt.Chart:
    """Grouped bars per clause (e.g. accuracy of greedy vs voted reviews, accuracy vs accuracy
    on pass/violate cells, or pass rates per policy). `df` has clause, `series` and `value` in
    [0, 1]; `y_title` says what the value is."""
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X("clause:N", title="clause"),
            xOffset=alt.XOffset(f"{series}:N"),
            y=alt.Y(f"{value}:Q", title=y_title, scale=alt.Scale(domain=[0, 1])),
            color=alt.Color(f"{series}:N", title=None),
            tooltip=["clause", series, alt.Tooltip(f"{value}:Q", format=".1%")],
        )
        .properties(width=alt.Step(14), height=200)
    )


# ------------------------------------------------------------ training runs (notebook 05, report)


def _count_axis(x: str) -> alt.X:
    """An x axis of whole numbers (iterations, steps): ticks 1, 2, … — never 0.5."""
    return alt.X(f"{x}:Q", title=x, axis=alt.Axis(format="d", tickMinStep=1))


def long_metrics(metrics: pl.DataFrame, names: list[str], x: str = "iteration") -> pl.DataFrame:
    """Wide run metrics (one column per metric) → rows of (x, metric, value) for `names`."""
    present = [n for n in names if n in metrics.columns]
    if not present:
        return pl.DataFrame(schema={x: pl.Float64, "metric": pl.String, "value": pl.Float64})
    return (
        metrics.select([pl.col(x).cast(pl.Float64)] + [pl.col(n).cast(pl.Float64) for n in present])
        .unpivot(index=x, variable_name="metric", value_name="value")
        .drop_nulls("value")
        .filter(pl.col("value").is_finite())  # NaN: a metric over nothing, not a point
    )


def run_curves(
    metrics: pl.DataFrame,
    names: list[str],
    title: str = "",
    x: str = "iteration",
    width: int = 420,
    height: int = 200,
) -> alt.Chart:
    """Metrics of one run over iterations, one line per metric name ("no data" without any)."""
    df = downsample(long_metrics(metrics, names, x))
    if df.is_empty():
        return no_data(title, width, height)
    return (
        alt.Chart(df, title=title)
        .mark_line(point=df.height < 200)
        .encode(
            x=_count_axis(x),
            y=alt.Y("value:Q", title=None),
            color=alt.Color("metric:N", sort=names),
            tooltip=["metric", x, alt.Tooltip("value:Q", format=".3f")],
        )
        .properties(width=width, height=height)
    )


def clause_curves(metrics: pl.DataFrame, prefix: str = "judge/", title: str = "") -> alt.Chart:
    """Per-clause pass rates over iterations (`<prefix><clause>_pass_rate` columns)."""
    names = sorted(c for c in metrics.columns if c.startswith(prefix) and c.endswith("_pass_rate"))
    df = long_metrics(metrics, names).with_columns(
        pl.col("metric").str.strip_prefix(prefix).str.strip_suffix("_pass_rate").alias("clause")
    )
    title = title or f"pass rate per clause ({prefix.rstrip('/')})"
    if df.is_empty():
        return no_data(title, 420, 220)
    return (
        alt.Chart(downsample(df), title=title)
        .mark_line(point=df["iteration"].n_unique() < 50)
        .encode(
            x=_count_axis("iteration"),
            y=alt.Y("value:Q", title="pass rate", scale=alt.Scale(domain=[0, 1])),
            color="clause:N",
            tooltip=["clause", "iteration", alt.Tooltip("value:Q", format=".2f")],
        )
        .properties(width=420, height=220)
    )


def compare_runs(
    runs: dict[str, pl.DataFrame], metric: str, x: str = "episodes", title: str = ""
) -> alt.Chart:
    """One metric for several runs (e.g. mapo vs grpo) against episodes seen."""
    frames = [
        df.select(
            pl.col(x).cast(pl.Float64), pl.col(metric).cast(pl.Float64).alias("value")
        ).with_columns(pl.lit(name).alias("run"))
        for name, df in runs.items()
        if metric in df.columns and x in df.columns
    ]
    df = (
        pl.concat(frames)
        if frames
        else pl.DataFrame(schema={x: pl.Float64, "value": pl.Float64, "run": pl.String})
    ).filter(pl.col("value").is_finite() & pl.col(x).is_not_null())
    if df.is_empty():
        return no_data(title or metric, 420, 220)
    return (
        alt.Chart(downsample(df), title=title or metric)
        .mark_line(point=True)
        .encode(
            x=alt.X(f"{x}:Q", title=x.replace("_", " ")),
            y=alt.Y("value:Q", title=metric),
            color="run:N",
            tooltip=["run", x, alt.Tooltip("value:Q", format=".3f")],
        )
        .properties(width=420, height=220)
    )


# -------------------------------------------------------------- notebook 07: scaling up (TRL, verl)


def turn_advantages(frame: pl.DataFrame, max_episodes: int = 8) -> alt.Chart:
    """Per-turn advantages of a batch: the kit's MAPO advantage of each turn (points) against the
    one advantage TRL's GRPO gives the whole episode (a bar across its turns).

    `frame`: one row per trained turn with `episode` (str), `turn` (int), `mapo` and `grpo`.
    """
    keep = frame["episode"].unique(maintain_order=True).head(max_episodes)
    df = frame.filter(pl.col("episode").is_in(keep.implode()))
    base = alt.Chart(df).encode(x=alt.X("turn:O", title="turn"))
    grpo = base.mark_tick(thickness=2, size=18, color="#999").encode(
        y=alt.Y("grpo:Q", title="advantage"),
        tooltip=["episode", "turn", alt.Tooltip("grpo:Q", format=".3f", title="GRPO (episode)")],
    )
    mapo = base.mark_circle(size=60).encode(
        y="mapo:Q",
        color=alt.condition("datum.mapo >= 0", alt.value("#1b7837"), alt.value("#b2182b")),
        tooltip=["episode", "turn", alt.Tooltip("mapo:Q", format=".3f", title="MAPO (turn)")],
    )
    return (
        alt.layer(grpo, mapo, data=df)
        .properties(width=90, height=160)
        .facet(
            column=alt.Column("episode:N", title=None),
            title="MAPO per turn (dots) vs GRPO per episode (grey ticks)",
        )
    )


# ------------------------------------------------------------- notebook 00: should you do RL?


def plateau_fit(log: pl.DataFrame, curve, metric: str = "eval_loss") -> alt.Chart:
    """The SFT curve with the plateau test's power law (`kitchen.decide.plateau`) over its tail,
    extended to twice the training (dashed). `log`: rows with `step` and `metric`; `curve`: the
    `Plateau` fitted to them."""
    import math

    pts = log.select("step", metric).drop_nulls().filter(pl.col("step") > 0)
    x0, x1 = curve.steps[0], 2 * curve.steps[-1]
    xs = [x0 * (x1 / x0) ** (k / 40) for k in range(41)]
    ys = [math.exp(curve.log_c) * x ** (-curve.exponent) for x in xs]
    if curve.higher_is_better:
        ys = [1 - y for y in ys]
    fit = pl.DataFrame(
        {
            "step": xs,
            "value": ys,
            "part": ["fit" if x <= curve.steps[-1] else "doubled" for x in xs],
        }
    )
    base = (
        alt.Chart(pts)
        .mark_line(point=True, color="#4c78a8")
        .encode(
            x=alt.X("step:Q", title="optimiser step"),
            y=alt.Y(f"{metric}:Q", title=metric.replace("_", " "), scale=alt.Scale(type="log")),
            tooltip=["step", alt.Tooltip(f"{metric}:Q", format=".4f")],
        )
    )
    line = (
        alt.Chart(fit.rename({"value": metric}))
        .mark_line(color="#e45756")
        .encode(
            x="step:Q",
            y=f"{metric}:Q",
            strokeDash=alt.StrokeDash("part:N", title="power law", sort=["fit", "doubled"]),
        )
    )
    return (base + line).properties(
        width=420,
        height=220,
        title=f"{metric}: doubling the training is projected to improve it by "
        f"{curve.projected_gain:.1%}",
    )


def imitation_bars(rows: list[dict]) -> alt.Chart:
    """Per metric (`kitchen.decide.imitation_gap` rows): what the policy achieves, what better
    imitation of its SFT data could add, and what lies beyond the data (stacked to 1)."""
    parts = {
        "policy": "achieved",
        "imitable": "imitable (SFT can)",
        "beyond": "beyond the SFT data",
    }
    df = pl.DataFrame(
        [{"metric": r["metric"], "part": parts[k], "share": r[k]} for r in rows for k in parts]
    )
    order = list(parts.values())
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("metric:N", sort=[r["metric"] for r in rows], title=None),
            x=alt.X("share:Q", stack="zero", scale=alt.Scale(domain=[0, 1]), title="rate"),
            color=alt.Color(
                "part:N",
                sort=order,
                scale=alt.Scale(domain=order, range=["#9ecae9", "#f58518", "#e45756"]),
                title=None,
            ),
            order=alt.Order("order:Q"),
            tooltip=["metric", "part", alt.Tooltip("share:Q", format=".1%")],
        )
        .transform_calculate(order=f"indexof({order!r}, datum.part)")
        .properties(width=420, height=16 * max(len(rows), 1), title="where the remaining gap lies")
    )


def cost_bars(seconds: dict[str, float], title: str = "device-hours by phase") -> alt.Chart:
    """Estimated hours per phase of a run (`CostEstimate.seconds`)."""
    df = pl.DataFrame([{"phase": k, "hours": v / 3600} for k, v in seconds.items()])
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("phase:N", sort=list(seconds), title=None),
            x=alt.X("hours:Q", title="hours"),
            tooltip=["phase", alt.Tooltip("hours:Q", format=",.2f")],
        )
        .properties(width=420, height=90, title=title)
    )


def memory_bars(memory) -> alt.Chart:
    """The memory formula's terms (`kitchen.decide.MemoryEstimate`), with the device's memory as
    a rule when known. Only the largest of update / rollout / review counts at the peak."""
    df = pl.DataFrame(
        [{"term": k, "GB": v, "formula": memory.formulas[k]} for k, v in memory.parts.items()]
    )
    bars = (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("term:N", sort=list(memory.parts), title=None),
            x=alt.X("GB:Q", title="GB (10^9 bytes)"),
            tooltip=["term", alt.Tooltip("GB:Q", format=",.3f"), "formula"],
        )
    )
    chart = bars
    if memory.device_gb:
        rule = (
            alt.Chart(pl.DataFrame({"GB": [memory.device_gb]}))
            .mark_rule(color="#e45756", strokeDash=[4, 3])
            .encode(x="GB:Q")
        )
        chart = bars + rule
    return chart.properties(
        width=420,
        height=18 * len(memory.parts),
        title=f"memory by formula: {memory.total_gb:.2f} GB peak",
    )


def method_curves(frame: pl.DataFrame, title: str = "", y_title: str = "") -> alt.Chart:
    """Learning curves of several methods over seeds: the mean over seeds as a line, the range
    (min to max over seeds) as a band. `frame` has columns method, seed, episodes, value; one
    seed draws the line alone."""
    df = frame.filter(pl.col("value").cast(pl.Float64).is_finite())
    if df.is_empty():
        return no_data(title, 420, 220)
    agg = df.group_by("method", "episodes").agg(
        pl.col("value").mean().alias("mean"),
        pl.col("value").min().alias("low"),
        pl.col("value").max().alias("high"),
        pl.col("seed").n_unique().alias("seeds"),
    )
    base = alt.Chart(agg, title=title).encode(
        x=alt.X("episodes:Q", title="training episodes"),
        color=alt.Color("method:N", title="method"),
    )
    band = base.mark_area(opacity=0.2).encode(y="low:Q", y2="high:Q")
    line = base.mark_line(point=True).encode(
        y=alt.Y("mean:Q", title=y_title or "value", scale=alt.Scale(zero=False)),
        tooltip=[
            "method",
            "episodes",
            alt.Tooltip("mean:Q", format=".3f"),
            alt.Tooltip("low:Q", format=".3f"),
            alt.Tooltip("high:Q", format=".3f"),
            "seeds",
        ],
    )
    return (band + line).properties(width=420, height=220)
