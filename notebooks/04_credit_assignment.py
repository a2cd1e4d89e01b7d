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
    # 04 · Credit assignment: why outcome-only groups fail on long tasks

    GRPO gives every token of a rollout the same advantage: the rollout's outcome, z-scored among
    the K rollouts of the same task. On a one-shot answer that is fine. On a 20-turn dialogue it
    means that the one turn that lost the order and the nineteen turns that were fine get the
    same blame ([the method](../docs/method.md#credit-assignment)). Adding per-turn rewards from the reward model does not fix it by
    itself: a group-relative baseline for turn 7 needs other samples *from the state the agent was
    in at turn 7*, and sampling them per turn explodes with the horizon.

    MAPO ([docs/method.md](../docs/method.md#mapo)) keeps the critic-free recipe and adds a replay buffer:

    - **local advantage** — the turn's local reward, z-scored within its *state group* (samples
      from the same state, now and from the buffer's history);
    - **global advantage** — the outcome, z-scored within the task group, as in GRPO;
    - **A = α · A_local + (1 − α) · A_global**, α on a schedule (global first, local later);
    - **REINFORCE** on `−A · log π`, plus a KL penalty.

    This notebook measures what that buys, on a world small enough to train every method for
    many seeds in seconds.
    """)
    return


@app.cell
def _():
    import math

    import marimo as mo
    import polars as pl
    import torch

    from kitchen import charts, lab, mapo, notebook

    return charts, lab, mapo, math, mo, notebook, pl, torch


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · One set of functions, seven methods

    `kitchen.mapo` writes the math once — `group_normalize`, `step_returns`, `local_advantages`,
    `global_advantages`, `mix`, `mapo_loss` — and every method below is a configuration of it:
    which signal is normalised (the turn's reward, its discounted return, or the outcome), over
    which group (state, state inside the task group, turn index, task group, whole batch), how
    (z-score, mean only, leave-one-out), and how the two advantages are mixed.
    """)
    return


@app.cell
def _(mapo, pl):
    presets_table = pl.DataFrame(
        [
            {
                "preset": name,
                "local": f"{c.local_signal} in {c.local_groups} groups",
                "global": f"{c.global_signal} in {c.global_groups} groups",
                "mix": (
                    f"{c.mix}, α {c.alpha.kind} {c.alpha.alpha0:g}"
                    + (f"→{c.alpha.alpha1:g}" if c.alpha.kind != "constant" else "")
                ),
                "γ": c.gamma,
                "buffer": c.use_buffer,
                "loss": c.loss_agg,
                "source": c.source.split(":")[0],
            }
            for name, c in mapo.PRESETS.items()
        ]
    )
    presets_table
    return (presets_table,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · The edge cases, by hand

    Group normalisation is `(r − mean) / (std + ε)` per group (Bessel's std, ε = 10⁻⁶ as verl;
    TRL uses 10⁻⁴). Two cases need a rule: a group of **one** sample has no baseline, and a
    group whose rewards are **all equal** has no spread. Both give advantage 0 and are counted in
    the metrics (`group/local_singleton_frac`, `group/local_zero_var_frac`); a lone state can
    instead borrow its turn-level group or the batch (`singleton`). Non-finite rewards are
    rejected when they enter the buffer.
    """)
    return


@app.cell
def _(mapo, pl, torch):
    _rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.7, 0.7, 0.3])
    _groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])
    _adv, _stats = mapo.group_normalize(_rewards, _groups)
    edge_cases = pl.DataFrame(
        {
            "group": _groups.tolist(),
            "reward": _rewards.tolist(),
            "advantage": [round(a, 4) for a in _adv.tolist()],
            "group size": _stats.size.tolist(),
            "singleton": _stats.singleton.tolist(),
            "all equal": _stats.zero_var.tolist(),
        }
    )
    edge_cases
    return (edge_cases,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · The lab world

    An episode has **H turns**. At each turn the agent sees one of a few *situations* (the diner's
    mood, the wording of the request) and picks one of 4 actions from a softmax table. The
    **second turn decides the task**: one action there is right (think "check the allergens").
    Every other turn has one **trap** (think "recommend the dish the diner is allergic to") that
    also loses it. A random policy succeeds with probability ¼ · (¾)^(H−1): at H = 12 that is
    1 %, so almost every GRPO group is all failures, with zero spread and no signal.

    Each turn also gets a **local reward**, the judge's verdict on that turn: +1 for the good
    action, −1 for a trap, 0 otherwise, plus noise, plus a per-situation offset (some diners are
    judged harshly whatever the agent does). The offset is what state groups cancel and turn or
    batch groups cannot.

    Every preset runs through the same code a language-model run uses (`mapo.returns_for` →
    `steps.StepSamples` → `steps.advantages_for`, the replay buffer where the preset uses one →
    `mapo.mapo_loss`, Adam on the table). "Samples" are
    rollouts drawn from the world; the success rate is computed exactly from the policy.

    The controls below change the world and MAPO's own settings; the other presets keep their
    published ones.
    """)
    return


@app.cell
def _(mapo, mo, notebook):
    _m = mapo.PRESETS["mapo"]
    horizon = mo.ui.slider(
        2, 24, value=notebook.arg("horizon", 8), label="horizon H (turns)", show_value=True
    )
    k = mo.ui.slider(
        2, 32, value=notebook.arg("k", 8), label="K rollouts per task group", show_value=True
    )
    noise = mo.ui.slider(
        0.0,
        3.0,
        step=0.25,
        value=notebook.arg("noise", 0.5),
        label="judge noise (std)",
        show_value=True,
    )
    spread = mo.ui.slider(
        0.0, 3.0, step=0.25, value=1.0, label="per-situation judge offset (std)", show_value=True
    )
    gamma = mo.ui.slider(
        0.0, 1.0, step=0.05, value=_m.gamma, label="γ of MAPO's local return", show_value=True
    )
    schedule = mo.ui.dropdown(
        ["constant", "linear", "cosine"], value=_m.alpha.kind, label="α schedule"
    )
    alpha0 = mo.ui.slider(0.0, 1.0, step=0.05, value=_m.alpha.alpha0, label="α0", show_value=True)
    alpha1 = mo.ui.slider(0.0, 1.0, step=0.05, value=_m.alpha.alpha1, label="α1", show_value=True)
    alpha_steps = mo.ui.slider(
        10, 1000, step=10, value=_m.alpha.steps, label="α steps (updates)", show_value=True
    )
    capacity = mo.ui.slider(
        64, 8192, step=64, value=2048, label="buffer records per seed", show_value=True
    )
    max_age = mo.ui.slider(0, 32, value=4, label="buffer max age (updates)", show_value=True)
    replay = mo.ui.checkbox(False, label="replay history into the gradient (truncated IS)")
    seeds = mo.ui.slider(10, 50, value=notebook.arg("seeds", 10), label="seeds", show_value=True)
    horizons = mo.ui.text(value=notebook.arg("horizons", "4,8,12"), label="horizons to compare")
    budget = mo.ui.slider(
        100,
        3000,
        step=100,
        value=notebook.arg("updates", 400),
        label="update budget",
        show_value=True,
    )
    run = mo.ui.run_button(label="Train every preset")
    mo.vstack(
        [
            mo.md("**World**"),
            mo.hstack([horizon, k], justify="start", gap=2, wrap=True),
            mo.hstack([noise, spread], justify="start", gap=2, wrap=True),
            mo.md("**MAPO**"),
            mo.hstack([schedule, alpha0, alpha1, alpha_steps], justify="start", gap=2, wrap=True),
            mo.hstack([gamma, replay], justify="start", gap=2, wrap=True),
            mo.hstack([capacity, max_age], justify="start", gap=2, wrap=True),
            mo.md("**Comparison**"),
            mo.hstack([horizons, seeds, budget, run], justify="start", gap=2, wrap=True),
        ]
    )
    return (
        alpha0,
        alpha1,
        alpha_steps,
        budget,
        capacity,
        gamma,
        horizon,
        horizons,
        k,
        max_age,
        noise,
        replay,
        run,
        schedule,
        seeds,
        spread,
    )


@app.cell
def _(
    alpha0,
    alpha1,
    alpha_steps,
    budget,
    capacity,
    gamma,
    horizon,
    horizons,
    k,
    lab,
    mapo,
    max_age,
    noise,
    replay,
    schedule,
    seeds,
    spread,
):
    lab_config = lab.LabConfig(
        horizon=horizon.value,
        k=k.value,
        local_noise=noise.value,
        state_spread=spread.value,
        updates=budget.value,
        capacity=capacity.value,
        max_age=max_age.value,
    )
    presets = dict(mapo.PRESETS) | {
        "mapo": mapo.preset(
            "mapo",
            gamma=gamma.value,
            alpha={
                "kind": schedule.value,
                "alpha0": alpha0.value,
                "alpha1": alpha1.value,
                "steps": alpha_steps.value,
            },
            replay_in_gradient=replay.value,
        )
    }
    horizon_list = sorted({int(h) for h in horizons.value.replace(" ", "").split(",") if h})
    n_seeds = seeds.value
    return horizon_list, lab_config, n_seeds, presets


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · Who gets the credit

    Before any training, take one batch of rollouts of the random policy (40 task groups of K)
    and ask each preset for its advantages (MAPO's buffer holds four earlier batches). A method that assigns credit well
    gives **good actions** positive and **traps** negative advantages, turn by turn. Outcome-only
    methods can only say "this whole rollout failed": their histograms for good actions and traps
    overlap, and most samples sit at 0 (all-failure groups).
    """)
    return


@app.cell
def _(lab, lab_config, n_seeds, pl, presets):
    _rows = lab.credit_snapshot(lab_config, presets, seeds=max(40, n_seeds))  # 320+ rollouts
    snapshot = pl.DataFrame(_rows)
    credit = pl.DataFrame(lab.credit_by_turn(_rows))
    return credit, snapshot


@app.cell
def _(charts, snapshot):
    charts.advantage_histogram(snapshot)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    The share of credit each turn receives, measured as the correlation between a turn's
    advantage and the quality of the action taken at that turn (1: the advantage is all about
    this turn's choice; 0: it is noise as far as this turn is concerned). Outcome-only methods
    spread one number over H turns, so each turn's share shrinks as H grows; state groups keep
    every turn's share high.
    """)
    return


@app.cell
def _(charts, credit, lab_config):
    charts.credit_by_turn(credit, key_turn=lab_config.key_step)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 5 · Sample efficiency, every preset side by side

    Each preset trains on the same worlds (same seeds) at each horizon in the list, until every
    seed reaches the target success rate or the budget runs out. Below: mean success over seeds
    with a 95 % band, then the median number of rollouts each preset needed.
    """)
    return


@app.cell
def _(lab, mapo, notebook):
    # One run per (preset, horizon), cached on its settings: moving a MAPO knob retrains MAPO
    # alone, the other presets come from the cache (what `lab.compare` runs, one at a time).
    @notebook.cache
    def train_one(lab_json: str, horizon: int, preset_json: str, seeds: int):
        cfg = lab.LabConfig.model_validate_json(lab_json).model_copy(update={"horizon": horizon})
        return lab.train(cfg, mapo.AdvantageConfig.model_validate_json(preset_json), seeds)

    return (train_one,)


@app.cell
def _(horizon_list, lab_config, mo, n_seeds, notebook, presets, run, train_one):
    if notebook.gate(run):
        _todo = [(h, c) for h in horizon_list for c in presets.values()]
        runs = [
            train_one(lab_config.model_dump_json(), h, c.model_dump_json(), n_seeds)
            for h, c in notebook.progress(
                _todo,
                title=f"Training {len(presets)} presets at {len(horizon_list)} horizons",
                subtitle=f"{n_seeds} seeds each, up to {lab_config.updates} updates",
            )
        ]
        _msg = mo.md(f"Trained {len(runs)} runs × {n_seeds} seeds.")
    else:
        runs = []
        _msg = mo.callout(mo.md("Click **Train every preset** above to run the comparison."))
    _msg
    return (runs,)


@app.cell
def _(charts, lab, lab_config, pl, runs):
    curves = pl.DataFrame([row for r in runs for row in lab.curve_rows(r)])
    charts.sample_efficiency(curves, target=lab_config.target) if runs else None
    return (curves,)


@app.cell
def _(lab, mo, notebook, pl, runs):
    table = pl.DataFrame(lab.samples_table(runs)) if runs else pl.DataFrame()
    samples_wide = (
        notebook.rounded(
            table.pivot(on="horizon", index="preset", values="median_episodes").rename(
                lambda c: c if c == "preset" else f"H={c}"
            ),
            0,
        )
        if runs
        else table
    )
    (
        mo.vstack([mo.md("**Median rollouts to the target** (per seed; ∞: never)"), samples_wide])
        if runs
        else mo.md("*The table of rollouts to the target appears after training.*")
    )
    return samples_wide, table


@app.cell
def _(charts, runs, table):
    charts.samples_to_target(table) if runs else None
    return


@app.cell
def _(lab, lab_config, math, mo, n_seeds, runs, table):
    if runs:
        verdict = lab.halving_check(table.to_dicts())
        _h = verdict["largest_horizon"]
        _row = {r["preset"]: r for r in table.to_dicts() if r["horizon"] == _h}
        _ratios = ", ".join(
            f"H={r['horizon']}: {'≤ ' if r['bound'] else ''}×{r['vs_grpo']:.2f}"
            if math.isfinite(r["vs_grpo"])
            else f"H={r['horizon']}: n/a"
            for r in sorted(table.to_dicts(), key=lambda r: r["horizon"])
            if r["preset"] == "mapo"
        )
        _claim = (
            "**Yes.** MAPO needed at most half of GRPO's rollouts at the largest horizon"
            if verdict["halved"]
            else "**No.** MAPO did not need at most half of GRPO's rollouts at the largest "
            "horizon; §6 and §7 show which ingredient fell short (a noisy or offset-free judge, "
            "short horizons where GRPO's groups still see successes, a buffer that is too small)"
        )
        _out = mo.md(
            f"{_claim} (median over {n_seeds} seeds, target success "
            f"{lab_config.target:.0%}): at H={_h}, mapo {_row['mapo']['median_episodes']:.0f} "
            f"vs grpo {_row['grpo']['median_episodes']:.0f} episodes. "
            f"mapo/grpo by horizon: {_ratios}; the ratio "
            f"{'falls' if verdict['falling'] else 'does not fall steadily'} as H grows."
        )
    else:
        verdict = None
        _out = None
    _out
    return (verdict,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 6 · Why

    Three group statistics explain the curves (largest horizon of the comparison):

    - `group/global_zero_var_frac` — the share of task groups whose K outcomes were all equal.
      Early on nearly all of them fail together, so outcome-only methods get no gradient at all
      until a lucky success appears, and that luck gets rarer geometrically with H.
    - `group/local_singleton_frac` — the share of state groups with one member. GiGPO looks for
      equal states only inside one task group of K rollouts, so many states are alone and get 0;
      MAPO's groups pool every task group and the buffer's history.
    - `group/history_frac` — the share of MAPO's state-group members that come from the buffer.
    """)
    return


@app.cell
def _(charts, horizon_list, lab, pl, runs):
    _names = ["group/global_zero_var_frac", "group/local_singleton_frac", "group/history_frac"]
    _last = [r for r in runs if r.horizon == max(horizon_list)] if runs else []
    metrics = pl.DataFrame(lab.metric_rows(_last, _names))
    charts.metric_curves(metrics, _names) if runs else None
    return (metrics,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 7 · What each ingredient buys

    MAPO at the largest horizon with one ingredient changed at a time: no buffer history in the
    state groups; the local advantage alone (α = 1) and the global one alone (α = 0); the history
    replayed into the gradient with truncated importance weights. Raise the judge noise above and
    watch α = 1 fall behind: the global term is what keeps a noisy judge honest.
    """)
    return


@app.cell
def _(horizon_list, lab, lab_config, mapo, mo, n_seeds, notebook, pl, presets, run):
    if notebook.gate(run):
        _base = presets["mapo"].model_dump()
        _variants = {
            "mapo": _base,
            "no buffer history": _base | {"use_buffer": False, "replay_in_gradient": False},
            "α = 1 (local only)": _base | {"alpha": {"kind": "constant", "alpha0": 1.0}},
            "α = 0 (global only)": _base | {"alpha": {"kind": "constant", "alpha0": 0.0}},
            "replay into gradient": _base | {"replay_in_gradient": True},
        }
        _cfg = lab_config.model_copy(update={"horizon": max(horizon_list)})
        _rows = []
        for _name, _v in notebook.progress(
            _variants.items(),
            title=f"Ablation at H={_cfg.horizon}: {len(_variants)} variants of MAPO",
            subtitle=f"{n_seeds} seeds each",
        ):
            _r = lab.train(_cfg, mapo.AdvantageConfig.model_validate(_v | {"name": _name}), n_seeds)
            _rows.append(
                {
                    "variant": _name,
                    "horizon": _cfg.horizon,
                    "median_episodes": lab.median_samples(_r),
                }
            )
        ablation = notebook.rounded(_rows, 0)
    else:
        ablation = pl.DataFrame()
    (
        ablation
        if ablation.height
        else mo.md("*The ablation runs with the comparison: press **Train every preset** above.*")
    )
    return (ablation,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - Outcome-only group normalisation gives every turn the rollout's advantage. On long tasks
      whose success needs many turns right, most groups fail together (zero spread, zero
      gradient) and each turn's share of the credit shrinks with the horizon.
    - Per-turn rewards help only with a baseline per state. Turn-index groups (the MAPO paper)
      and batch normalisation (REINFORCE++) keep the per-state offset of the judge as noise;
      GiGPO's anchor states are exact but small groups, often of one.
    - MAPO's state groups pool equal states across task groups and the replay buffer's history:
      bigger groups, better baselines, no critic. The global term keeps the direction set by the
      outcome when the judge is noisy; α moves from global to local on a schedule.
    - Edge cases are rules, not accidents: one-sample and equal-reward groups give 0 and are
      counted; NaN rewards are refused at the door; stale samples leave after `max_age` updates.
    - Next: `05_…` puts `mapo.advantages` into the RL loop on the concierge world.
    """)
    return


if __name__ == "__main__":
    app.run()
