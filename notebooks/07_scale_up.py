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
    # 07 · Scaling up: the same reward and MAPO inside TRL and verl

    Everything so far ran in the kit's own loop (`kitchen cook`, notebook 05): one process, one
    GPU or a CPU. When a policy outgrows that, the kit does not grow a distributed runtime of
    its own ([docs/method.md](../docs/method.md#scaling)). The recipe — constitution, personalisation, the GRM's review, local
    and global rewards, the MAPO preset — moves to an engine that already shards models and
    batches, through that engine's public extension points:

    - **TRL** (`GRPOTrainer`, launched with `accelerate`: DDP, DeepSpeed ZeRO, FSDP) —
      `kitchen.integrations.trl`;
    - **verl** (Ray, vLLM rollouts) — `kitchen.integrations.verl`, an optional extra.

    This notebook shows what changes on the way, the launch files the kit generates, and a tiny
    TRL run whose advantages are the kit's own.
    """)
    return


@app.cell
def _():
    import tempfile

    import marimo as mo
    import polars as pl
    import torch

    from kitchen import charts, notebook
    from kitchen.integrations import episodes, launch
    from kitchen.integrations import trl as ktrl
    from kitchen.integrations import verl as kverl
    from kitchen.rollout import RolloutConfig, rollout
    from kitchen.train import Recipe, RewardConfig

    return (
        Recipe,
        RewardConfig,
        RolloutConfig,
        charts,
        episodes,
        ktrl,
        kverl,
        launch,
        mo,
        notebook,
        pl,
        rollout,
        tempfile,
        torch,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · What changes, and what does not

    | | kitchen's loop | TRL `GRPOTrainer` | verl (v1 trainer) |
    |---|---|---|---|
    | a training row | one **turn** (prompt so far + action) | one **episode** | one **episode** |
    | multi-turn rollouts | `kitchen.rollout` | the same, through `rollout_func` | `kitchen_concierge` agent loop on verl's LLM server |
    | the review | GRM / rule judge | a reward function (`GRMReward`) | a reward manager (`kitchen_grm`) |
    | per-turn rewards | step rows | kept by the reward function | laid out at turn boundaries of the token-level rewards |
    | the advantage | `mapo.advantages` | the same, in a `GRPOTrainer` subclass, per token | a registered estimator (`mapo`) |
    | state keys, buffer | in the step rows | gathered over processes, one buffer per process | handed over by a trainer subclass (`kitchen_sync`) |
    | KL reference | adapter off | adapter off (TRL's PEFT path) | verl's reference worker |
    | scale | 1 GPU | `accelerate launch`: many GPUs, many nodes | Ray: many GPUs, many nodes |

    What does **not** change: the constitution, the personal constitutions, the review and
    the numbers it turns into, the advantage preset. The advantages are the same numbers —
    the tests check it, here and in section 4.

    What does change is the row: TRL and verl train on one row per episode, every turn's action
    tokens in it with the environment's replies in between, masked out. The loss aggregation
    of the default preset (`token-mean`) is the same either way; the sequence-level ones then
    weigh episodes instead of turns:
    """)
    return


@app.cell
def _(ktrl, pl):
    loss_table = pl.DataFrame(
        [
            {"kitchen loss_agg": agg, "TRL loss_type": lt, "same loss": agg == "token-mean"}
            for agg, lt in ktrl.LOSS_TYPES.items()
        ]
    )
    loss_table
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · One episode, one row

    The shipped tiny policy plays one task group (K = 2 here). `episodes.episode_tokens` turns
    each episode into the row TRL trains on: the first prompt, then each action as the policy
    sampled it (mask 1) and the template text up to the next action — tool result or diner
    reply, next assistant header — (mask 0). The log-probs of the row are those of the rollout.
    """)
    return


@app.cell
def _(ktrl, torch):
    torch.manual_seed(0)
    policy, tok = ktrl.demo_policy()
    return policy, tok


@app.cell
def _(RolloutConfig, episodes, policy, rollout, tok):
    jobs = episodes.job_pool("constitutions/concierge.yaml", 4, seed=1)[:1]
    sample_trajs, _ = rollout(
        policy, tok, jobs, RolloutConfig(k=2, max_turns=4, max_new_tokens=40), seed=3
    )
    return jobs, sample_trajs


@app.cell
def _(episodes, pl, sample_trajs, tok):
    episode_row = episodes.episode_tokens(tok, sample_trajs[0], tail=True)
    _cuts = sorted(
        {0, len(episode_row.completion_ids)}
        | {x for s, e in episode_row.spans.values() for x in (s, e)}
    )
    row_frame = pl.DataFrame(
        [
            {
                "tokens": f"{a}–{b}",
                "policy": bool(episode_row.mask[a]),
                "text": tok.decode(episode_row.completion_ids[a:b]).replace("\n", "⏎")[:90],
            }
            for a, b in zip(_cuts, _cuts[1:], strict=False)
        ]
    )
    row_frame
    return episode_row, row_frame


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · verl sees rewards per token

    verl's advantage estimators receive only token-level rewards, the response mask and the
    task group id. The kit therefore lays the review out in the rewards (the *turn-reward
    layout*): each turn's local reward on its last token, the episode's outcome on the last
    response token — the world's last reply, which is why the verl row keeps that tail.
    `read_layout` recovers the rewards from the tensor alone. State keys do not fit in a tensor
    of rewards: verl gets them from the `kitchen_sync` trainer subclass, and without it falls
    back to turn groups (see `kitchen/integrations/verl.py` for every limit).
    """)
    return


@app.cell
def _(RewardConfig, episode_row, jobs, kverl, notebook, sample_trajs, torch):
    _score, _info = kverl.review_episode(
        sample_trajs[0], jobs[0][1], None, RewardConfig(reviewer="judge", global_blend=0.5)
    )
    _mask = torch.tensor([episode_row.mask])
    layout_rewards = kverl.layout(
        [_score.turns], [float(_score)], _mask, [len(episode_row.mask) - 1]
    )
    _spans, _local, _outcome = kverl.read_layout(layout_rewards, _mask)
    layout_frame = notebook.rounded(
        [
            {"slot": f"turn {t}", "token": e - 1, "reward": float(r)}
            for t, ((_, e), r) in enumerate(zip(_spans[0], _local[0], strict=True))
        ]
        + [{"slot": "outcome", "token": len(episode_row.mask) - 1, "reward": float(_outcome[0])}]
    )
    layout_frame
    return (layout_frame,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · The launch files

    `kitchen.integrations.launch` generates every launch file from a few parameters; the copies
    in `recipes/scale/` are its output. Pick one; the commands that use them follow.
    """)
    return


@app.cell
def _(launch, mo):
    launch_files = launch.files()
    mo.ui.tabs(
        {
            name: mo.md(f"```{'bash' if name.endswith('.sh') else 'yaml'}\n{text}\n```")
            for name, text in launch_files.items()
        }
    )
    return (launch_files,)


@app.cell
def _(launch, mo, pl):
    launch_commands = pl.DataFrame(
        [{"setup": k, "command": v} for k, v in launch.commands().items()]
    )
    # long commands wrap inside their column instead of running off the table's edge
    mo.ui.table(launch_commands, wrapped_columns=["command"], selection=None, page_size=20)
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 5 · A tiny TRL run

    `MAPOTrainer` is TRL's `GRPOTrainer` with the kit's rollout hook, reward function and
    advantage. It trains the tiny policy with a fresh LoRA adapter for a couple of steps on the
    CPU, the rule judge reviewing. `accelerate launch` runs the same code on many GPUs.
    """)
    return


@app.cell
def _(mo, notebook):
    steps = mo.ui.slider(1, 5, value=notebook.arg("steps", 2), label="TRL steps", show_value=True)
    train_button = mo.ui.run_button(label="Train with TRL")
    mo.hstack([steps, train_button], justify="start", gap=2, wrap=True)
    return steps, train_button


@app.cell
def _(mo, steps):
    mo.md(
        f"{steps.value} TRL step{'s' if steps.value != 1 else ''}, each on 2 tasks × K 4 = 8 "
        "episodes of at most 4 turns, reviewed by the rule judge."
    )
    return


@app.cell
def _(Recipe, charts, ktrl, mo, notebook, pl, steps, tempfile, torch, train_button):
    if notebook.gate(train_button):
        _recipe = Recipe.model_validate(
            {
                "name": "nb07",
                "seed": 3,
                "policy": {
                    "path": "data/models/policy-tiny",
                    "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                },
                "reward": {"reviewer": "judge", "global_blend": 0.5},
                "rollout": {"k": 4, "max_turns": 4, "max_new_tokens": 40},
                "advantage": {
                    "preset": "mapo",
                    "overrides": {"beta": 0.02, "state_key": "abstract"},
                },
                "train": {
                    "iterations": steps.value,
                    "tasks_per_iteration": 2,
                    "task_pool": 8,
                    "lr": 1e-2,
                },
                "eval_every": 0,
            }
        )
        torch.manual_seed(0)
        _model, _tok = ktrl.demo_policy()  # a fresh copy: TRL adds the adapter to it
        _rows = []

        def _curves(title):
            return charts.run_curves(
                pl.DataFrame(_rows, infer_schema_length=None),
                ["loss", "reward", "adv/mixed_abs_mean"],
                title,
                x="step",
            )

        def _draw(row):
            # the live chart: TRL's logged loss and reward, redrawn below the progress bar
            if "loss" in row:
                _rows.append({k: float(v) for k, v in row.items() if isinstance(v, int | float)})
                notebook.show(_curves(f"TRL run so far (step {row['step']} of {steps.value})"))

        with notebook.trainer_progress(f"TRL: {steps.value} GRPOTrainer steps"):
            trainer = ktrl.build_trainer(
                ktrl.TRLRecipe(kitchen=_recipe, trl={"output_dir": tempfile.mkdtemp()}),
                model=_model,
                tokenizer=_tok,
            )
            trainer.add_callback(notebook.log_callback(_draw))
            _before = {
                k: v.detach().clone()
                for k, v in trainer.model.named_parameters()
                if v.requires_grad
            }
            trainer.train()
        moved = sum(
            (v.detach() - _before[k]).abs().sum().item()
            for k, v in trainer.model.named_parameters()
            if k in _before
        )
        _msg = mo.vstack(
            [
                mo.md(
                    f"{trainer.state.global_step} TRL steps; the adapter moved by {moved:.3g} "
                    "(sum of absolute changes)."
                ),
                _curves("the TRL run"),
            ]
        )
    else:
        trainer, moved = None, 0.0
        _msg = mo.callout(mo.md("Click **Train with TRL** to run it."))
    _msg
    return moved, trainer


@app.cell
def _(mo, notebook, pl, trainer):
    _keep = [
        "step",
        "loss",
        "reward",
        "rewards/grm/mean",
        "adv/mixed_abs_mean",
        "adv/local_abs_mean",
        "adv/global_abs_mean",
        "group/local_size_mean",
        "kl",
        "rollout/tokens_per_s",
        "step_time",
    ]
    trl_log = (
        notebook.rounded(
            [
                {k: float(r[k]) for k in _keep if k in r}
                for r in trainer.state.log_history
                if "loss" in r
            ]
        )
        if trainer
        else pl.DataFrame()
    )
    trl_log if trainer else mo.md("*Train with TRL above: its log appears here.*")
    return (trl_log,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    Every turn's tokens carry the kit's MAPO advantage for that turn; TRL's own GRPO would give
    every turn of an episode the same number (the episode's outcome, z-scored in its group).
    The turns of one episode differ because the review judged them differently:
    """)
    return


@app.cell
def _(pl, trainer):
    if trainer:
        _h = trainer.history[-1]
        _row = {_t.id: _i for _i, _t in enumerate(_h["trajectories"])}
        _samples = _h["samples"]  # the step samples of this batch: one per trained turn
        advantage_frame = pl.DataFrame(
            [
                {
                    "episode": f"ep{_row[key]}",
                    "turn": turn,
                    "mapo": float(a),
                    "grpo": float(_h["trl_advantages"][_row[key]]),
                }
                for key, turn, a in zip(
                    _samples.traj, _samples.turn.tolist(), _h["advantages"].tolist(), strict=True
                )
            ]
        )
    else:
        advantage_frame = pl.DataFrame()
    return (advantage_frame,)


@app.cell
def _(advantage_frame, charts):
    charts.turn_advantages(advantage_frame) if advantage_frame.height else None
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - The kit hands TRL and verl its recipe, not its runtime: the review, the rewards and the
      MAPO advantage are the same functions, called through each engine's public hooks
      (`rollout_func`, reward functions and a `GRPOTrainer` subclass; verl's estimator, reward
      manager, agent loop and trainer registries).
    - Rows become episodes instead of turns. The advantages stay equal (tested, including TRL's
      own GRPO as the α = 0 case); the loss is equal for `token-mean`, the default.
    - verl's estimator sees only token rewards: per-turn rewards live at turn boundaries, and
      state keys need the small `kitchen_sync` trainer; without it MAPO falls back to turn
      groups, and with verl's stock trainers only the outcome reaches the estimator.
    - Launch files are generated (`kitchen.integrations.launch`) and shipped in
      `recipes/scale/`: DDP, ZeRO-2/3, FSDP2, one or two nodes, and a verl run.
    - `benchmarks/bench_trl.py` times both loops on the same work, and says where the time goes.
    """)
    return


if __name__ == "__main__":
    app.run()
