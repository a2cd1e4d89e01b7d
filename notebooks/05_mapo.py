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
    # 05 · MAPO: the training loop, live

    Everything so far meets here. One iteration of the loop ([docs/method.md](../docs/method.md#policy-update)):

    1. sample tasks and diners, and personalise the constitution for each (cached);
    2. roll out **K** dialogues per (task, diner) with the policy;
    3. the **GRM** reviews every turn against every clause → a *local* reward per turn;
       the world's outcome → a *global* reward per dialogue;
    4. the step samples (one per trainable turn) go into the **replay buffer** (for presets that
       use one: `mapo`);
    5. **advantages**: the local reward z-scored among samples in the same state (now and from
       the buffer), the global one within the task group, mixed `α·local + (1−α)·global`;
    6. **REINFORCE** with a KL penalty to the SFT model (the base with the LoRA adapter off).

    Pick a preset and its knobs, press *train*, and watch per-clause rewards, advantages, KL and
    entropy move. Below, browse the last iteration's dialogues turn by turn.
    """)
    return


@app.cell
def _():
    import warnings

    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.mapo import PRESETS
    from kitchen.review import turn_rewards
    from kitchen.train import AdvantageChoice, Recipe, Run, load_recipe
    from kitchen.world import render_transcript

    main_grm = load_recipe(paths.RECIPES / "tiny_mapo.yaml").grm  # the main job's GRM settings

    # peft 0.21 asks transformers 5 for the deprecated `is_gradient_checkpointing` when it adds
    # the policy's LoRA adapter: a FutureWarning about the libraries, not about this notebook.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
    return (
        AdvantageChoice,
        PRESETS,
        Recipe,
        Run,
        charts,
        main_grm,
        mo,
        notebook,
        pl,
        render_transcript,
        turn_rewards,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · The knobs

    `grpo` is outcome-only (α = 0). `mapo` adds the step-level term from state groups backed by
    the buffer, with α growing on a schedule: global first, local later (a large local weight
    invites gaming the reviewer: [docs/method.md](../docs/method.md#reward-hacking)). The reviewer can be the GRM (the method) or
    the rule judge (an oracle: what a perfect GRM would give). The GRM is set up as in the main
    job (`recipes/tiny_mapo.yaml`): it reviews every clause except the two word counts (T3, T6)
    and the privacy red line (A2: a phone number or e-mail in a message, a question for a name,
    phone, e-mail or address), which code decides exactly — a cascade.

    As in the main job, the learning rate starts high and falls to a tenth of itself (cosine),
    β adapts to a KL target (it doubles while the policy runs further than 0.1 from the
    reference and falls back to the slider's β once it is near), and a meal's global reward is
    the share of its courses ordered right (`reward.outcome: progress`). This run is short — 16
    iterations, 128 dialogues, about two minutes on one core — so it takes larger steps than the
    main job (3e-3 against 2e-3); the KL target is what keeps them safe. (A meal's share, not
    its success: a whole meal succeeds rarely, and with success alone most task groups would be
    all failures, whose global advantage is 0.) Push α towards 1 to see what the local term alone
    does: per-turn compliance rises while fewer meals get ordered — a turn that does little
    breaks few clauses.
    """)
    return


@app.cell
def _(PRESETS, mo, notebook):
    preset = mo.ui.dropdown(list(PRESETS), value=notebook.arg("preset", "mapo"), label="preset")
    alpha0 = mo.ui.slider(0.0, 1.0, step=0.05, value=0.2, label="α start", show_value=True)
    alpha1 = mo.ui.slider(0.0, 1.0, step=0.05, value=0.5, label="α end", show_value=True)
    k = mo.ui.slider(2, 16, value=notebook.arg("k", 4), label="K per task", show_value=True)
    tasks = mo.ui.slider(
        1, 8, value=notebook.arg("tasks", 2), label="tasks per iteration", show_value=True
    )
    iterations = mo.ui.slider(
        1,
        40,
        value=notebook.arg("iterations", 2 if notebook.small() else 16),
        label="iterations",
        show_value=True,
    )
    meals = mo.ui.slider(
        0.0,
        1.0,
        step=0.25,
        value=notebook.arg("meals", 0.5),
        label="share of meals",
        show_value=True,
    )
    lr = mo.ui.dropdown(
        ["2e-4", "5e-4", "1e-3", "2e-3", "3e-3"], value="3e-3", label="learning rate (peak)"
    )
    beta = mo.ui.slider(0.0, 0.2, step=0.01, value=0.02, label="KL β", show_value=True)
    kl_target = mo.ui.dropdown(
        ["none", "0.1", "0.3"], value="0.1", label="KL target (β adapts to it)"
    )
    reviewer = mo.ui.dropdown(
        ["grm", "judge"], value=notebook.arg("reviewer", "grm"), label="reviewer"
    )
    max_turns = mo.ui.slider(
        3, 10, value=notebook.arg("max_turns", 6), label="max turns", show_value=True
    )
    mo.vstack(
        [
            mo.hstack([preset, reviewer, lr], justify="start", gap=2, wrap=True),
            mo.hstack([alpha0, alpha1, beta, kl_target], justify="start", gap=2, wrap=True),
            mo.hstack([k, tasks, iterations], justify="start", gap=2, wrap=True),
            mo.hstack([meals, max_turns], justify="start", gap=2, wrap=True),
        ]
    )
    return (
        alpha0,
        alpha1,
        beta,
        iterations,
        k,
        kl_target,
        lr,
        max_turns,
        meals,
        preset,
        reviewer,
        tasks,
    )


@app.cell
def _(
    AdvantageChoice,
    Recipe,
    alpha0,
    alpha1,
    beta,
    iterations,
    k,
    kl_target,
    lr,
    main_grm,
    max_turns,
    meals,
    mo,
    notebook,
    preset,
    reviewer,
    tasks,
):
    # The controls become a recipe: the same object `kitchen cook RECIPE` reads from YAML.
    _overrides = {"beta": beta.value}
    _adapt = kl_target.value != "none" and beta.value > 0  # β adapts upward from a β > 0
    if _adapt:
        _overrides["kl_target"] = float(kl_target.value)
    if preset.value == "mapo":
        _overrides["alpha"] = {
            "kind": "linear",
            "alpha0": alpha0.value,
            "alpha1": alpha1.value,
            "steps": max(iterations.value, 1),
        }
    recipe = Recipe(
        name=f"nb05-{preset.value}",
        advantage=AdvantageChoice(preset=preset.value, overrides=_overrides),
        grm=main_grm,
        reward={"reviewer": reviewer.value, "outcome": "progress"},
        rollout={"k": k.value, "max_turns": max_turns.value, "long_max_turns": 24},
        train={
            "iterations": iterations.value,
            "tasks_per_iteration": tasks.value,
            "lr": float(lr.value),
            "lr_schedule": "cosine",  # large steps first, a tenth of them at the end
            "task_pool": 40,
            "long_share": meals.value,
        },
        # the held-out curve below: this many held-out tasks and diners, the same share of meals
        eval={
            "tasks": notebook.arg("eval_tasks", 4 if notebook.small() else 48),
            "samples": 1,
            "long_share": meals.value,
        },
        eval_every=0,
        samples_per_iteration=0,
        torch_threads=1,
    )
    _a = recipe.advantage.resolve().alpha
    _mix = (
        f"α = {_a.alpha0:g} throughout"
        if _a.kind == "constant"
        else f"α from {_a.alpha0:g} to {_a.alpha1:g} ({_a.kind}, over {_a.steps} updates)"
    )
    mo.md(
        f"**The recipe:** `{preset.value}` · {_mix} · KL β {beta.value:g}"
        + (f" adapted to a KL target of {kl_target.value}" if _adapt else "")
        + " · "
        f"learning rate {lr.value} falling to a tenth (cosine) · "
        f"{tasks.value} tasks × K {k.value} = {tasks.value * k.value} dialogues per iteration "
        f"({meals.value:.0%} meals of up to 24 turns), "
        f"{iterations.value} iteration{'s' if iterations.value != 1 else ''}, reviewed by the "
        f"{'GRM' if reviewer.value == 'grm' else 'rule judge'}."
    )
    return (recipe,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · Train

    Training runs in this notebook process (no run folder is written); each iteration appends a
    row of namespaced metrics (`reward/…`, `adv/…`, `kl/mean`, `policy/entropy`, `clause/…`).
    Before the first update and a few times during training the policy also plays held-out tasks
    with held-out diners, scored by the rule judge — never the reviewer it is trained on: that
    curve, not the reward, says whether the policy got better. It plays 48 of them (half meals)
    at each point, because on fewer the points scatter more than training moves them: on 8 tasks
    the same policy's compliance reads anywhere within ±0.04. On the shipped SFT policy (the
    cold start made after a copying warm-up) these defaults raise it: in seed 0 from 0.877 to
    0.899 (0.897, 0.871, 0.902 at iterations 4, 8 and 12 — one point dips), single dishes at
    every point (0.891 → 0.918), held-out success 38 → 44%; on 96 tasks, seeds 0 and 1, 0.868 →
    0.895 and 0.893, meals as well as single dishes (about three minutes on a 2-core machine;
    docs/results.md, "Notebook 05's train button"). On the cold start shipped before it, a run
    this short moved nothing past the scatter of its points, whatever the settings: its meals
    grew longer as it learnt to check, until more of them ran out of their 24 turns. Two more
    things to see. One clause moves at once: T5 (ask the cuisine when the request names none)
    went from 0.66 to 0.70–0.90 in 15 of the 17 runs measured on that earlier policy. And what
    the local term holds: set α start and end to 0 (the outcome alone) and, in a run of the same
    length on it, held-out meal compliance fell from 0.873 to 0.81–0.85 and the share of each
    meal fulfilled from 0.54 to 0.43–0.48 (seeds 0–2), where the defaults kept compliance at
    0.85–0.87 and raised the share to 0.56–0.58 — the outcome's credit, spread over twenty
    turns, erodes every turn.

    Meals are where credit assignment matters: a meal of several courses takes 12–20 turns, and
    one late mistake fails the whole order. The outcome-only `grpo` gives all twenty turns the same
    advantage; `mapo`'s local term tells the good turns from the bad one.
    """)
    return


@app.cell
def _(mo):
    train_button = mo.ui.run_button(label="train")
    train_button
    return (train_button,)


@app.cell
def _(Run, charts, mo, notebook, pl, recipe, train_button):
    history, held_out = [], []
    run = None
    if notebook.gate(train_button):
        import tempfile

        _n = recipe.train.iterations
        _per = recipe.train.tasks_per_iteration * recipe.rollout.k
        with notebook.spinner("Loading the policy and the reviewer"):
            run = Run(recipe, folder=tempfile.mkdtemp(prefix="nb05-"), progress=False)
        _every = max(1, _n // 4)  # a held-out point before training and about four during it
        with notebook.spinner("Held-out tasks before training (rule judge)"):
            held_out.append({"iteration": 0, **run.evaluate()})
        for _i in notebook.progress(
            range(_n),
            title=f"Training: {_n} iterations",
            subtitle=f"each: {_per} dialogues played, reviewed, then one update",
        ):
            history.append(run.step())
            if (_i + 1) % _every == 0 or _i + 1 == _n:
                held_out.append({"iteration": _i + 1, **run.evaluate()})
            notebook.show(
                mo.hstack(
                    [
                        charts.run_curves(
                            pl.DataFrame(history, infer_schema_length=None),
                            ["reward/global_mean", "reward/local_mean", "judge/compliance"],
                            f"training rewards (iteration {_i + 1} of {_n})",
                        ),
                        charts.run_curves(
                            pl.DataFrame(held_out, infer_schema_length=None),
                            ["eval/compliance", "eval/success"],
                            "held-out compliance and success (rule judge)",
                        ),
                    ],
                    wrap=True,
                )
            )
    metrics = pl.DataFrame(history, infer_schema_length=None) if history else pl.DataFrame()
    held = pl.DataFrame(held_out, infer_schema_length=None) if held_out else pl.DataFrame()
    return held, metrics, run


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · What moved

    Held-out compliance on single dishes and on meals; per-clause pass rates as the reviewer saw
    them (`clause/…`) and as the independent judge saw them (`judge/…`); local and global advantage spreads; KL to the reference and the policy's
    entropy (a plunge means mode collapse — the loop raises `alarm/entropy_collapse`).
    """)
    return


@app.cell
def _(charts, held, metrics, mo):
    if metrics.is_empty():
        _out = mo.md("*Press train to see the curves.*")
    else:
        _out = mo.vstack(
            [
                charts.run_curves(
                    held,
                    [
                        c
                        for c in ("eval/short_compliance", "eval/long_compliance")
                        if c in held.columns
                    ]
                    or ["eval/compliance"],
                    "held-out compliance per task kind (rule judge)",
                ),
                charts.clause_curves(metrics, "clause/"),
                charts.run_curves(
                    metrics,
                    ["adv/local_std", "adv/global_std", "adv/mixed_abs_mean", "alpha"],
                    "advantages",
                ),
                charts.run_curves(metrics, ["kl/mean", "policy/entropy"], "KL and entropy"),
            ]
        )
    _out
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Trajectory browser

    The last iteration's dialogues: each turn with its verdicts, its local reward and the
    advantage the update gave it. A turn without any applicable clause has no local signal
    (`-`): only the global advantage moves it.
    """)
    return


@app.cell
def _(mo, run):
    n_last = len(run.last["trajectories"]) if run is not None and run.last else 0
    pick = mo.ui.slider(0, max(n_last - 1, 0), value=0, label="dialogue", show_value=True)
    pick
    return (pick,)


@app.cell
def _(mo, pick, pl, render_transcript, run, turn_rewards):
    browser = pl.DataFrame()
    if run is None or not run.last:
        _out = mo.md("*No iteration yet.*")
    else:
        _t = run.last["trajectories"][pick.value]
        _r = run.last["reviews"][pick.value]
        _local, _valid, _ = turn_rewards(_r, run.last["pcs"][pick.value])
        browser = pl.DataFrame(
            [
                {
                    "turn": ti.turn,
                    "action": ti.action.text[:60],
                    "violations": ", ".join(
                        v.clause
                        for v in _r.verdicts
                        if v.turn == ti.turn and v.verdict == "violate"
                    ),
                    "local": round(_local[ti.turn], 3) if _valid[ti.turn] else None,
                    "advantage": (
                        None
                        if (_adv := run.last["advantages"].get((_t.id, ti.turn))) is None
                        else round(float(_adv), 3)
                    ),
                }
                for ti in _t.turns
            ]
        )
        _out = mo.vstack(
            [
                mo.md(f"outcome: **{_t.outcome.reason if _t.outcome else '-'}**"),
                mo.md(f"```text\n{render_transcript(_t)}\n```"),
                browser,
            ]
        )
    _out
    return (browser,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - The loop is the method's pseudo-code made concrete: personalise → roll out K → review →
      buffer → group-normalised local and global advantages → REINFORCE + KL.
    - The KL reference costs no memory: it is the same base with the adapter switched off.
    - Watch the GRM's view (`clause/…`) against the judge's (`judge/…`): a widening gap is reward
      hacking (`reward/gap_grm_minus_judge` tracks it every iteration).
    - Turns no clause speaks to carry no local signal; they learn from the outcome alone.
    - Next: `06_evaluate.py` — is the trained policy better, on diners it never saw?
    """)
    return


if __name__ == "__main__":
    app.run()
