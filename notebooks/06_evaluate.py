import marimo

__generated_with = "0.25.2"
app = marimo.App(width="medium")


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    # 06 · Evaluate: is the RL policy better, for diners it never saw?

    Training reward going up is not the model getting better: a policy can learn to please its
    reward model. So evaluation here is **decoupled** from the training reward: held-out tasks and
    held-out diners, verdicts from the independent **rule judge**, never the GRM. Four checks must
    hold together (`docs/method.md#validation`):

    1. a **win rate** against the SFT policy well above 50 % (same task, diner and seed);
    2. **clause compliance** up — and **zero axiom violations**;
    3. **personalisation** — behaviour differs across diners as their clauses ask;
    4. no **reward hacking** — the GRM's reward and the judge's do not drift apart.
    """)
    return


@app.cell
def _():
    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.evaluate import EvalConfig, evaluate
    from kitchen.models import ModelSpec, load_model
    from kitchen.train import latest_checkpoint, load_run_policy
    from kitchen.world import render_transcript

    return (
        EvalConfig,
        ModelSpec,
        charts,
        evaluate,
        latest_checkpoint,
        load_model,
        load_run_policy,
        mo,
        notebook,
        paths,
        pl,
        render_transcript,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · Which policies

    The RL policy comes from a run folder (`kitchen cook` or `make demo` writes one); the
    baseline is the shipped SFT policy. Without a finished run, the notebook evaluates the SFT
    policy against itself, which must give a win rate near 50 % — a useful sanity check.
    """)
    return


@app.cell
def _(mo, notebook, paths):
    run_dir = mo.ui.text(
        value=notebook.arg("run", str(paths.RUNS / "demo-mapo")), label="run", full_width=True
    )
    tasks = mo.ui.slider(2, 60, value=notebook.arg("tasks", 3), label="held-out tasks")
    samples = mo.ui.slider(1, 4, value=notebook.arg("samples", 1), label="episodes per task")
    mo.vstack([run_dir, mo.hstack([tasks, samples])])
    return run_dir, samples, tasks


@app.cell
def _(ModelSpec, latest_checkpoint, load_model, load_run_policy, paths, run_dir):
    from pathlib import Path

    baseline = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    baseline[0].eval()
    if latest_checkpoint(Path(run_dir.value)) is not None:
        policy, policy_name = load_run_policy(run_dir.value), Path(run_dir.value).name
    else:
        policy, policy_name = baseline, "sft (no run found)"
    return baseline, policy, policy_name


@app.cell
def _(mo):
    eval_button = mo.ui.run_button(label="evaluate")
    eval_button
    return (eval_button,)


@app.cell
def _(EvalConfig, baseline, eval_button, evaluate, notebook, policy, samples, tasks):
    report, episodes = None, {}
    if notebook.gate(eval_button):
        report, episodes = evaluate(
            policy,
            EvalConfig(tasks=tasks.value, samples=samples.value, bootstrap=500),
            baseline=baseline,
            with_guard=True,
        )
    return episodes, report


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · Win rate and compliance

    The judged score of a dialogue is `success + compliance` (compliance: the weight-averaged
    share of applicable clause verdicts that pass). Pairs are the same task, diner and seed.
    The interval is a 95 % bootstrap.
    """)
    return


@app.cell
def _(charts, mo, pl, policy_name, report):
    clause_table = pl.DataFrame()
    if report is None:
        _out = mo.md("*Press evaluate.*")
    else:
        _w = report.win_rate
        clause_table = pl.DataFrame(
            [
                {"series": name, "clause": c, "value": v}
                for name, rep in (
                    ("policy", report.policy),
                    ("sft", report.baseline),
                    ("policy + guard", report.guarded),
                )
                for c, v in rep.clause_pass.items()
            ]
        )
        _summary = pl.DataFrame(
            [
                {
                    "policy": name,
                    "success": rep.success,
                    "compliance": rep.compliance,
                    "axiom violations": rep.axiom_violations,
                    "valid actions": rep.valid_actions,
                    "guard interceptions": rep.guard_interceptions,
                }
                for name, rep in (
                    (policy_name, report.policy),
                    ("sft", report.baseline),
                    (f"{policy_name} + guard", report.guarded),
                )
            ]
        )
        _out = mo.vstack(
            [
                mo.md(f"**win rate vs SFT: {_w[0]:.1%}** (95% interval {_w[1]:.1%} – {_w[2]:.1%})"),
                _summary,
                charts.clause_bars(clause_table, "value", "series"),
            ]
        )
    _out
    return (clause_table,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · Personalisation

    The same tasks, different diners: words per message by verbosity (brief diners should read
    less), small talk before the recommendation by pace (hurried diners should get none), and
    how often the agent asks for the cuisine when the request names none.
    """)
    return


@app.cell
def _(mo, pl, report):
    personal = pl.DataFrame()
    if report is not None:
        personal = pl.DataFrame(
            [
                {"metric": k, "policy": v, "sft": report.baseline.personalisation.get(k)}
                for k, v in report.policy.personalisation.items()
            ]
        )
    personal if report is not None else mo.md("*Press evaluate.*")
    return (personal,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Side by side

    Two different diners, the same task: the SFT dialogue and the RL dialogue.
    """)
    return


@app.cell
def _(episodes, mo, render_transcript):
    if not episodes:
        _out = mo.md("*Press evaluate.*")
    else:
        _pol, _sft = episodes["policy"], episodes["baseline"]
        _seen, _picks = set(), []
        for _i, _t in enumerate(_pol):
            if _t.profile not in _seen:
                _seen.add(_t.profile)
                _picks.append(_i)
            if len(_picks) == 2:
                break
        _out = mo.vstack(
            [
                mo.hstack(
                    [
                        mo.md(
                            f"**SFT** ({_sft[i].profile})\n```text\n{render_transcript(_sft[i])}\n```"
                        ),
                        mo.md(
                            f"**RL** ({_pol[i].profile})\n```text\n{render_transcript(_pol[i])}\n```"
                        ),
                    ],
                    widths="equal",
                )
                for i in _picks
            ]
        )
    _out
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - Evaluate on held-out tasks and diners, with a judge the policy was never trained against.
    - A win rate needs its interval: with a few dozen pairs, 60 % can still be chance.
    - Axiom violations are counted apart: the goal is zero, and the axiom guard enforces it at
      inference whatever the policy learned (compare "policy" and "policy + guard").
    - Personalisation is measured, not assumed: the same task must play out differently for a
      brief, hurried diner and a detailed, relaxed one.
    """)
    return


if __name__ == "__main__":
    app.run()
