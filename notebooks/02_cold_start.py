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
    # 02 · The cold start: the concierge world and a policy that speaks it

    RL needs a policy that can already act: use the tools, hold a multi-turn conversation, stop
    when the order is placed. This notebook shows the world the policy acts in, lets you play it,
    and trains a policy by supervised fine-tuning (SFT) on synthetic dialogues — the *cold start*
    (`docs/method.md#cold-start`).

    The dialogues come from scripted agents that are competent but, on purpose, **not personal**:
    they skip the allergen check now and then, write too much for a brief diner, chat before
    recommending to a hurried one. The SFT policy imitates them, so it inherits the same
    indifference to the diner's profile. Closing that gap is RL's job (notebooks 04 onwards).
    """)
    return


@app.cell
def _():
    import re
    import tempfile
    from pathlib import Path

    import marimo as mo
    import polars as pl

    from kitchen import charts, notebook, paths
    from kitchen.constitution import load_constitution
    from kitchen.evaluate import make_job, profile_swap
    from kitchen.files import read_jsonl
    from kitchen.judge import judge
    from kitchen.models import ModelSpec, TinyModelConfig, build_tiny_model, load_model, reply
    from kitchen.profile import load_profiles
    from kitchen.rollout import RolloutConfig, rollout
    from kitchen.sft import (
        ModelSource,
        SFTData,
        SFTRecipe,
        TokenizerSettings,
        read_dialogues,
        run_sft,
    )
    from kitchen.world import (
        World,
        generate_tasks,
        load_menu,
        load_split,
        parse_action,
        render_transcript,
        word_count,
    )

    return (
        ModelSource,
        ModelSpec,
        Path,
        RolloutConfig,
        SFTData,
        SFTRecipe,
        TinyModelConfig,
        TokenizerSettings,
        World,
        build_tiny_model,
        charts,
        generate_tasks,
        judge,
        load_constitution,
        load_menu,
        load_model,
        load_profiles,
        load_split,
        make_job,
        mo,
        notebook,
        parse_action,
        paths,
        pl,
        profile_swap,
        re,
        read_dialogues,
        read_jsonl,
        render_transcript,
        reply,
        rollout,
        run_sft,
        tempfile,
        word_count,
    )


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 1 · The world

    A diner asks a food-ordering assistant for a dish. The assistant acts in text, one action per
    turn: a **tool call** — `@search thai`, `@allergens Tofu Satay`, `@order Tofu Satay` — or a
    **message** to the diner. (A chat model's `<tool_call>{...}</tool_call>` works too; anything
    malformed becomes an "invalid action" observation, never a crash.)

    The menu below is everything the tools know: dishes with their cuisine, allergens, diet,
    price and preparation time.
    """)
    return


@app.cell
def _(load_menu, pl):
    menu = load_menu()
    menu_frame = pl.DataFrame(
        [d.model_dump() | {"allergens": ", ".join(d.allergens) or "-"} for d in menu.dishes]
    ).select("name", "cuisine", "allergens", "vegetarian", "price", "minutes")
    menu_frame
    return (menu,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    **Tasks and diners.** A task is a request — with a cuisine or without one (ambiguous on
    purpose), sometimes with a price or time limit. A diner is a profile: verbosity, pace, diet,
    allergies. Tasks and profiles are split: the held-out ones are never trained on, and every
    number that claims quality is measured on them.
    """)
    return


@app.cell
def _(generate_tasks, load_constitution, load_profiles, load_split, paths, pl):
    constitution = load_constitution(paths.DEFAULT_CONSTITUTION)
    profiles = {p.id: p for p in load_profiles(paths.PROFILES)}
    heldout_profiles = load_split("heldout")
    tasks = {t.id: t for t in generate_tasks(12, seed=7, split="heldout")}
    pl.DataFrame(
        [
            {
                "task": t.id,
                "request": t.request,
                "cuisine": t.cuisine or f"(asks; wants {t.hidden_cuisine})",
                "max_price": t.max_price,
                "max_minutes": t.max_minutes,
            }
            for t in tasks.values()
        ]
    )
    return constitution, heldout_profiles, profiles, tasks


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 2 · Play the agent

    Choose a task and a diner, then type the agent's actions, **one per line**. The dialogue
    replays after every change: the simulated diner answers messages, the tools answer tool
    calls, and the rule judge (the independent ground truth, `kitchen.judge`) marks every turn
    against the diner's personal constitution. Try recommending a dish without checking its
    allergens, or writing a long message to a hurried diner.
    """)
    return


@app.cell
def _(heldout_profiles, mo, notebook, profiles, tasks):
    task_pick = mo.ui.dropdown(
        {t.request + f" ({t.id})": t.id for t in tasks.values()},
        value=next(t.request + f" ({t.id})" for t in tasks.values()),
        label="task",
    )
    profile_pick = mo.ui.dropdown(
        list(profiles), value=notebook.arg("profile", heldout_profiles[0]), label="diner"
    )
    episode_seed = mo.ui.number(0, 1000, value=0, label="diner's seed")
    mo.hstack([task_pick, profile_pick, episode_seed], justify="start", wrap=True)
    return episode_seed, profile_pick, task_pick


@app.cell
def _(constitution, make_job, mo, profile_pick, profiles, task_pick, tasks):
    job = make_job(tasks[task_pick.value], profiles[profile_pick.value], constitution)
    mo.md(
        f"Diner `{job[1].profile}` — what the policy is told: "
        f"`{ {k: v for k, v in job[1].dimensions.items()} }`"
    )
    return (job,)


@app.cell
def _(mo):
    actions = mo.ui.text_area(
        value="Hello! Which cuisine would you like today?\n@search thai\n@allergens Tofu Satay\n"
        "I recommend Tofu Satay. Shall I order it?\n@order Tofu Satay",
        label="agent actions, one per line",
        rows=6,
        full_width=True,
    )
    actions
    return (actions,)


@app.cell
def _(World, actions, episode_seed, job, judge, mo, render_transcript):
    _task, _pc, _diner = job
    _world = World()
    _world.reset(
        _task,
        _pc.dimensions,
        profile=_pc.profile,
        personal_version=_pc.version,
        seed=int(episode_seed.value),
        diner=_diner,
    )
    for _line in actions.value.splitlines():
        if _line.strip() and not _world.traj.done:
            _world.step(_line)
    played = _world.traj
    played_review = judge(played, _pc)
    _outcome = played.outcome.reason if played.outcome else "the episode is still open"
    _bad = "\n".join(f"- t{v.turn} **{v.clause}**: {v.reason}" for v in played_review.violations())
    mo.vstack(
        [
            mo.md(f"```text\n{render_transcript(played)}\n```"),
            mo.md(f"**Outcome:** {_outcome}\n\n**Violations:**\n{_bad or '- none'}"),
        ]
    )
    return (played,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ### Watch the shipped policy play

    The same task and diner, played by the tiny SFT policy that ships in `data/models/policy-tiny`
    (2M parameters, trained from scratch by the recipe in `recipes/sft_tiny.yaml`). Sampling is
    seeded: change the seed for another episode.
    """)
    return


@app.cell
def _(mo):
    policy_seed = mo.ui.number(0, 10_000, value=0, label="sampling seed")
    policy_temperature = mo.ui.slider(
        0.1, 1.5, step=0.1, value=1.0, label="temperature", show_value=True
    )
    play = mo.ui.run_button(label="Play")
    mo.hstack([policy_seed, policy_temperature, play], justify="start", gap=2, wrap=True)
    return play, policy_seed, policy_temperature


@app.cell
def _(ModelSpec, load_model):
    policy_model, policy_tok = load_model(ModelSpec(path="data/models/policy-tiny"))
    return policy_model, policy_tok


@app.cell
def _(
    RolloutConfig,
    job,
    judge,
    mo,
    notebook,
    play,
    policy_model,
    policy_seed,
    policy_temperature,
    policy_tok,
    render_transcript,
    rollout,
):
    if notebook.gate(play):
        (policy_traj,), _ = rollout(
            policy_model,
            policy_tok,
            [job],
            RolloutConfig(k=1, temperature=policy_temperature.value),
            seed=int(policy_seed.value),
        )
        _review = judge(policy_traj, job[1])
        _bad = "\n".join(f"- t{v.turn} **{v.clause}**: {v.reason}" for v in _review.violations())
        _out = mo.vstack(
            [
                mo.md(f"```text\n{render_transcript(policy_traj)}\n```"),
                mo.md(
                    f"**Outcome:** {policy_traj.outcome.reason}\n\n**Violations:**\n"
                    f"{_bad or '- none'}"
                ),
            ]
        )
    else:
        policy_traj = None
        _out = mo.callout(mo.md("Click **Play** to watch the policy."))
    _out
    return (policy_traj,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ### Does the policy read the profile?

    Personalisation starts here, before any RL: the diner's profile is a line of the system
    message (`verbosity=brief, pace=hurried, …`), and the policy has to *use* it. A direct test:
    cut held-out dialogues just before their first recommendation and let the policy write it
    with only `verbosity=` changed, everything else the same (`kitchen.evaluate.profile_swap`;
    from the command line, `kitchen eval --policy PATH --profile-swap N`). If the three lengths
    come out about equal, the policy ignores the profile, and RL — whose reward asks brief and
    detailed diners for opposite lengths — starts from a policy that cannot tell them apart.

    Measured on 60 dialogues: the shipped policy writes 8.9 / 9.0 / 9.8 words for brief / normal
    / detailed diners, where the data's own recommendations hold 10.3 / 12.3 / 19.8. It learnt
    the data's length, not that the profile sets it. (Training it 300 steps more on fresh
    dialogues, `recipes/sft_tiny_more.yaml`, gives 7.5 / 9.3 / 12.5: closer, not there.)
    """)
    return


@app.cell
def _(mo, notebook, paths, pl, policy_model, policy_tok, profile_swap, read_jsonl):
    _n = 6 if notebook.small() else 24
    _rows = list(read_jsonl(paths.DATA / "sft" / "eval.jsonl"))[:_n]
    with notebook.spinner(f"Writing {_n} first recommendations for three diners each"):
        swap = profile_swap((policy_model, policy_tok), _rows, samples=1 if notebook.small() else 2)
    swap_table = pl.DataFrame(
        {
            "verbosity": list(swap["policy"]),
            "policy: words": [round(w, 1) for w in swap["policy"].values()],
            "data: words": [round(w, 1) for w in swap["data"].values()],
        }
    )
    mo.vstack([mo.md(f"First recommendation on {_n} held-out dialogues:"), swap_table])
    return swap, swap_table


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 3 · The SFT data

    `kitchen world sft-data` plays the scripted agent on training tasks and profiles and writes
    the dialogues as chat messages (`data/sft/train.jsonl`, held-out ones in `eval.jsonl`), the
    diner's profile in the system message. Below: what the agent does, and how many words it
    writes per message for each kind of diner. The agent follows the diner's verbosity in about
    70% of episodes (`kitchen/scripted.py`), so the lengths differ by group — learnable, and
    imperfect enough that RL still has something to do.
    """)
    return


@app.cell
def _(parse_action, paths, pl, re, read_dialogues, word_count):
    sft_dialogues = read_dialogues(paths.DATA / "sft" / "train.jsonl")
    _rows = []
    for _i, _d in enumerate(sft_dialogues):
        _verbosity = re.search(r"verbosity=(\w+)", _d[0]["content"]).group(1)
        for _m in _d:
            if _m["role"] != "assistant":
                continue
            _a = parse_action(_m["content"])
            _rows.append(
                {
                    "dialogue": _i,
                    "verbosity": _verbosity,
                    "action": _a.tool if _a.kind == "tool" else _a.kind,
                    "words": word_count(_m["content"]) if _a.kind == "say" else None,
                }
            )
    sft_actions = pl.DataFrame(_rows)
    data_stats = {
        "dialogues": len(sft_dialogues),
        "assistant turns per dialogue": round(sft_actions.height / len(sft_dialogues), 2),
    }
    data_stats
    return data_stats, sft_actions


@app.cell
def _(charts, mo, pl, sft_actions):
    _kinds = sft_actions.group_by("action").agg(pl.len().alias("turns"))
    _words = (
        sft_actions.drop_nulls("words")
        .group_by("verbosity")
        .agg(pl.col("words").mean().round(1).alias("mean words per message"))
        .sort("verbosity")
    )
    mo.hstack(
        [charts.counts_bar(_kinds, "action", "turns", "assistant actions in the SFT data"), _words],
        justify="start",
        gap=2,
        wrap=True,
    )
    return


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 4 · A small SFT run

    The shipped policy took `kitchen sft recipes/sft_tiny.yaml` (26 minutes on two CPU cores).
    Here is the same machinery on a much smaller model and a slice of the data, so you can watch
    it learn: a tokenizer is trained on the dialogues, a random-initialised Qwen2 is
    built, and TRL's `SFTTrainer` trains it with **assistant-only loss** — only the agent's tokens
    are predicted, never the diner's or the tools'. The chart updates as the trainer logs.

    The shipped recipe does one thing more, which this small run skips: before the dialogues,
    the fresh model learns to *copy* runs of random tokens (`copy_warmup:`,
    `kitchen/copying.py`, 11 of the 26 minutes). Trained on the dialogues alone, a model this
    small recalls dish names from the menu instead of copying them from the dialogue, and writes
    the menu's most familiar dish where another belonged — a red line (A3). A model that copies
    errs differently where its copy is unsure: it writes a name that is no dish at all
    (`I recommend Mochi Chai, …`), which breaks A3 too — the rule judge reads the offer forms
    for such names (`Menu.invented`), since no menu lookup would find them.
    """)
    return


@app.cell
def _(mo, notebook):
    _small = notebook.small()
    sft_steps = mo.ui.slider(
        5,
        600,
        step=5,
        value=notebook.arg("steps", 12 if _small else 150),
        label="steps",
        show_value=True,
    )
    sft_dialogue_count = mo.ui.slider(
        16,
        3000,
        step=16,
        value=notebook.arg("dialogues", 48 if _small else 800),
        label="training dialogues",
        show_value=True,
    )
    sft_width = mo.ui.dropdown(
        {"64 (0.2M parameters)": 64, "128 (0.6M)": 128, "192 (2M, the shipped size)": 192},
        value="64 (0.2M parameters)",
        label="hidden size",
    )
    train_button = mo.ui.run_button(label="Train")
    mo.hstack(
        [sft_steps, sft_dialogue_count, sft_width, train_button], justify="start", gap=2, wrap=True
    )
    return sft_dialogue_count, sft_steps, sft_width, train_button


@app.cell
def _(
    ModelSource,
    SFTData,
    SFTRecipe,
    TinyModelConfig,
    TokenizerSettings,
    sft_dialogue_count,
    sft_steps,
    sft_width,
):
    _h = sft_width.value
    demo_recipe = SFTRecipe(
        output_dir="nb02-demo",  # replaced by a temporary folder when the run starts
        seed=0,
        model=ModelSource(
            tiny=TinyModelConfig(
                hidden_size=_h,
                num_layers=2 if _h < 192 else 4,
                num_heads=4 if _h < 192 else 6,
                num_kv_heads=2,
                intermediate_size=_h * 8 // 3 // 16 * 16,
                max_positions=1024,
            ),
            tokenizer=TokenizerSettings(vocab_size=1024),
        ),
        data=SFTData(
            train="data/sft/train.jsonl",
            eval="data/sft/eval.jsonl",
            max_train=sft_dialogue_count.value,
            max_eval=16,
        ),
        max_steps=sft_steps.value,
        batch_size=8,
        lr=3e-3,
        eval_every=max(sft_steps.value // 4, 1),
        save_every=10_000,
        log_every=max(sft_steps.value // 20, 1),
        group_by_length=True,
    )
    return (demo_recipe,)


@app.cell
def _(Path, charts, demo_recipe, mo, notebook, pl, run_sft, tempfile, train_button):
    if notebook.gate(train_button):
        _rows = []

        def _on_log(row):
            # the live chart: redrawn below the progress bar at every logged step
            if "loss" in row or "eval_loss" in row:
                _rows.append(row)
                notebook.show(charts.loss_curve(pl.DataFrame(_rows, infer_schema_length=None)))

        _out = Path(tempfile.mkdtemp(prefix="kitchen-nb02-"))
        with notebook.trainer_progress(f"SFT: {demo_recipe.max_steps} optimiser steps"):
            sft_result = run_sft(
                demo_recipe.model_copy(update={"output_dir": str(_out)}), on_log=_on_log
            )
        sft_log = pl.DataFrame(
            [r for r in sft_result.log if "loss" in r or "eval_loss" in r], infer_schema_length=None
        ).select(pl.col("step"), pl.col("^(loss|eval_loss)$"))
        _view = charts.loss_curve(sft_log)
    else:
        sft_result, sft_log = None, None
        _view = mo.callout(mo.md("Click **Train** to run the small SFT."))
    _view
    return sft_log, sft_result


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## 5 · Samples before and after

    The first agent turn of a few held-out dialogues, answered greedily by the small model before
    training (random weights, same seed), after it, and by the shipped policy. Before training
    the model writes noise; a few hundred steps teach it the action syntax; the shipped policy
    has learnt the whole protocol — but not yet to adapt to the diner.
    """)
    return


@app.cell
def _(
    ModelSpec,
    build_tiny_model,
    demo_recipe,
    load_model,
    mo,
    parse_action,
    paths,
    pl,
    policy_model,
    policy_tok,
    read_dialogues,
    reply,
    sft_result,
):
    samples = None
    if sft_result is not None:
        _after, _tok = load_model(ModelSpec(path=str(sft_result.final_dir)))
        _before = build_tiny_model(_tok, demo_recipe.model.tiny, seed=demo_recipe.seed)
        _rows = []
        for _d in read_dialogues(paths.DATA / "sft" / "eval.jsonl", limit=4):
            _k = next(i for i, m in enumerate(_d) if m["role"] == "assistant")
            _prompt = _d[:_k]
            _row = {"diner says": _prompt[-1]["content"], "scripted agent": _d[_k]["content"]}
            for _name, (_m, _t) in {
                "before": (_before, _tok),
                "after": (_after, _tok),
                "shipped policy": (policy_model, policy_tok),
            }.items():
                _row[_name] = reply(_m, _t, _prompt, max_new_tokens=32)
            _rows.append(_row)
        samples = pl.DataFrame(_rows)
    (
        samples
        if samples is not None
        else mo.md("*Train the small model above: its samples appear here.*")
    )
    return (samples,)


@app.cell(hide_code=True)
def _(mo):
    mo.md(r"""
    ## Key points

    - The concierge world is text in, text out: three tools, a rule-based diner, and a judge
      whose verdicts are exact — so every later number can be checked against ground truth.
    - Tasks and profiles are split; quality is only ever claimed on the held-out ones
      (`kitchen eval --policy data/models/policy-tiny`).
    - SFT on scripted dialogues gives a policy that speaks the protocol (valid actions, tool use,
      ordering). Whether it also reads the diner's profile is a separate question — measure it
      (the profile swap): the shipped policy barely does, though its data did.
    - Assistant-only loss: the policy learns what to say and when to stop, not the diner's lines.
    - A model trained from scratch must be taught to copy before it learns the dialogues (the
      copy warm-up); a pretrained one already can.
    - Next: `03_grm.py` — the reward model that reviews every turn against the constitution.
    """)
    return


if __name__ == "__main__":
    app.run()
