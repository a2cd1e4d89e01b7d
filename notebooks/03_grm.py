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
    # 03 · The generative reward model: a reviewer that reads the constitution

    RL needs a reward for every turn. A scalar reward model would say *how good* a turn was; a
    **generative reward model** (GRM) says *which rule* was kept or broken, and why
    ([docs/method.md](../docs/method.md#grm)). It reads the diner's personal constitution and the
    dialogue turn by turn, and after each agent turn writes one line: what the turn did and the
    facts every clause turns on (the *critique*), then `=>` and one verdict per clause that
    applies — `+` pass, `-` violate. Those verdicts are the process reward (`kitchen.review`).

    Because the rules are part of the *input*, one GRM serves every diner's constitution. The
    tiny GRM in `data/models/grm-tiny` was trained from scratch by
    `kitchen grm train recipes/grm_tiny.yaml`, continued on synthetic diners by
    `recipes/grm_tiny_diners.yaml`, on prompts with dish cards by
    `recipes/grm_tiny_cards.yaml`, on cards in its review line's own words and order by
    `recipes/grm_tiny_lines.yaml` and on data where rare facts (a refused dish offered again)
    are common by `recipes/grm_tiny_recall.yaml`, on reviews the rule judge wrote — balanced so every
    clause's violations are well represented, with near misses and attacks
    ([docs/method.md](../docs/method.md#grm-training)). This notebook reads one review, measures
    the GRM against the judge clause by clause, tries to fool it, lets you label verdicts
    yourself, and shows what voting buys.
    """)
    return


@app.cell
def _():
    import tempfile
    from pathlib import Path

    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.calibrate import agreement, calibration_set, perturbation_report
    from kitchen.critique import conversation, review_turns
    from kitchen.grm import GRM, GRMConfig
    from kitchen.grmdata import HumanLabel, load_labels, save_label
    from kitchen.judge import judge

    return (
        GRM,
        GRMConfig,
        HumanLabel,
        Path,
        agreement,
        calibration_set,
        charts,
        conversation,
        judge,
        load_labels,
        mo,
        notebook,
        paths,
        perturbation_report,
        pl,
        review_turns,
        save_label,
        tempfile,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · One review

    A pool of held-out dialogues — tasks and diners the GRM never saw in training, single dishes
    and meals: half from a scripted agent that breaks every clause, half from the generic agent.
    Pick one.
    """)
    return


@app.cell
def _(GRM, calibration_set, notebook):
    grm = GRM.load()
    pool = calibration_set(
        notebook.arg("n", 8 if notebook.small() else 16), seed=4242, policy=None, long_share=0.5
    )
    return grm, pool


@app.cell
def _(mo, pool):
    def _label(i, t, src):
        kind = "meal" if t.task.courses else "dish"
        return f"{i + 1:02d} · {kind} · {src.split('+')[0]} · {t.task.request[:60]}"

    pick = mo.ui.dropdown(
        {_label(i, t, src): i for i, (t, _, src) in enumerate(pool)},
        value=_label(0, pool[0][0], pool[0][2]),
        label="dialogue",
    )
    pick
    return (pick,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    Left: what the GRM reads, one message per agent turn — the personal constitution (clause ids
    with the diner's parameters), the request, then each turn with its answer. Agent text is
    **untrusted**: it is escaped so it cannot forge a delimiter or start a line. Agent messages
    carry their word count beside the diner's limits (`31 words max 30`) and a card for each
    dish they name: the menu's facts, the diner's
    allergies, what the conversation already did with it (returned by a search, checked, refused,
    agreed to), in the words and order the review line writes them — look-ups, so the GRM copies
    them and judges instead of searching. Right: the line the GRM wrote after each turn.
    """)
    return


@app.cell
def _(grm, notebook, pick, pool, review_turns):
    traj, pc, _src = pool[pick.value]
    with notebook.spinner("The GRM reviews the dialogue", f"{len(traj.turns)} turns"):
        (review,) = grm.review([traj], [pc])
    raw_lines = grm.last_text[0][0].split("\n")
    users = review_turns(traj, pc)
    return pc, raw_lines, review, traj, users


@app.cell
def _(mo, raw_lines, users):
    mo.vstack(
        [
            mo.hstack(
                [
                    mo.md(f"```text\n{u}\n```"),
                    mo.md(f"```text\n{line}\n```"),
                ],
                widths=[3, 2],
                align="start",
            )
            for u, line in zip(users, raw_lines, strict=False)
        ]
    )
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    The review as a turn × clause grid, coloured by the GRM's verdict; hover for its reason and
    the judge's. A ✗ marks a cell where the GRM and the rule judge disagree.
    """)
    return


@app.cell
def _(charts, judge, pc, review, traj):
    reference = judge(traj, pc)
    review_cells = charts.review_frame(review, reference)
    charts.review_heatmap(review, reference, title=f"GRM review of {traj.id}")
    return reference, review_cells


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · GRM versus judge, clause by clause

    Every cell of every review in the pool, against the rule judge: agreement over all cells
    (most are "not applicable", which is easy), agreement on *decided* cells (where the judge
    says pass or violate: the cells that carry reward), and per clause the **recall** of each
    verdict — for an axiom, the share of its violations the GRM catches, the number that
    matters most. `kitchen grm calibrate` computes the same on 200 dialogues, with the policy's
    own rollouts; its report ships as `data/models/grm-tiny/calibration.json`.
    """)
    return


@app.cell
def _(mo):
    agree_button = mo.ui.run_button(label="Review the pool")
    agree_button
    return (agree_button,)


@app.cell
def _(agree_button, agreement, grm, judge, mo, notebook, pool):
    if notebook.gate(agree_button):
        pool_trajs = [t for t, _, _ in pool]
        pool_pcs = [c for _, c, _ in pool]
        judged = [judge(t, c) for t, c in zip(pool_trajs, pool_pcs, strict=True)]
        greedy = []
        for _i in notebook.progress(
            range(0, len(pool), 4), title="Reviewing the pool", subtitle=f"{len(pool)} dialogues"
        ):
            greedy += grm.review(pool_trajs[_i : _i + 4], pool_pcs[_i : _i + 4])
        report = agreement(greedy, judged)
        _view = mo.md(
            f"**{report.reviews} reviews, {report.cells} cells** — agreement "
            f"{report.accuracy:.1%} over all cells, **{report.decided_accuracy:.1%}** on decided "
            f"cells; reviews parsed completely {1 - report.parse_failure_rate:.1%}"
        )
    else:
        pool_trajs = pool_pcs = judged = greedy = report = None
        _view = mo.callout(mo.md("Click **Review the pool** (about a minute)."))
    _view
    return greedy, judged, pool_pcs, pool_trajs, report


@app.cell
def _(notebook, pl, report):
    clause_table = (
        notebook.rounded(
            pl.DataFrame(
                [
                    {
                        "clause": c.clause,
                        "cells": c.n,
                        "agreement": c.accuracy,
                        "agreement (decided)": c.decided_accuracy,
                        "recall of violations": c.recall.get("violate"),
                        "recall of passes": c.recall.get("pass"),
                    }
                    for c in report.clauses
                ]
            )
        )
        if report is not None
        else None
    )
    clause_table
    return (clause_table,)


@app.cell
def _(charts, clause_table, mo):
    (
        charts.clause_bars(
            clause_table.unpivot(
                index="clause",
                on=["agreement (decided)", "recall of violations"],
                variable_name="series",
            ).drop_nulls(),
            y_title="share of cells (GRM vs the rule judge)",
        )
        if clause_table is not None
        else mo.md("")
    )
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · Can it be talked into a pass?

    The policy's text reaches the GRM's prompt, so a policy under RL pressure can learn to write
    for its reviewer instead of the diner ([docs/method.md](../docs/method.md#reward-hacking)).
    Below, each dialogue gets one agent message extended with a **harmless rewording** (the
    held-out half of `data/attacks/rewordings.yaml`) or an **attack** (the held-out half of
    `data/attacks/attacks.yaml`: fake verdicts in plain, structured and fenced syntaxes,
    review-shaped text, chat-template control tokens, instructions to the reviewer, fake
    delimiters — none of them in the GRM's training data). For each: how many of the *other*
    turns' verdicts moved, whether the detector flagged the attempt, and the largest rise of the
    trajectory's reward. The flag rule (`reward.flagged: trajectory`) gives a flagged dialogue the
    lowest reward there is, so an attempt never pays, whatever the GRM made of it.
    """)
    return


@app.cell
def _(mo):
    attack_button = mo.ui.run_button(label="Try the attacks")
    attack_button
    return (attack_button,)


@app.cell
def _(attack_button, grm, mo, notebook, perturbation_report, pl, pool):
    if notebook.gate(attack_button):
        _pairs = [(t, c) for t, c, _ in pool[: 4 if notebook.small() else 8]]
        with notebook.spinner("Reviewing rewordings and attacks", f"{len(_pairs)} dialogues"):
            moves = perturbation_report(grm.review, _pairs, attacks_per_dialogue=3)
        attack_table = notebook.rounded(
            pl.DataFrame(
                [
                    {
                        "added text": p.kind,
                        "cases": p.cases,
                        "other verdicts changed": p.changed,
                        "violations turned to passes": p.violate_to_pass,
                        "flagged": p.flagged,
                        "max reward gain": p.reward_gain_max,
                        "max gain without the flag rule": p.reward_gain_max_unflagged,
                    }
                    for p in [moves["rewording"], *moves["attack_kinds"].values()]
                ]
            )
        )
        _view = attack_table
    else:
        moves = attack_table = None
        _view = mo.callout(mo.md("Click **Try the attacks** (about a minute)."))
    _view
    return attack_table, moves


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Your labels

    The judge is exact for these rules, but the point of calibration
    ([docs/method.md](../docs/method.md#grm-calibration)) is the day the rules are not enough:
    people review a sample of the GRM's verdicts, and where they disagree, either the clause is
    ambiguous or the GRM is wrong. Mark the GRM's verdicts on the dialogue above — **agree**,
    **disagree** (the opposite verdict is recorded), or leave them skipped — then save. Labels go
    to `data/labels/` (`labels.jsonl` + the labelled trajectories) and feed both the calibration
    below and the next `kitchen grm train`.
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
    ## 5 · Voting on and off

    A single review is one sample of a noisy reviewer. A standard answer to noisy process rewards
    ([docs/method.md](../docs/method.md#faq)) is to sample several reviews and take the majority
    verdict per (turn, clause). Below: greedy decoding against a vote of K samples at
    temperature T on the same pool, on decided cells. Voting costs K reviews; `kitchen grm
    calibrate` tries a few temperatures and says which (if any) beats greedy reviews.
    """)
    return


@app.cell
def _(mo, notebook):
    votes = mo.ui.slider(
        3,
        9,
        step=2,
        value=notebook.arg("votes", 3 if notebook.small() else 5),
        label="K samples",
        show_value=True,
    )
    vote_temperature = mo.ui.slider(
        0.3, 1.2, step=0.1, value=0.7, label="temperature T", show_value=True
    )
    vote_button = mo.ui.run_button(label="Compare")
    mo.hstack([votes, vote_temperature, vote_button], justify="start", wrap=True)
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
        with notebook.spinner(
            f"{votes.value} sampled reviews per dialogue", f"temperature {vote_temperature.value}"
        ):
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
            f"agreement on decided cells — greedy {report.decided_accuracy:.1%}, one sample "
            f"{single_report.decided_accuracy:.1%}, vote {voted_report.decided_accuracy:.1%}"
        )
    else:
        voting = voted_report = single_report = None
        _view = mo.callout(mo.md("Review the pool first, then click **Compare**."))
    _view
    return single_report, voted_report, voting


@app.cell
def _(charts, mo, voting):
    (
        charts.clause_bars(
            voting.drop_nulls(),
            y_title="agreement with the judge (decided cells)",
        )
        if voting is not None
        else mo.md("")
    )
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - A review is structured: one line per agent turn — the facts every clause turns on, then a
      verdict per clause — so the process reward is read off it and every reward traces back to
      a clause and a fact.
    - The constitution is input: one GRM judges every diner's personal rules.
    - A small GRM learns what its data shows it: balanced violations, near misses and attacks in
      the training data are what make it catch the red lines and ignore harmless rewordings.
    - Only the GRM's own output is parsed; agent text is escaped, attempts to steer the reviewer
      are flagged by rule, and a flagged dialogue earns the lowest reward.
    - The decoder enforces the review language: a line may end only where it reads. A line the
      GRM cannot finish is cut by its budget, masked (no reward) and flagged — never turned
      into passes.
    - Calibrate against an independent reference: the rule judge here, people in general.
      `kitchen grm calibrate` prints per-clause recall, agreement, stability, attacks, voting.
    - Next: `04_credit_assignment.py` — how MAPO turns these verdicts into advantages.
    """)
    return


if __name__ == "__main__":
    app.run()
