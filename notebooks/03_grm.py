import marimo

__generated_with = "0.25.2"
app = marimo.App(width="medium")


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    # 03 · The generative reward model: a reviewer that reads the constitution

    RL needs a reward for every turn. A scalar reward model would say *how good* a turn was; a
    **generative reward model** (GRM) says *which rule* was kept or broken, and why (seed 000,
    step 4; seed 001, §5.2). It reads the diner's personal constitution and the whole dialogue,
    writes a short critique, then one verdict per agent turn and clause: `+` pass, `-` violate,
    absent = not applicable. Those verdicts are the process reward (`kitchen.review`).

    Because the rules are part of the *input*, one GRM serves every diner's constitution. The
    tiny GRM shipped in `data/models/grm-tiny` was trained from scratch by
    `kitchen grm train recipes/grm_tiny.yaml` on reviews written by the rule judge. This
    notebook looks at one review, measures the GRM against the judge, lets you label verdicts
    yourself, and shows what voting over several samples buys.
    """)
    return


@app.cell
def _():
    import tempfile
    from pathlib import Path

    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.calibrate import (
        HumanLabel,
        agreement,
        calibration_set,
        load_labels,
        save_label,
    )
    from kitchen.grm import GRM, GRMConfig, build_prompt, parse_review, plan_windows
    from kitchen.judge import judge

    return (
        GRM,
        GRMConfig,
        HumanLabel,
        Path,
        agreement,
        build_prompt,
        calibration_set,
        charts,
        judge,
        load_labels,
        mo,
        notebook,
        parse_review,
        paths,
        pl,
        plan_windows,
        save_label,
        tempfile,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · One review

    A pool of held-out dialogues — tasks and diners the GRM never saw in training: a third from a
    scripted agent that breaks every clause, a third from the generic agent, a third played by
    the SFT policy. Pick one.
    """)
    return


@app.cell
def _(GRM, calibration_set, notebook):
    grm = GRM.load()
    pool = calibration_set(notebook.arg("n", 12 if not notebook.interactive() else 60), seed=4242)
    return grm, pool


@app.cell
def _(mo, pool):
    pick = mo.ui.dropdown(
        {f"{src} · {t.id} · {t.task.request}": i for i, (t, _, src) in enumerate(pool)},
        value=next(f"{src} · {t.id} · {t.task.request}" for t, _, src in pool),
        label="dialogue",
    )
    pick
    return (pick,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    The prompt the GRM reads: the personal constitution (compact: clause ids with the diner's
    parameters) and the dialogue, between delimiters. Agent text is **untrusted** — it is
    escaped so it cannot forge a delimiter or a section header, and only what the GRM itself
    generates is parsed. Agent messages carry their word count, because length rules should not
    hinge on a small model's counting. Then, what the GRM wrote.
    """)
    return


@app.cell
def _(build_prompt, grm, mo, pick, plan_windows, pool):
    traj, pc, _src = pool[pick.value]
    _first, _last, _opts = plan_windows(traj, pc, grm.cfg, grm._count)[0]
    _prompt = build_prompt(traj, pc, grm.cfg, first=_first, last=_last, **_opts)
    (raw_review,) = grm.generate([_prompt])[0]
    mo.hstack(
        [
            mo.md(f"**prompt**\n```text\n{_prompt[1]['content']}\n```"),
            mo.md(f"**the GRM wrote**\n```text\n{raw_review}\n```"),
        ],
        widths=[3, 2],
    )
    return pc, raw_review, traj


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    The review as a turn × clause grid, coloured by the GRM's verdict; hover for its reason and
    the judge's. A ✗ marks a cell where the GRM and the rule judge disagree.
    """)
    return


@app.cell
def _(charts, grm, judge, pc, traj):
    (review,) = grm.review([traj], [pc])
    reference = judge(traj, pc)
    review_cells = charts.review_frame(review, reference)
    charts.review_heatmap(review, reference, title=f"GRM review of {traj.id}")
    return reference, review, review_cells


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · GRM versus judge, clause by clause

    Every cell of every review in the pool, against the rule judge: accuracy over all cells
    (most are "not applicable", which is easy), accuracy on the cells where the judge says pass
    or violate (the ones that carry reward), and Cohen's kappa (agreement beyond chance).
    `kitchen grm calibrate` computes the same on a larger held-out set.
    """)
    return


@app.cell
def _(mo):
    agree_button = mo.ui.run_button(label="Review the pool")
    agree_button
    return (agree_button,)


@app.cell
def _(agree_button, agreement, grm, judge, mo, notebook, pl, pool):
    if notebook.gate(agree_button):
        pool_trajs = [t for t, _, _ in pool]
        pool_pcs = [c for _, c, _ in pool]
        judged = [judge(t, c) for t, c in zip(pool_trajs, pool_pcs, strict=True)]
        greedy = grm.review(pool_trajs, pool_pcs)
        report = agreement(greedy, judged)
        clause_table = pl.DataFrame(
            [
                {
                    "clause": c.clause,
                    "cells": c.n,
                    "accuracy": c.accuracy,
                    "accuracy (pass/violate)": c.decided_accuracy,
                    "kappa": c.kappa,
                }
                for c in report.clauses
            ]
        )
        _view = mo.md(f"```text\n{report.table()}\n```")
    else:
        pool_trajs = pool_pcs = judged = greedy = report = clause_table = None
        _view = mo.callout(mo.md("Click **Review the pool**."))
    _view
    return clause_table, greedy, judged, pool_pcs, pool_trajs, report


@app.cell
def _(charts, clause_table, pl):
    (
        charts.clause_bars(
            clause_table.unpivot(
                index="clause",
                on=["accuracy", "accuracy (pass/violate)"],
                variable_name="series",
            )
        )
        if clause_table is not None
        else None
    )
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · Your labels

    The judge is exact for these rules, but the point of calibration (seed 001, §4 module 2) is
    the day the rules are not enough: people review a sample of the GRM's verdicts, and where they
    disagree, either the clause is ambiguous or the GRM is wrong. Mark the GRM's verdicts on the
    dialogue above — **agree**, **disagree** (the opposite verdict is recorded), or leave them
    skipped — then save. Labels go to `data/labels/` (`labels.jsonl` + the labelled
    trajectories) and feed both the calibration below and the next `kitchen grm train`.
    """)
    return


@app.cell
def _(Path, notebook, paths, tempfile):
    # A person labels into data/labels; a script run (CI, tests) never writes there.
    labels_dir = (
        paths.DATA / "labels"
        if notebook.interactive()
        else Path(tempfile.mkdtemp(prefix="kitchen-nb03-labels-"))
    )
    return (labels_dir,)


@app.cell
def _(mo, notebook, review):
    _default = "skip" if notebook.interactive() else notebook.arg("label_default", "agree")
    marks = mo.ui.dictionary(
        {
            f"t{v.turn} {v.clause} {v.verdict}": mo.ui.radio(
                ["agree", "disagree", "skip"], value=_default, inline=True
            )
            for v in review.verdicts
            if v.verdict in ("pass", "violate")
        }
    )
    annotator = mo.ui.text(
        value="notebook-script (not a person)" if not notebook.interactive() else "",
        label="your name or initials",
    )
    save_button = mo.ui.run_button(label="Save labels")
    mo.vstack([marks, mo.hstack([annotator, save_button], justify="start")])
    return annotator, marks, save_button


@app.cell
def _(
    HumanLabel,
    annotator,
    labels_dir,
    marks,
    mo,
    notebook,
    pc,
    save_button,
    save_label,
    traj,
):
    saved = 0
    if notebook.gate(save_button):
        for _key, _choice in marks.value.items():
            if _choice == "skip":
                continue
            _turn, _clause, _verdict = _key.split()
            if _choice == "disagree":
                _verdict = "violate" if _verdict == "pass" else "pass"
            save_label(
                labels_dir,
                HumanLabel(
                    trajectory=traj.id,
                    turn=int(_turn[1:]),
                    clause=_clause,
                    verdict=_verdict,
                    annotator=annotator.value or "anonymous",
                    agrees_with="grm",
                ),
                traj,
                pc,
            )
            saved += 1
    mo.md(f"Saved {saved} labels to `{labels_dir}`." if saved else "No labels saved yet.")
    return (saved,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    Every label in the folder, folded in: the GRM against people, and the judge against the same
    people (where the judge and people disagree, a rule may be worded badly).
    """)
    return


@app.cell
def _(agreement, grm, judge, labels_dir, load_labels, mo, saved):
    _ = saved  # re-read the folder after every save
    label_set = load_labels(labels_dir)
    _ids = [t for t in label_set.trajectories if label_set.for_trajectory(t)]
    if _ids:
        _trajs = [label_set.trajectories[t] for t in _ids]
        _pcs = [label_set.constitutions[t] for t in _ids]
        _marks = [label_set.for_trajectory(t) for t in _ids]
        human_report = agreement(grm.review(_trajs, _pcs), _marks, name="human")
        judge_vs_human = agreement(
            [judge(t, c) for t, c in zip(_trajs, _pcs, strict=True)], _marks, name="human"
        )
        _view = mo.md(
            f"**{len(label_set.labels)} labels** on {len(_ids)} dialogues\n\n"
            f"GRM vs people:\n```text\n{human_report.table()}\n```\n"
            f"judge vs people: {judge_vs_human.accuracy:.1%} of {judge_vs_human.cells} cells"
        )
    else:
        human_report = judge_vs_human = None
        _view = mo.md(f"No labels in `{labels_dir}` yet.")
    _view
    return human_report, judge_vs_human, label_set


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Voting on and off

    A single review is one sample of a noisy reviewer. Seed 000 (FAQ 2) tames process-reward
    noise by sampling several reviews and taking the majority verdict per (turn, clause). Below:
    greedy decoding against a vote of K samples at temperature T, clause by clause, on the same
    pool. Voting costs K generations; the cascade (rule judge first) and greedy decoding are the
    cheap alternatives.
    """)
    return


@app.cell
def _(mo, notebook):
    votes = mo.ui.slider(
        3,
        9,
        step=2,
        value=notebook.arg("votes", 3 if not notebook.interactive() else 5),
        label="K samples",
    )
    vote_temperature = mo.ui.slider(0.3, 1.2, step=0.1, value=0.7, label="temperature T")
    vote_button = mo.ui.run_button(label="Compare")
    mo.hstack([votes, vote_temperature, vote_button], justify="start")
    return vote_button, vote_temperature, votes


@app.cell
def _(
    GRM,
    agreement,
    grm,
    judged,
    mo,
    notebook,
    pl,
    pool_pcs,
    pool_trajs,
    report,
    vote_button,
    vote_temperature,
    votes,
):
    if notebook.gate(vote_button) and report is not None:
        _voter = GRM(
            grm.model,
            grm.tok,
            grm.cfg.model_copy(
                update={"samples": votes.value, "temperature": vote_temperature.value}
            ),
        )
        _voted, _samples = _voter.review_with_samples(pool_trajs, pool_pcs)
        voted_report = agreement(_voted, judged)
        single_report = agreement([s[0] for s in _samples], judged)
        _rows = []
        for _name, _rep in (
            ("greedy", report),
            (f"1 sample, T={vote_temperature.value:.1f}", single_report),
            (f"vote of {votes.value}, T={vote_temperature.value:.1f}", voted_report),
        ):
            _rows += [
                {"clause": c.clause, "series": _name, "value": c.decided_accuracy}
                for c in _rep.clauses
            ]
            _rows.append({"clause": "all", "series": _name, "value": _rep.decided_accuracy})
        voting = pl.DataFrame(_rows)
        _view = mo.md(
            f"accuracy on pass/violate cells — greedy {report.decided_accuracy:.1%}, one sample "
            f"{single_report.decided_accuracy:.1%}, vote {voted_report.decided_accuracy:.1%}; "
            f"all cells — greedy {report.accuracy:.1%}, vote {voted_report.accuracy:.1%}"
        )
    else:
        voting = voted_report = single_report = None
        _view = mo.callout(mo.md("Review the pool first, then click **Compare**."))
    _view
    return single_report, voted_report, voting


@app.cell
def _(charts, voting):
    charts.clause_bars(voting) if voting is not None else None
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - A review is structured: one verdict per agent turn and clause, with reasons — the process
      reward is read off it, and every reward traces back to a clause.
    - The constitution is input: one GRM judges every diner's personal rules.
    - Only the GRM's own output is parsed; agent text is escaped and attempts to steer the
      reviewer (fake verdicts, "ignore the rules", forged delimiters) are flagged in the review.
    - A parse failure masks verdicts (no reward), never turns them into passes.
    - Calibrate against an independent reference: the rule judge here, people in general.
      `kitchen grm calibrate` prints per-clause accuracy, kappa, confusion and the voting gain.
    - Next: `04_credit_assignment.py` — how MAPO turns these verdicts into advantages.
    """)
    return


if __name__ == "__main__":
    app.run()
