"""Charts for the notebooks and run reports: altair specs built from polars frames.

This is the one module that imports altair and polars at import time; the core modules never do,
so the GPU and distributed paths run without them. Every function takes plain kit objects or
polars frames and returns an `alt.Chart`; none of them computes method results (those live in
the modules they chart). Run logs are down-sampled before charting (altair refuses more than
5,000 rows in a plain chart).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kitchen.constitution import Constitution, PersonalConstitution, derivation_edges

MAX_ROWS = 5000


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
