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
    # 00 · Should your agent do RL?

    Decide first, then build: RL for RL's sake costs a team months (the method's own project took
    about ten people three months). The method opens with three questions
    (`docs/method.md#should-you-rl`), and this notebook answers each from evidence a team can bring:

    1. **Has SFT plateaued?** If more data, better prompts or few-shot examples still help, use
       them: they are cheaper. RL pays when SFT's gains flatten and what is left is preference
       trade-offs and long-horizon decisions.
    2. **Is a reward obtainable?** Maths and code have verifiable rewards. Dialogue looks as if it
       has none — but a generative reward model that checks a constitution clause by clause turns
       it into a review score. "Dialogue has no right answer" is not a reason to rule RL out.
    3. **Does the gain cover the cost?** Tokens generated, reviews written, device-hours and
       memory — computed from throughput the kit *measured*, never from invented speeds.

    The evidence here is the kit's own: its cold-start SFT run, its tiny policy and the scripted
    agent that taught it, its constitution and GRM, and the speeds recorded in
    `data/throughput/`. Bring yours by changing the paths and numbers. The logic lives in
    `kitchen/decide.py`; this notebook only shows it.
    """)
    return


@app.cell
def _():
    import marimo as mo
    import polars as pl

    from kitchen import charts, decide, notebook, paths
    from kitchen.config import KitchenError
    from kitchen.constitution import load_constitution
    from kitchen.train import load_recipe

    return (
        KitchenError,
        charts,
        decide,
        load_constitution,
        load_recipe,
        mo,
        notebook,
        paths,
        pl,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · Has SFT plateaued? The learning curve

    The shipped cold-start run (`kitchen sft recipes/sft_tiny.yaml`, 1,000 optimiser steps; its
    trainer log ships as `data/models/policy-tiny/sft_log.jsonl`) logged its held-out loss every
    250 steps. Point the path at your own run's `log.jsonl` to test yours.

    **The plateau test** (`decide.plateau`): fit a power law `loss ≈ c · step^(−b)` to the last
    part of the curve (the *tail*) and ask what doubling the training would buy: `1 − 2^(−b)`.
    Below the threshold, the curve has plateaued. One caution: a learning rate that decays to zero
    flattens the end of any curve, so the test leans towards "plateaued" — a longer second run is
    the stronger evidence.
    """)
    return


@app.cell
def _(mo, notebook, paths):
    log_path = mo.ui.text(
        value=notebook.arg("sft_log", str(paths.DATA / "models" / "policy-tiny" / "sft_log.jsonl")),
        label="SFT log (JSONL)",
        full_width=True,
    )
    tail = mo.ui.slider(
        0.1, 0.8, step=0.05, value=0.3, label="tail (fraction of the steps)", show_value=True
    )
    min_gain = mo.ui.slider(
        0.01,
        0.2,
        step=0.01,
        value=0.05,
        label="plateau threshold (gain from doubling)",
        show_value=True,
    )
    mo.vstack([log_path, mo.hstack([tail, min_gain], justify="start", gap=2, wrap=True)])
    return log_path, min_gain, tail


@app.cell
def _(charts, decide, log_path, pl):
    sft_log = pl.DataFrame(decide.load_sft_log(log_path.value), infer_schema_length=None).select(
        pl.col("step"), pl.col("^(loss|eval_loss)$")
    )
    charts.loss_curve(sft_log)
    return (sft_log,)


@app.cell
def _(charts, decide, min_gain, mo, pl, sft_log, tail):
    _points = sft_log.select("step", "eval_loss").drop_nulls()
    curve = decide.plateau(
        _points["step"].to_list(),
        _points["eval_loss"].to_list(),
        tail=tail.value,
        min_gain=min_gain.value,
    )
    mo.vstack(
        [
            charts.plateau_fit(sft_log, curve),
            mo.md(
                f"Power law over steps {curve.steps[0]:.0f}–{curve.steps[-1]:.0f}: "
                f"b = {curve.exponent:.3f}. The tail improved the held-out loss by "
                f"**{curve.observed_gain:.1%}**; doubling the training is projected to improve "
                f"it by **{curve.projected_gain:.1%}** (threshold {curve.min_gain:.0%}) → "
                + ("**plateaued**." if curve.plateaued else "**still falling**.")
            ),
        ]
    )
    return (curve,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ### Is what is left out of SFT's reach?

    A falling loss says the policy imitates its data better; it does not say the data is worth
    imitating. SFT cannot beat its teacher: what the SFT data itself gets wrong, more of the same
    SFT will not fix. Here the teacher is the scripted agent that wrote the SFT dialogues — on
    purpose competent but not personal (its quirks ignore the diner's profile).

    Below, the SFT policy and its teacher play held-out tasks and profiles, and the rule judge
    scores both. For each clause (and task success) the policy's remaining failures split into
    **imitable** (the teacher does better: a better SFT run could close it) and **beyond the SFT
    data** (the teacher fails too: only a new signal — better data or a reward — can). The method
    says RL pays when what is left is mostly the second kind.
    """)
    return


@app.cell
def _(mo, notebook):
    eval_tasks = mo.ui.slider(
        4,
        100,
        step=2,
        value=notebook.arg("tasks", 8 if notebook.small() else 40),
        label="held-out tasks",
        show_value=True,
    )
    eval_button = mo.ui.run_button(label="Play the SFT policy and its teacher")
    mo.hstack([eval_tasks, eval_button], justify="start", gap=2, wrap=True)
    return eval_button, eval_tasks


@app.cell
def _(decide, eval_button, eval_tasks, notebook):
    if notebook.gate(eval_button):
        with notebook.spinner(
            f"Playing {eval_tasks.value} held-out dialogues with the SFT policy",
            "then replaying its teacher's on the same split; the rule judge scores both",
        ):
            policy_report, teacher_report = decide.sft_ceiling(tasks=eval_tasks.value)
        gap = decide.imitation_gap(decide.rates(policy_report), decide.rates(teacher_report))
        share = decide.beyond_share(gap)
    else:
        policy_report = teacher_report = gap = share = None
    return gap, policy_report, share, teacher_report


@app.cell
def _(charts, gap, mo, notebook, policy_report, share, teacher_report):
    if gap is None:
        _view = mo.callout(mo.md("Click the button above to play the held-out dialogues."))
    else:
        _personal = notebook.rounded(
            [
                {
                    "behaviour": k,
                    "policy": policy_report.personalisation.get(k),
                    "teacher": v,
                }
                for k, v in teacher_report.personalisation.items()
            ]
        )
        _view = mo.vstack(
            [
                charts.imitation_bars(gap),
                mo.md(
                    f"{policy_report.episodes} policy and {teacher_report.episodes} teacher "
                    f"dialogues. **{share:.0%}** of the policy's remaining failures are failures "
                    "of its SFT data too."
                ),
                notebook.rounded(gap),
                mo.md(
                    "Personalisation (words per message by the diner's verbosity, small talk "
                    "first by pace, asking for the cuisine when the request names none): a "
                    "personal agent's numbers differ across profiles; an imitator of this "
                    "teacher's cannot."
                ),
                _personal,
            ]
        )
    _view
    return


@app.cell
def _(mo):
    cheaper = mo.ui.checkbox(
        False, label="more data, better prompts or few-shot examples still help"
    )
    cheaper
    return (cheaper,)


@app.cell
def _(cheaper, curve, decide, mo, share):
    sft_answer = decide.answer_sft(curve, share, cheaper_fixes_help=cheaper.value)
    mo.md(sft_answer.markdown(1))
    return (sft_answer,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · Is a reward obtainable?

    If a program can check the whole task, the reward is verifiable and RL's classic recipe
    applies. The concierge world is half-way: whether an order went through is checkable, but
    whether the agent respected *this* diner's preferences is a judgement. That part needs a
    constitution (notebook 01) and a GRM that reviews it clause by clause (notebook 03). The GRM's
    reward is only as good as its agreement with reference verdicts: here Cohen's κ from its
    calibration report (`kitchen grm calibrate --out FILE`), against human labels when there are
    any, else against the rule judge. The threshold, 0.6, is about where Landis & Koch's (1977)
    "substantial agreement" (0.61–0.80) starts; κ = 1 is perfect agreement, 0 is chance.
    """)
    return


@app.cell
def _(mo, notebook, paths):
    verifiable = mo.ui.checkbox(False, label="a program can check the whole task")
    calibration_path = mo.ui.text(
        value=notebook.arg(
            "calibration", str(paths.DATA / "models" / "grm-tiny" / "calibration.json")
        ),
        label="GRM calibration report",
        full_width=True,
    )
    mo.vstack([verifiable, calibration_path])
    return calibration_path, verifiable


@app.cell
def _(
    KitchenError,
    calibration_path,
    decide,
    load_constitution,
    mo,
    paths,
    verifiable,
):
    try:
        load_constitution(paths.DEFAULT_CONSTITUTION)
        _valid = True
    except KitchenError:
        _valid = False
    kappa, kappa_source = decide.grm_kappa(calibration_path.value)
    reward_answer = decide.answer_reward(
        verifiable=verifiable.value, constitution_valid=_valid, grm_kappa=kappa
    )
    mo.md(reward_answer.markdown(2) + f"\n- calibration: {kappa_source}")
    return kappa, reward_answer


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · Does the gain cover the cost? Measured throughput

    A run's cost is counted in tokens: the policy generates its turns (rollouts), the GRM writes a
    review of every dialogue, and the update reads every dialogue back (forward, backward, and the
    KL reference's forward). How fast a device does each is *measured*, never assumed: each file
    in `data/throughput/` records one device's speeds, the command that measured them and the
    date. Add one for your device:

    - GPU: `python benchmarks/bench_gpu.py --out data/throughput/<gpu>.json` (a
      Qwen2.5-0.5B-shaped QLoRA run);
    - CPU, or any recipe: `python -m kitchen.decide measure RECIPE --out data/throughput/<name>.json`
      (a few iterations of the real loop).
    """)
    return


@app.cell
def _(decide, notebook, pl):
    throughput = decide.load_throughput()
    pl.DataFrame(
        [
            {
                "file": r.path.rsplit("/", 1)[-1],
                "device": r.device,
                "model": r.model,
                "parameters": r.parameters,
                "rollout tok/s": round(r.rollout_tokens_per_s, 1),
                "update tok/s": round(r.update_tokens_per_s, 1),
                "review tok/s": r.review_tokens_per_s,
                "reviewer": r.reviewer,
                "measured": r.date,
                "command": r.command,
                "hardware": r.hardware,
            }
            for r in throughput
        ],
        schema_overrides={"review tok/s": pl.Float64},
    ).pipe(notebook.rounded, 1)
    return (throughput,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ### The calculator

    Start from one of the kit's recipes, then change what you like. The tiny CPU recipe takes its
    dialogue shape (turns, tokens per turn) from the CPU measurement; the GPU recipe uses its
    budgets (`max_turns`, `max_new_tokens`), so its counts are an upper bound. When a speed was
    measured on another model size it is scaled as compute-bound work, tokens/s ∝ 1/parameters —
    the calculator says so below, and says plainly when the chosen device was never measured.
    Memory is a formula (every term is listed with it), not a measurement.
    """)
    return


@app.cell
def _(mo, notebook):
    start_from = mo.ui.dropdown(
        {
            "tiny CPU run (recipes/tiny_mapo.yaml)": "recipes/tiny_mapo.yaml",
            "one GPU, Qwen2.5-1.5B QLoRA (recipes/gpu_qwen_qlora.yaml)": (
                "recipes/gpu_qwen_qlora.yaml"
            ),
        },
        value=notebook.arg(
            "start_from", "one GPU, Qwen2.5-1.5B QLoRA (recipes/gpu_qwen_qlora.yaml)"
        ),
        label="start from",
    )
    start_from
    return (start_from,)


@app.cell
def _(decide, load_recipe, paths, start_from, throughput):
    _cpu = decide.for_device(throughput, "cpu")
    _workload = _cpu.workload if _cpu else {}
    _tiny = "tiny" in start_from.value
    base_inputs = decide.CostInputs.from_recipe(
        load_recipe(paths.HOME / start_from.value),
        _workload if _tiny else {k: v for k, v in _workload.items() if k.startswith("other")},
        device="cpu" if _tiny else "H100 80GB",
    )
    return (base_inputs,)


@app.cell
def _(base_inputs, decide, mo, notebook):
    _archs = list(decide.architectures())
    _b = base_inputs
    policy_arch = mo.ui.dropdown(_archs, value=_b.policy, label="policy")
    method = mo.ui.dropdown(["lora", "qlora"], value=_b.method, label="fine-tuning")
    grm_arch = mo.ui.dropdown(
        ["adapter on the policy's base", *_archs],
        value="adapter on the policy's base" if _b.grm_shares_base else (_b.grm or _b.policy),
        label="GRM",
    )
    k_samples = mo.ui.slider(2, 32, value=_b.k, label="K samples per task", show_value=True)
    tasks_per_it = mo.ui.slider(
        1, 128, value=_b.tasks_per_iteration, label="tasks per iteration", show_value=True
    )
    iterations = mo.ui.number(1, 100_000, value=_b.iterations, label="iterations")
    turns = mo.ui.number(1, 100, step=0.1, value=round(_b.turns, 1), label="turns per dialogue")
    tokens_turn = mo.ui.number(
        1, 8192, step=1, value=round(_b.tokens_per_turn), label="tokens per turn (policy)"
    )
    other_turn = mo.ui.number(
        0, 8192, step=1, value=round(_b.other_tokens_per_turn), label="other tokens per turn"
    )
    review_tokens = mo.ui.number(1, 8192, value=_b.review_tokens, label="tokens per review")
    votes = mo.ui.slider(
        0, 9, value=_b.votes, label="GRM reviews per dialogue (0: rule judge)", show_value=True
    )
    device = mo.ui.dropdown(
        ["cpu", *decide.GPUS],
        value=notebook.arg("device", _b.device),
        label="device",
    )
    budget = mo.ui.number(0, 1e7, value=notebook.arg("budget", 24.0), label="budget (device-hours)")
    mo.vstack(
        [
            mo.hstack([policy_arch, method, grm_arch, device], justify="start", gap=2, wrap=True),
            mo.hstack([k_samples, tasks_per_it, iterations], justify="start", gap=2, wrap=True),
            mo.hstack([turns, tokens_turn, other_turn], justify="start", gap=2, wrap=True),
            mo.hstack([review_tokens, votes, budget], justify="start", gap=2, wrap=True),
        ]
    )
    return (
        budget,
        device,
        grm_arch,
        iterations,
        k_samples,
        method,
        other_turn,
        policy_arch,
        review_tokens,
        tasks_per_it,
        tokens_turn,
        turns,
        votes,
    )


@app.cell
def _(
    base_inputs,
    decide,
    device,
    grm_arch,
    iterations,
    k_samples,
    method,
    other_turn,
    policy_arch,
    review_tokens,
    tasks_per_it,
    throughput,
    tokens_turn,
    turns,
    votes,
):
    _shares = grm_arch.value.startswith("adapter")
    cost_inputs = decide.CostInputs.model_validate(
        base_inputs.model_dump()
        | {
            "policy": policy_arch.value,
            "method": method.value,
            "grm": None if _shares else grm_arch.value,
            "grm_shares_base": _shares,
            "k": k_samples.value,
            "tasks_per_iteration": tasks_per_it.value,
            "iterations": int(iterations.value),
            "turns": turns.value,
            "tokens_per_turn": tokens_turn.value,
            "other_tokens_per_turn": other_turn.value,
            "review_tokens": review_tokens.value,
            "votes": votes.value,
            "device": device.value,
        }
    )
    cost = decide.estimate_cost(cost_inputs, throughput)
    return cost, cost_inputs


@app.cell
def _(charts, cost, cost_inputs, mo, pl):
    _counts = (
        f"**{cost.iterations} iterations** of {cost_inputs.tasks_per_iteration} tasks × "
        f"K {cost_inputs.k}: {cost.episodes:,.0f} dialogues, "
        f"**{cost.generated_tokens:,.0f} generated tokens**, **{cost.reviews:,.0f} reviews** "
        f"({cost.review_tokens:,.0f} review tokens), **{cost.update_tokens:,.0f} tokens** "
        "through the update."
    )
    if cost.hours is None:
        _time = mo.callout(mo.md(f"**Time: unknown.** {cost.missing}."), kind="warn")
    else:
        _time = mo.vstack(
            [
                mo.md(
                    f"**Time: {cost.hours:,.2f} device-hours** on {cost_inputs.device}.\n\n"
                    f"Source: {cost.source}.\n\n"
                    + "\n".join(f"- assumption: {a}" for a in cost.assumptions)
                ),
                charts.cost_bars(cost.seconds),
            ]
        )
    _mem = cost.memory
    _fit = (
        ""
        if _mem.device_gb is None
        else f" of {_mem.device_gb:.0f} GB — " + ("fits." if _mem.fits else "**does not fit**.")
    )
    mo.vstack(
        [
            mo.md(_counts),
            _time,
            mo.md(
                f"**Memory (a formula, not a measurement): {_mem.total_gb:.2f} GB**{_fit} "
                "Weights and adapters are always there; the update, the rollout's KV cache and "
                "the review's KV cache take turns, so the largest of the three counts. Not "
                "counted: the CUDA context, allocator fragmentation — keep headroom."
            ),
            charts.memory_bars(_mem),
            pl.DataFrame(
                [
                    {"term": k, "GB": round(v, 3), "formula": _mem.formulas[k]}
                    for k, v in _mem.parts.items()
                ]
            ),
        ]
    )
    return


@app.cell
def _(budget, cost, decide, mo):
    cost_answer = decide.answer_cost(cost, float(budget.value) if budget.value else None)
    mo.md(cost_answer.markdown(3))
    return (cost_answer,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · The recommendation

    `decide.recommend` applies the method's rule: RL when all three answers are yes. No reward
    means nothing to optimise; a "no" on SFT means cheaper fixes first; a "no" on cost means
    shrink the run or raise the budget; an unknown names what to measure next.
    """)
    return


@app.cell
def _(cost_answer, decide, mo, reward_answer, sft_answer):
    recommendation = decide.recommend(sft_answer, reward_answer, cost_answer)
    mo.callout(
        mo.md(recommendation.text()),
        kind={"do RL": "success", "not yet": "warn", "don't": "danger"}[recommendation.verdict],
    )
    return (recommendation,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ### Reading it for the kit's own policy

    Run on the kit's own evidence, the answer to question 1 is honest rather than convenient: the
    tiny policy's held-out loss is still falling at the end of its 20-minute SFT run, and a good
    part of what it gets wrong its teacher gets right — a bigger model or a longer SFT run would
    still pay. What no SFT on this data can fix is the personal part (asking when the request is
    ambiguous, writing more for detailed diners, words that follow the diner's verbosity): the
    teacher fails there too. The kit trains RL on this policy anyway, because it is a teaching
    model: small enough for a laptop, and wrong in exactly the ways RL with a constitution can
    put right. For a product, take the verdict at its word.
    """)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - Decide before building. Three questions, each with evidence: the SFT curve and what is left
      beyond the SFT data; a reward that is verifiable or comes from a calibrated GRM; a cost
      estimate that fits the device and the budget.
    - A plateau test on the loss is not enough on its own: SFT cannot beat its teacher, so ask
      how much of what is left the SFT data also gets wrong.
    - "No standard answer" does not rule RL out: a constitution plus a GRM whose agreement you
      measured gives a reward. An uncalibrated GRM is an unknown, not a yes.
    - Costs come from measured throughput (`data/throughput/`), scaled by model size with the
      assumption stated; when a device was never measured, the calculator says so and tells you
      the command to run. Memory is a stated formula.
    - Next: `01_constitution.py` — write the constitution the reward will come from.
    """)
    return


if __name__ == "__main__":
    app.run()
