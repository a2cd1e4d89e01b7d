"""Self-contained HTML run reports: charts, tables and dialogues in one file that opens offline.

A report is a list of sections; each holds prose, tables (polars frames) and charts (altair),
rendered to inline SVG with vl-convert — no JavaScript, no CDN, nothing to fetch — so the file
can be mailed, archived next to the run, or opened on a machine without network.

`run_report(folder)` reports one training run (`kitchen cook` writes the folder): reward and
advantage curves, per-clause pass rates (GRM and judge), KL and entropy, group statistics,
throughput, evaluation rows, and a sample dialogue with its review. `kitchen.demo` adds the
comparison sections (policy vs SFT, MAPO vs GRPO) of the main job.

A metric over nothing (NaN in the run logs, `null` in its JSON files) reads "no data" in tables
and charts (`kitchen.charts.no_data`), never a number: a run whose episodes ended before their
first turn must not show a compliance of 1.000.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from kitchen import charts
from kitchen.evaluate import no_data
from kitchen.files import atomic_write_text, read_jsonl

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }
h1 { border-bottom: 2px solid #c0392b; } h2 { margin-top: 2em; color: #2e4053; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f4f6f7; } pre { background: #f8f9f9; padding: 1em; white-space: pre-wrap; }
.chart { margin: 1em 0; } .note { color: #555; font-size: 0.9em; }
"""


@dataclass
class Section:
    title: str
    parts: list[str] = field(default_factory=list)

    def text(self, s: str) -> Section:
        self.parts.append(f"<p>{html.escape(s)}</p>")
        return self

    def pre(self, s: str) -> Section:
        self.parts.append(f"<pre>{html.escape(s)}</pre>")
        return self

    def table(self, df: pl.DataFrame, caption: str = "") -> Section:
        self.parts.append(frame_html(df, caption))
        return self

    def chart(self, chart: alt.TopLevelMixin) -> Section:
        self.parts.append(f'<div class="chart">{chart_svg(chart)}</div>')
        return self


def chart_svg(chart: alt.TopLevelMixin) -> str:
    """An altair chart as inline SVG (vl-convert renders it offline)."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(chart.to_json())


def frame_html(df: pl.DataFrame, caption: str = "") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = []
    for row in df.iter_rows():
        cells = "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row)
        rows.append(f"<tr>{cells}</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<tr>{head}</tr>{''.join(rows)}</table>"


def _fmt(v: Any) -> str:
    """A table cell: floats to 3 decimals, NaN (a metric over nothing) as "no data", None empty
    (a cell that does not apply)."""
    if isinstance(v, float):
        return "no data" if no_data(v) else f"{v:.3f}"
    return "" if v is None else str(v)


def write_html(
    path: str | os.PathLike, title: str, sections: list[Section], intro: str = ""
) -> Path:
    """Write the report atomically; returns its path."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    if intro:
        body.append(f'<p class="note">{html.escape(intro)}</p>')
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        body += s.parts
    doc = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>"
    )
    return atomic_write_text(path, doc)


def run_sections(folder: str | os.PathLike, label: str = "") -> list[Section]:
    """The sections describing one `kitchen cook` run folder."""
    folder = Path(folder)
    m = pl.read_parquet(folder / "metrics.parquet")
    name = label or folder.name
    out = [
        Section(f"{name}: rewards").chart(
            charts.run_curves(
                m,
                ["reward/global_mean", "reward/local_mean", "judge/compliance", "episode/success"],
                "rewards and judged compliance per iteration",
            )
        ),
        Section(f"{name}: clauses")
        .chart(charts.clause_curves(m, "clause/"))
        .chart(charts.clause_curves(m, "judge/")),
        Section(f"{name}: advantages, KL and entropy")
        .chart(
            charts.run_curves(
                m,
                ["adv/local_std", "adv/global_std", "adv/mixed_abs_mean", "alpha"],
                "advantage statistics",
            )
        )
        .chart(
            charts.run_curves(
                m, ["kl/mean", "policy/entropy"], "KL to the reference and policy entropy"
            )
        ),
        Section(f"{name}: groups and throughput")
        .chart(
            charts.run_curves(
                m,
                [
                    "group/local_size_mean",
                    "group/local_singleton_frac",
                    "group/local_zero_var_frac",
                    "group/history_frac",
                ],
                "state groups",
            )
        )
        .chart(
            charts.run_curves(
                m, ["speed/rollout_tokens_per_s", "speed/update_tokens_per_s"], "tokens/s"
            )
        ),
    ]
    if "grm/parsed" not in m.columns:
        out[0].text(
            "The per-turn rewards and clause verdicts of this run are the rule judge's: it was "
            "reviewed by the judge, or its advantage reads no per-turn reward, so the GRM was not "
            "run (`reward.unread_reviews`)."
        )
    if "reward/gap_grm_minus_judge" in m.columns:
        out[0].chart(
            charts.run_curves(
                m,
                ["reward/gap_grm_minus_judge"],
                "reward-hacking monitor: GRM reward − judge reward",
            )
        )
    if (folder / "eval.jsonl").exists():
        rows = list(read_jsonl(folder / "eval.jsonl"))

        def rate(r: dict[str, Any], key: str) -> float:  # null: a rate over nothing
            return math.nan if r.get(key) is None else float(r[key])

        df = pl.DataFrame(
            [
                {
                    "iteration": r["iteration"],
                    "success": rate(r, "success"),
                    "compliance": rate(r, "compliance"),
                    "axiom violations": r["axiom_violations"],
                    "valid actions": rate(r, "valid_actions"),
                }
                for r in rows
            ],
            schema={
                "iteration": pl.Int64,
                "success": pl.Float64,
                "compliance": pl.Float64,
                "axiom violations": pl.Int64,
                "valid actions": pl.Float64,
            },
        )
        out.append(Section(f"{name}: held-out evaluation (rule judge)").table(df))
    samples = folder / "samples.jsonl"
    if samples.exists():
        rows = list(read_jsonl(samples))
        last = rows[-1] if rows else None
        if last is not None:
            out.append(
                sample_section(last, f"{name}: a dialogue from iteration {last['iteration']}")
            )
    return out


def sample_section(row: dict[str, Any], title: str) -> Section:
    """One logged trajectory: transcript, local rewards and the violated clauses."""
    from kitchen.world import Trajectory, render_transcript

    traj = Trajectory.model_validate(row["trajectory"])
    s = Section(title).pre(render_transcript(traj))
    violations = [v for v in row["review"]["verdicts"] if v["verdict"] == "violate"]
    rewards = ", ".join(
        f"t{t}: {r:+.2f}" if ok else f"t{t}: -"
        for t, (r, ok) in enumerate(zip(row["local"], row["valid"], strict=True))
    )
    s.text(f"local rewards per turn: {rewards}")
    if violations:
        s.text(
            "violations: "
            + "; ".join(f"t{v['turn']} {v['clause']} ({v['reason']})" for v in violations)
        )
    return s


def run_report(folder: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write `<folder>/report.html` for one run."""
    folder = Path(folder)
    if not (folder / "metrics.parquet").exists():
        from kitchen.config import KitchenError

        raise KitchenError(
            f"{folder}: no metrics.parquet; give a run folder that `kitchen cook` "
            "wrote (runs/<name>)"
        )
    recipe = (folder / "recipe.yaml").read_text() if (folder / "recipe.yaml").exists() else ""
    sections = run_sections(folder)
    sections.append(Section("recipe").pre(recipe))
    return write_html(
        out or folder / "report.html",
        f"kitchen run {folder.name}",
        sections,
        intro=json.dumps({"folder": str(folder)}),
    )
