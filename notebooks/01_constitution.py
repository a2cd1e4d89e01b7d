# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "kitchen",
#     "marimo>=0.25",
# ]
#
# [tool.uv.sources]
# kitchen = { path = "..", editable = true }
# ///

import marimo

__generated_with = "0.25.2"
app = marimo.App(width="medium")


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    # 01 · The constitution: axioms, theorems, and a constitution per user

    A dialogue agent has no unit test that says "right answer". The kit's reward comes from a
    **constitution**: explicit rules that a reward model checks clause by clause. This notebook
    builds one, personalises it for a diner, and shows what changes from one diner to the next.

    Two layers (`docs/method.md#constitution`):

    - **Axioms** are red lines: the same for every user, never personalised.
    - **Theorems** are scenario rules *derived* from axioms. Each names the axioms it follows from,
      so every verdict can be traced to a principle. A theorem can apply to some users only
      (`applies_when`) and take parameters from the user's profile.
    """)
    return


@app.cell
def _():
    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.config import KitchenError
    from kitchen.constitution import (
        PersonalizationCache,
        diff,
        parse_constitution,
        personalize,
        render_text,
        to_frame,
    )
    from kitchen.profile import DimensionValue, load_profiles, redact

    return (
        DimensionValue,
        KitchenError,
        PersonalizationCache,
        charts,
        diff,
        load_profiles,
        mo,
        notebook,
        parse_constitution,
        paths,
        personalize,
        pl,
        redact,
        render_text,
        to_frame,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · Author and validate

    Below is the concierge world's default constitution. Edit it: every change is validated at
    once, and a mistake is reported with its line and a hint — duplicate ids, a theorem deriving
    from an unknown axiom, a condition on an unknown dimension, two theorems whose bounds
    contradict (`min_words` above `max_words` for some diner). Try changing `derives_from: [A1]`
    to `[A9]`.
    """)
    return


@app.cell
def _(mo, paths):
    source = mo.ui.code_editor(
        value=paths.DEFAULT_CONSTITUTION.read_text(), language="yaml", min_height=300
    )
    source
    return (source,)


@app.cell
def _(KitchenError, mo, parse_constitution, paths, pl, source):
    try:
        constitution = parse_constitution(source.value, path="editor")
        problems = pl.DataFrame(schema={"line": pl.Int64, "where": pl.String, "problem": pl.String})
        _status = mo.callout(
            mo.md(
                f"**Valid** · `{constitution.name}@{constitution.version}` · "
                f"{len(constitution.axioms)} axioms, {len(constitution.theorems)} theorems"
            ),
            kind="success",
        )
    except KitchenError as _e:
        # Keep teaching with the last good constitution while the text is broken.
        constitution = parse_constitution(paths.DEFAULT_CONSTITUTION.read_text())
        problems = pl.DataFrame(
            [{"line": p.line, "where": p.where, "problem": p.message} for p in _e.problems]
        )
        _status = mo.vstack(
            [mo.callout(mo.md("**Invalid** — showing the default below"), kind="danger"), problems]
        )
    _status
    return constitution, problems


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · The derivation graph

    Axioms on the left, theorems to their right, an edge from each parent. A theorem whose chain
    does not end at an axiom is rejected, so every rule has a reason.
    """)
    return


@app.cell
def _(charts, constitution):
    charts.derivation_graph(constitution)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · A profile, and the personal constitution it yields

    A profile holds preference *dimensions*, each with a confidence. Personalisation fills the
    theorems from them; a dimension below the constitution's `confidence_threshold` falls back
    to the default, so a noisy profile cannot push the agent somewhere odd
    (`docs/method.md#personalisation`).
    Allergies never fall back: a doubtful allergy is still an allergy.

    Pick a diner, then move the sliders and watch the clauses change.
    """)
    return


@app.cell
def _(load_profiles, notebook, paths):
    profiles = {p.id: p for p in load_profiles(paths.PROFILES)}
    first_profile = notebook.arg("profile", "amara-okafor")
    return first_profile, profiles


@app.cell
def _(first_profile, mo, profiles):
    who = mo.ui.dropdown(options=list(profiles), value=first_profile, label="diner")
    who
    return (who,)


@app.cell
def _(mo, profiles, who):
    _p = profiles[who.value]
    _dims = _p.dimensions
    verbosity = mo.ui.dropdown(
        ["brief", "normal", "detailed"], value=_dims["verbosity"].value, label="verbosity"
    )
    verbosity_conf = mo.ui.slider(
        0.0,
        1.0,
        step=0.05,
        value=round(_dims["verbosity"].confidence, 2),
        label="confidence",
        show_value=True,
    )
    pace = mo.ui.dropdown(["hurried", "relaxed"], value=_dims["pace"].value, label="pace")
    pace_conf = mo.ui.slider(
        0.0,
        1.0,
        step=0.05,
        value=round(_dims["pace"].confidence, 2),
        label="confidence",
        show_value=True,
    )
    diet = mo.ui.dropdown(["any", "vegetarian"], value=_dims["diet"].value, label="diet")
    diet_conf = mo.ui.slider(
        0.0,
        1.0,
        step=0.05,
        value=round(_dims["diet"].confidence, 2),
        label="confidence",
        show_value=True,
    )
    mo.vstack(
        [
            mo.hstack([verbosity, verbosity_conf], justify="start", gap=2, wrap=True),
            mo.hstack([pace, pace_conf], justify="start", gap=2, wrap=True),
            mo.hstack([diet, diet_conf], justify="start", gap=2, wrap=True),
        ]
    )
    return diet, diet_conf, pace, pace_conf, verbosity, verbosity_conf


@app.cell
def _(
    DimensionValue,
    diet,
    diet_conf,
    pace,
    pace_conf,
    profiles,
    verbosity,
    verbosity_conf,
    who,
):
    # The edited profile: the chosen diner with the values and confidences from the controls.
    _p = profiles[who.value]
    edited = _p.model_copy(
        update={
            "dimensions": _p.dimensions
            | {
                "verbosity": DimensionValue(value=verbosity.value, confidence=verbosity_conf.value),
                "pace": DimensionValue(value=pace.value, confidence=pace_conf.value),
                "diet": DimensionValue(value=diet.value, confidence=diet_conf.value),
            }
        }
    )
    return (edited,)


@app.cell
def _(constitution, edited, mo, notebook, personalize, render_text, to_frame):
    personal = personalize(constitution, edited)
    _fallbacks = (
        "\n".join(f"- `{f.dimension}` → `{f.used}` ({f.reason})" for f in personal.fallbacks)
        or "- none"
    )
    mo.vstack(
        [
            mo.md(
                f"**Personal constitution** `{personal.version}` for `{personal.profile}` · "
                f"inactive: {', '.join(personal.inactive) or 'none'}\n\n"
                f"**Fallbacks**\n{_fallbacks}"
            ),
            notebook.rounded(to_frame(personal).select("id", "kind", "weight", "text", "sources")),
            mo.md("The same, as the reward model will read it:"),
            mo.md(f"```text\n{render_text(personal)}\n```"),
        ]
    )
    return (personal,)


@app.cell
def _(charts, constitution, personal):
    charts.derivation_graph(constitution, active=personal)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Two diners side by side

    The axioms never differ. What differs is which theorems apply and with which parameters.
    """)
    return


@app.cell
def _(mo, notebook, profiles):
    other = mo.ui.dropdown(
        options=list(profiles), value=notebook.arg("other", "bruno-salas"), label="compare with"
    )
    other
    return (other,)


@app.cell
def _(constitution, diff, other, personal, personalize, pl, profiles):
    other_personal = personalize(constitution, profiles[other.value])
    changes = pl.DataFrame(
        [{k: str(v) for k, v in row.items()} for row in diff(personal, other_personal)],
        schema={"clause": pl.String, "field": pl.String, "a": pl.String, "b": pl.String},
    )
    changes
    return changes, other_personal


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 5 · Versioning, caching and privacy

    A personal constitution's version is a hash of (constitution version, redacted profile).
    The cache keys on the constitution version and the diner's pseudonym, so editing one
    profile rebuilds exactly one entry. Personal identifiers never get this far: `redact`
    drops them (and masks e-mails and phone numbers hiding inside values) before anything is
    personalised, logged or prompted.
    """)
    return


@app.cell
def _(PersonalizationCache, constitution, edited, mo, profiles, redact):
    cache = PersonalizationCache()
    for _p in profiles.values():
        cache.get(constitution, _p)
    cache.get(constitution, edited)  # the edited diner: a changed profile replaces one entry
    _redacted = redact(edited)
    mo.md(
        f"- cache: {len(cache)} entries, {cache.misses} misses, {cache.hits} hits, "
        f"{cache.invalidations} invalidated by the edit\n"
        f"- redacted profile: `{_redacted.model_dump_json()[:160]}…`"
    )
    return (cache,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - Axioms are global red lines; theorems derive from them and are the only layer that is
      personalised. A profile that tries to override an axiom is an error, not a silent change.
    - Low-confidence profile values fall back to defaults, and every fallback is recorded.
    - Personal constitutions are deterministic, content-hashed and cached per profile.
    - PII is removed before personalisation, so it cannot reach prompts, logs or checkpoints.
    - Next: `02_cold_start.py` — the concierge world and the policy we will align.
    """)
    return


if __name__ == "__main__":
    app.run()
