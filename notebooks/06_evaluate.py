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
    import tempfile
    import warnings
    from pathlib import Path

    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.evaluate import EvalConfig, evaluate
    from kitchen.models import ModelSpec, load_adapter, load_model
    from kitchen.train import Run, latest_checkpoint, load_recipe, load_run_policy
    from kitchen.world import render_transcript

    # peft 0.21 asks transformers 5 for the deprecated `is_gradient_checkpointing` when it adds
    # the policy's LoRA adapter: a FutureWarning about the libraries, not about this notebook.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
    return (
        EvalConfig,
        ModelSpec,
        Path,
        Run,
        charts,
        evaluate,
        latest_checkpoint,
        load_adapter,
        load_model,
        load_recipe,
        load_run_policy,
        mo,
        notebook,
        paths,
        pl,
        render_transcript,
        tempfile,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · Which policies

    The baseline is the shipped SFT policy (`data/models/policy-tiny`). The RL policy is the
    first of these that exists:

    1. the MAPO adapter shipped in `data/models/mapo-tiny` (trained by the main job; its
       `PROVENANCE.md` says how);
    2. the newest checkpoint of the run folder below (`kitchen cook` or `make demo` writes one);
    3. otherwise, a small MAPO policy trained here behind the button: a few iterations of
       `recipes/tiny_mapo.yaml` — a short run, so expect a small difference from SFT.

    The SFT policy is never compared with itself.
    """)
    return


@app.cell
def _(mo, notebook, paths):
    _small = notebook.small()
    run_dir = mo.ui.text(
        value=notebook.arg("run", str(paths.RUNS / "demo-mapo")),
        label="run folder",
        full_width=True,
    )
    tasks = mo.ui.slider(
        2,
        60,
        value=notebook.arg("tasks", 3 if _small else 12),
        label="held-out tasks",
        show_value=True,
    )
    samples = mo.ui.slider(
        1, 4, value=notebook.arg("samples", 1), label="episodes per task", show_value=True
    )
    meals = mo.ui.slider(
        0.0,
        1.0,
        step=0.25,
        value=notebook.arg("meals", 0.5),
        label="share of meals",
        show_value=True,
    )
    mo.vstack([run_dir, mo.hstack([tasks, samples, meals], justify="start", gap=2, wrap=True)])
    return meals, run_dir, samples, tasks


@app.cell
def _(meals, mo, samples, tasks):
    _n = tasks.value * samples.value
    mo.md(
        f"Evaluation plays **{_n} held-out dialogue{'s' if _n != 1 else ''}** "
        f"({tasks.value} tasks × {samples.value} episode{'s' if samples.value != 1 else ''}, "
        f"about {meals.value:.0%} of the tasks meals of several courses) "
        "with each of: the RL policy, the SFT policy, and the RL policy behind the axiom guard."
    )
    return


@app.cell
def _(
    ModelSpec,
    Path,
    latest_checkpoint,
    load_adapter,
    load_model,
    load_run_policy,
    mo,
    notebook,
    paths,
    run_dir,
):
    baseline = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    baseline[0].eval()
    _shipped = Path(notebook.arg("shipped", str(paths.DATA / "models" / "mapo-tiny")))
    if (_shipped / "adapter_config.json").is_file():  # an adapter on the SFT policy's base
        _base, _tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
        found = (load_adapter(_base, _shipped, "policy", trainable=False).eval(), _tok)
        found_name = f"{_shipped.name} (shipped)"
    elif latest_checkpoint(_shipped) is not None:  # shipped as a run folder
        found, found_name = load_run_policy(_shipped), f"{_shipped.name} (shipped)"
    elif latest_checkpoint(Path(run_dir.value)) is not None:
        found, found_name = load_run_policy(run_dir.value), Path(run_dir.value).name
    else:
        found, found_name = None, None
    (
        mo.callout(mo.md(f"RL policy: **{found_name}**; baseline: the SFT policy."), kind="info")
        if found is not None
        else mo.callout(
            mo.md(
                f"No shipped MAPO adapter (`{_shipped}`) and no "
                f"checkpoint in `{run_dir.value}`: train a small MAPO policy below first."
            ),
            kind="warn",
        )
    )
    return baseline, found, found_name


@app.cell
def _(found, load_recipe, mo, notebook, paths):
    # What "trains one briefly" means: the main job's recipe, a few iterations, no evaluation
    # or samples during training (this notebook evaluates afterwards).
    _small = notebook.small()
    _r = load_recipe(paths.HOME / "recipes" / "tiny_mapo.yaml")
    brief_recipe = _r.model_copy(
        update={
            "name": "nb06-brief-mapo",
            "train": _r.train.model_copy(
                update={
                    "iterations": notebook.arg("rl_iterations", 2 if _small else 4),
                    "tasks_per_iteration": 2 if _small else _r.train.tasks_per_iteration,
                }
            ),
            "rollout": _r.rollout.model_copy(update={"k": 4} if _small else {}),
            "eval_every": 0,
            "samples_per_iteration": 0,
        }
    )
    _n = brief_recipe.train.iterations
    train_rl = mo.ui.run_button(
        label=f"Train a small MAPO policy ({_n} iteration{'s' if _n != 1 else ''})"
    )
    train_rl if found is None else None
    return brief_recipe, train_rl


@app.cell
def _(Run, brief_recipe, charts, found, found_name, mo, notebook, pl, tempfile, train_rl):
    brief_run = None
    if found is not None:
        policy, policy_name = found, found_name
        _out = None
    elif notebook.gate(train_rl):
        _n = brief_recipe.train.iterations
        _per = brief_recipe.train.tasks_per_iteration * brief_recipe.rollout.k
        with notebook.spinner("Loading the policy and the reviewer"):
            brief_run = Run(brief_recipe, folder=tempfile.mkdtemp(prefix="nb06-"), progress=False)
        _rows, _chart = [], None
        for _i in notebook.progress(
            range(_n),
            title=f"Training MAPO: {_n} iterations",
            subtitle=f"each: {_per} dialogues played, reviewed, then one update",
        ):
            _rows.append(brief_run.step())
            _chart = charts.run_curves(
                pl.DataFrame(_rows, infer_schema_length=None),
                ["reward/global_mean", "judge/compliance"],
                f"training rewards (iteration {_i + 1} of {_n})",
            )
            notebook.show(_chart)
        brief_run.model.eval()
        policy = (brief_run.model, brief_run.tok)
        policy_name = f"mapo ({_n} iterations here)"
        _out = mo.vstack([mo.md(f"Trained **{policy_name}**: ready to evaluate."), _chart])
    else:
        policy, policy_name = None, None
        _out = mo.md("*Press the button above to train the RL policy.*")
    _out
    return brief_run, policy, policy_name


@app.cell
def _(mo, policy):
    eval_button = mo.ui.run_button(label="evaluate", disabled=policy is None)
    eval_button
    return (eval_button,)


@app.cell
def _(
    EvalConfig,
    baseline,
    eval_button,
    evaluate,
    meals,
    notebook,
    policy,
    policy_name,
    samples,
    tasks,
):
    report, episodes = None, {}
    if policy is not None and notebook.gate(eval_button):
        _n = tasks.value * samples.value
        with notebook.spinner(
            f"Playing {_n} held-out dialogues three times",
            f"{policy_name}, the SFT policy, {policy_name} + guard; the rule judge scores them",
        ):
            report, episodes = evaluate(
                policy,
                EvalConfig(
                    tasks=tasks.value,
                    samples=samples.value,
                    long_share=meals.value,
                    bootstrap=500,
                ),
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
def _(charts, mo, notebook, pl, policy_name, report):
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
        _summary = notebook.rounded(
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
                mo.md(
                    f"**Win rate of {policy_name} against SFT: {_w[0]:.1%}** "
                    f"(95% interval {_w[1]:.1%} – {_w[2]:.1%}; 50 % = no difference)"
                ),
                _summary,
                charts.clause_bars(
                    clause_table, "value", "series", y_title="pass rate (rule judge)"
                ).properties(title="pass rate per clause, held-out dialogues"),
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
def _(mo, notebook, report):
    personal = None
    if report is not None:
        personal = notebook.rounded(
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

    The same held-out task, diner and seed played by the SFT policy (left) and the RL policy
    (right), for the first two diners of the evaluation — each row is a different task.
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
                mo.vstack(
                    [
                        mo.md(f"**Task:** {_pol[i].task.request} · **diner:** `{_pol[i].profile}`"),
                        mo.hstack(
                            [
                                mo.md(f"**SFT**\n```text\n{render_transcript(_sft[i])}\n```"),
                                mo.md(f"**RL**\n```text\n{render_transcript(_pol[i])}\n```"),
                            ],
                            widths="equal",
                            gap=1,
                        ),
                    ]
                )
                for i in _picks
            ],
            gap=1.5,
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
    - The RL policy here is only as good as its training: a few iterations trained in this
      notebook move little; the main job's adapter (`make demo`) is the real comparison.
    """)
    return


if __name__ == "__main__":
    app.run()
