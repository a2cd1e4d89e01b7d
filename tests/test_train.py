"""The training loop: updates move the policy the right way; runs resume to the same result."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import yaml

from kitchen import paths
from kitchen.config import KitchenError
from kitchen.mapo import SHARED_FIELDS
from kitchen.models import token_logprobs
from kitchen.rollout import render_prompt, rollout
from kitchen.train import (
    Recipe,
    Run,
    cook,
    file_problems,
    held_out_episodes,
    latest_checkpoint,
    load_recipe,
    load_run_policy,
    pack_units,
    run_checkpoint,
    spans_of,
    unit_tensors,
    unit_tree,
)

POLICY = os.environ.get("KITCHEN_TEST_POLICY", str(paths.DATA / "models" / "policy-tiny"))


def sequences(tok, prompts, actions, device):
    """The oracle the packed update is checked against: one right-padded sequence per turn.
    Returns ids [B, T], attention mask [B, T] and the action-token mask aligned with
    `token_logprobs`' output [B, T-1] (position t scores token t+1)."""
    ids, act = [], []
    for p, a in zip(prompts, actions, strict=True):
        pid = tok(p, add_special_tokens=False)["input_ids"]
        ids.append(pid + list(a))
        act.append([0] * (len(pid) - 1) + [1] * len(a))
    width = max(map(len, ids))
    pad = tok.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids], device=device)
    attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=device)
    action = torch.tensor([x + [0] * (width - 1 - len(x)) for x in act], device=device)
    return input_ids, attn, action.bool()


def gather_actions(values, action):
    """Pack the action positions of `values` [B, T-1] to the left: ([B, L], mask [B, L])."""
    lengths = action.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    order = torch.argsort((~action).int(), dim=-1, stable=True)[:, :width]
    packed = values.gather(-1, order)
    mask = torch.arange(width, device=values.device)[None, :] < lengths[:, None]
    return packed * mask, mask


def tiny_recipe(name: str, **over) -> Recipe:
    base = {
        "name": name,
        "seed": 3,
        "policy": {"path": POLICY, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "reward": {"reviewer": "judge"},
        "rollout": {"k": 4, "max_turns": 5, "max_new_tokens": 40},
        "advantage": {"preset": "mapo", "overrides": {"beta": 0.02, "state_key": "abstract"}},
        "train": {"iterations": 2, "tasks_per_iteration": 2, "task_pool": 20, "lr": 3e-3},
        "eval_every": 0,
        "checkpoint_every": 1,
        "samples_per_iteration": 2,
        "torch_threads": 1,
    }
    for k, v in over.items():
        base[k] = base[k] | v if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return Recipe.model_validate(base)


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RUNS", tmp_path)
    return tmp_path


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def scored_alone(tok, model, prompt, action):
    """Log-probs of `action` right after `prompt`, scored as a sequence of its own, with no
    grad: ([1, L] values at the action's tokens, [1, L] mask)."""
    ids, attn, act = sequences(tok, [prompt], [action], model.device)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn)
    return gather_actions(logp, act)


def restore(model, state):
    """Put the adapter weights `state` (as `lora_state` took them) back into `model`."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            if k in state:
                p.copy_(state[k])


def action_logprobs(run, model=None):
    """Mean log-prob of each (trajectory, turn) action of the last iteration under `model`."""
    model = model or run.model
    out = {}
    for t, _pc in zip(run.last["trajectories"], run.last["pcs"], strict=True):
        for ti in t.turns:
            if (t.id, ti.turn) not in run.last["advantages"]:
                continue
            prompt = render_prompt(run.tok, t.prompt_messages(ti.turn))
            packed, mask = scored_alone(run.tok, model, prompt, ti.tokens)
            out[(t.id, ti.turn)] = (packed.sum() / mask.sum()).item()
    return out


def test_logprobs_at_collection_match_the_training_forward(runs_dir):
    """The loss scores exactly the tokens the rollout sampled: same positions, same log-probs."""
    run = Run(tiny_recipe("align", train={"iterations": 1}), progress=False)
    trajs, _ = rollout(run.model, run.tok, run._jobs(0), run.recipe.rollout, seed=1)
    checked = 0
    for t in trajs[:4]:
        for ti in t.turns:
            prompt = render_prompt(run.tok, t.prompt_messages(ti.turn))
            packed, mask = scored_alone(run.tok, run.model.eval(), prompt, ti.tokens)
            assert int(mask.sum()) == len(ti.tokens)
            torch.testing.assert_close(
                packed[0, : len(ti.tokens)], torch.tensor(ti.logprobs), atol=2e-3, rtol=1e-3
            )
            checked += 1
    assert checked > 4
    # packed: one sequence per trajectory scores every turn the same way
    items = [
        (t.id, ti.turn, render_prompt(run.tok, t.prompt_messages(ti.turn)), ti.tokens)
        for t in trajs[:4]
        for ti in t.turns
    ]
    units = pack_units(run.tok, items)
    packed_trajs = sum(len(u.spans) > 1 for u in units)
    assert packed_trajs >= 2, "most trajectories should pack into one sequence"
    ids, attn, at = unit_tensors(units, run.tok.pad_token_id, run.model.device)
    with torch.no_grad():
        logp, _ = token_logprobs(run.model.eval(), ids, attn)
        fast, _ = token_logprobs(run.model.eval(), ids, attn, positions=at)
    torch.testing.assert_close(fast, logp * at, atol=1e-4, rtol=1e-4)  # selected rows: same values
    idx, packed, mask = spans_of(fast, units)
    for b, i in enumerate(idx):
        recorded = [ti.logprobs for t in trajs[:4] for ti in t.turns][i]
        torch.testing.assert_close(
            packed[b, : len(recorded)], torch.tensor(recorded), atol=2e-3, rtol=1e-3
        )
        assert int(mask[b].sum()) == len(recorded)


@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_update_moves_weights_toward_positive_advantages(runs_dir, autocast):
    """After one iteration the adapter has moved, and actions with a higher advantage gained
    log-probability relative to those with a lower one — also with the update's passes under
    bfloat16 autocast (`train.autocast`), where the adapter stays float32."""
    run = Run(tiny_recipe("update", train={"autocast": autocast}), progress=False)
    before = lora_state(run.model)
    m = run.step()
    after = lora_state(run.model)
    moved = sum((after[k] - before[k]).abs().sum().item() for k in before)
    assert moved > 0 and m["train/step_samples"] > 0
    new = action_logprobs(run)
    restore(run.model, before)
    old = action_logprobs(run)
    adv = run.last["advantages"]
    keys = sorted(k for k in new if abs(adv[k]) > 1e-6)
    assert len(keys) >= 4
    a = torch.tensor([adv[k] for k in keys])
    d = torch.tensor([new[k] - old[k] for k in keys])
    # actions with a positive advantage gained log-probability on average, those with a negative
    # one lost it, and the change follows the advantage (one update of ~30 actions: a noisy
    # correlation, 0.28 on the shipped policy of 2026-12-03 at this seed)
    assert d[a > 0].mean() > 0 > d[a < 0].mean(), (d[a > 0].mean(), d[a < 0].mean())
    corr = torch.corrcoef(torch.stack([a, d]))[0, 1]
    assert corr > 0.2, f"log-prob change does not follow the advantage (corr {corr:.2f})"
    assert all(v.dtype == torch.float32 for v in after.values())
    for key in (
        "reward/global_mean",
        "adv/mixed_abs_mean",
        "kl/mean",
        "policy/entropy",
        "group/local_size_mean",
        "speed/rollout_tokens_per_s",
        "judge/compliance",
    ):
        assert key in m


def test_a_run_on_decoupled_clauses_trains_on_every_turns_verdicts(runs_dir):
    """`local_signal: clauses`: the step samples carry each turn's verdicts in the
    constitution's clause order (what the reviewer said, as +1 / −1, NaN where a clause does not
    apply), the buffer keeps them for the state groups, and the update moves the adapter."""
    from kitchen.review import clause_scores

    over = {"beta": 0.02, "state_key": "abstract", "local_signal": "clauses"}
    over["alpha"] = {"kind": "constant", "alpha0": 0.5}
    run = Run(tiny_recipe("clauses", advantage={"overrides": over}), progress=False)
    before = lora_state(run.model)
    m = run.step()
    after = lora_state(run.model)
    assert sum((after[k] - before[k]).abs().sum().item() for k in before) > 0
    assert 0 < m["group/clause_signal_frac"] <= 1 and m["adv/local_abs_mean"] > 0
    ids = run.constitution.clause_ids
    stored = run.buffer.samples(run.buffer.rows())
    assert stored.clauses.shape == (len(stored), len(ids))
    row = {
        (k, t): i for i, (k, t) in enumerate(zip(stored.traj, stored.turn.tolist(), strict=True))
    }
    checked = 0
    for traj, review, pc in zip(
        run.last["trajectories"], run.last["reviews"], run.last["pcs"], strict=True
    ):
        for t, scores in enumerate(clause_scores(review, pc)):
            if (traj.id, t) in row:
                got = stored.clauses[row[traj.id, t]].tolist()
                want = [scores.get(c, math.nan) for c in ids]
                assert [None if math.isnan(x) else x for x in got] == [
                    None if math.isnan(x) else x for x in want
                ]
                checked += 1
    assert checked >= 8


def test_resume_reaches_the_same_result(runs_dir):
    """A run killed after its first checkpoint and resumed ends where an uninterrupted run ends."""
    # the learning rate of a resumed iteration comes back too; two minibatches: KL > 0 in the first
    cosine = {"lr_schedule": "cosine", "minibatch": 4}
    # and so does an adapted β (a target this small doubles it after every iteration that drifts)
    adaptive = {"overrides": {"beta": 0.02, "state_key": "abstract", "kl_target": 1e-6}}
    straight = cook(tiny_recipe("straight", train=cosine, advantage=adaptive), progress=False)

    class Crash(Exception):
        pass

    def crash_after_first(run, m):
        if run.iteration == 1:
            raise Crash

    recipe = tiny_recipe("resumed", train=cosine, advantage=adaptive)
    with pytest.raises(Crash):
        cook(recipe, progress=False, on_iteration=crash_after_first)
    folder = runs_dir / "resumed"
    assert latest_checkpoint(folder).name == "it-0001"
    resumed = cook(resume=folder, progress=False)
    a, b = lora_state(straight.model), lora_state(resumed.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    assert [m["train/lr"] for m in straight.metrics] == pytest.approx([3e-3, 3e-4])
    assert [m["kl/beta"] for m in straight.metrics] == pytest.approx([0.02, 0.04])
    assert straight.beta == resumed.beta == pytest.approx(0.08)
    keep = [k for k in straight.metrics[-1] if not k.startswith(("speed/", "time/"))]
    for x, y in zip(straight.metrics, resumed.metrics, strict=True):
        assert {k: x.get(k) for k in keep} == pytest.approx(
            {k: y.get(k) for k in keep}, rel=1e-4, abs=1e-6
        )
    # the resumed run's policy loads for evaluation from its checkpoint
    model, _ = load_run_policy(folder)
    torch.testing.assert_close(lora_state(model)[next(iter(a))], b[next(iter(a))])


def test_packing_restarts_a_sequence_only_where_a_prompt_differs_from_what_was_sampled():
    """Turns whose prompts extend the previous prompt plus its sampled action share a sequence; a
    turn whose prompt differs (the world re-rendered the action: a sampled leading space
    stripped) starts a new sequence from its own prompt, and the turns after it join that one.
    Every span then holds exactly its action's ids after exactly its turn's prompt."""
    from kitchen.models import ModelSpec, load_model

    _, tok = load_model(ModelSpec(path=POLICY))
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    a0, a1, a2 = ids(" hello there"), ids(" Pad Thai, 9 words"), ids(" @order Pad Thai")
    p0 = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    p1 = p0 + "hello there<|im_end|>\n<|im_start|>assistant\n"  # stripped: not p0 + a0
    p2 = tok.decode(ids(p1) + a1)  # p1 plus the sampled action, exactly
    assert ids(p2) == ids(p1) + a1 and ids(p1)[: len(ids(p0) + a0)] != ids(p0) + a0
    items = [("t", 0, p0, a0), ("t", 1, p1, a1), ("t", 2, p2, a2), ("u", 0, p0, a0)]
    units = pack_units(tok, items)
    assert sorted(len(u.spans) for u in units) == [1, 1, 2]
    for seq, spans, _ in units:
        for i, start, length in spans:
            assert seq[:start] == ids(items[i][2]) and seq[start : start + length] == items[i][3]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_branch_scores_its_action_as_its_prompt_alone_would(runs_dir, attention):
    """Actions whose prompt is a prefix of a packed dialogue (the guard's blocked candidates)
    ride on its sequence as branches (`unit_tree`): each is scored exactly as the prompt alone
    followed by the action, the played turns as before, and the dialogue stays one sequence —
    with SDPA and with eager attention."""
    run = Run(tiny_recipe("tree", train={"iterations": 1}), progress=False)
    model = run.model.eval()
    model.config._attn_implementation = attention
    trajs, _ = rollout(model, run.tok, run._jobs(0), run.recipe.rollout, seed=1)
    trajs = [t for t in trajs if len(t.turns) >= 3][:3]
    assert len(trajs) == 3
    items = []
    for t in trajs:
        prompts = [render_prompt(run.tok, t.prompt_messages(ti.turn)) for ti in t.turns]
        items += [(t.id, ti.turn, p, ti.tokens) for ti, p in zip(t.turns, prompts, strict=True)]
        for turn in (1, 1, 2):  # two candidates at one state, one at the next
            other = t.turns[(turn + 1) % len(t.turns)].tokens  # someone else's action
            items.append((t.id, turn, prompts[turn], other[: 5 + turn]))
    units = pack_units(run.tok, items)
    assert len(units) == 3 and all(len(u.branches) == 3 for u in units)
    ids, attn, at = unit_tensors(units, run.tok.pad_token_id, model.device)
    with torch.no_grad():
        packed, _ = token_logprobs(
            model, ids, attn, positions=at, tree=unit_tree(units, model.device)
        )
    idx, got, mask = spans_of(packed, units)
    for b, i in enumerate(idx):
        _, _, prompt, action = items[i]
        want, _ = scored_alone(run.tok, model, prompt, action)
        assert int(mask[b].sum()) == len(action)
        torch.testing.assert_close(got[b, : len(action)], want[0], atol=2e-4, rtol=1e-4)
    flat = pack_units(run.tok, items, branches=False)  # without: a sequence per branch, and
    assert len(flat) >= 3 + 3 * 3 + 3  # the played turns after them start another


def test_one_update_is_the_same_with_branches_or_separate_sequences(runs_dir, monkeypatch):
    """Packing the guard's blocked candidates as branches changes the cost, not the update: two
    runs of one recipe (`train.guard: learn`, one optimiser step an iteration) whose only
    difference is the packing end their first iteration with the same adapter, having read
    fewer tokens with branches."""
    from kitchen import train

    recipe = tiny_recipe(
        "same",
        train={"iterations": 1, "guard": "learn", "minibatch": 10_000, "tasks_per_iteration": 4},
    )
    runs, tokens = [], []
    for branches in (True, False):
        if not branches:
            monkeypatch.setattr(train, "takes_tree", lambda model: False)
        run = Run(recipe.model_copy(update={"name": f"same-{branches}"}), progress=False)
        before = lora_state(run.model)
        m = run.step()
        assert m["train/blocked_samples"] > 0 and m["policy/grad_norm"] > 0
        tokens.append(m["speed/update_tokens_per_s"] * m["time/update_s"])
        runs.append(lora_state(run.model))
    assert tokens[0] < tokens[1], tokens
    moved = max((runs[0][k] - before[k]).abs().max().item() for k in before)
    # Adam's first step is about ±lr wherever the gradient is not ~0, so float noise in a
    # gradient near Adam's eps shows as a sliver of a step (up to 1.4% of one measured, in 1 of
    # 512 weights, once the judge read invented dishes and the guard blocked other candidates);
    # wrong log-probs would flip whole signs, a difference of up to two steps
    for k in before:
        torch.testing.assert_close(runs[0][k], runs[1][k], atol=5e-2 * moved, rtol=1e-3)


def test_learning_rate_schedules():
    """`lr_at`: constant is `lr` throughout; cosine starts at `lr`, passes the mean of `lr` and
    its floor half-way and ends at `lr_final`·`lr` on the last iteration."""
    from kitchen.train import TrainConfig, lr_at

    flat = TrainConfig(iterations=5, lr=1e-3)
    assert [lr_at(i, flat) for i in range(5)] == [1e-3] * 5
    cos = TrainConfig(iterations=5, lr=1e-3, lr_schedule="cosine", lr_final=0.1)
    got = [lr_at(i, cos) for i in range(5)]
    assert got[0] == pytest.approx(1e-3) and got[-1] == pytest.approx(1e-4)
    assert got[2] == pytest.approx(0.55e-3)
    assert all(a > b for a, b in zip(got, got[1:], strict=False))
    assert lr_at(9, cos) == pytest.approx(1e-4)  # past the end: the floor


def test_interrupted_checkpoint_leaves_the_previous_one(runs_dir, monkeypatch):
    run = cook(tiny_recipe("atomic", train={"iterations": 1}), progress=False)
    good = latest_checkpoint(run.folder)
    real = shutil.rmtree

    def fail_midway(*a, **k):  # the save dies after writing its temporary folder
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", fail_midway)
    with pytest.raises(OSError):
        run.save()
    monkeypatch.setattr(os, "replace", os.__dict__["replace"])
    assert latest_checkpoint(run.folder) == good
    assert (good / "state.pt").exists()
    real(run.folder / "checkpoints" / f".{good.name}.tmp", ignore_errors=True)


def test_fresh_run_refuses_to_overwrite(runs_dir):
    cook(tiny_recipe("once", train={"iterations": 1}), progress=False)
    with pytest.raises(KitchenError, match="already holds a run"):
        cook(tiny_recipe("once", train={"iterations": 1}), progress=False)


def test_kept_checkpoints_survive_pruning_and_load_as_policies(runs_dir):
    """`keep_checkpoints` writes a checkpoint off the checkpoint_every grid and never prunes it
    (the newest two are kept as always); a checkpoint folder loads as that iteration's policy."""
    run = cook(tiny_recipe("kept", train={"iterations": 4}, checkpoint_every=3,
                           keep_checkpoints=[1]), progress=False)  # fmt: skip
    ck = runs_dir / "kept" / "checkpoints"
    assert sorted(p.name for p in ck.glob("it-*")) == ["it-0001", "it-0003", "it-0004"]
    assert run_checkpoint(ck / "it-0001") == (runs_dir / "kept", ck / "it-0001")
    assert run_checkpoint(runs_dir / "kept") == (runs_dir / "kept", ck / "it-0004")
    early, _ = load_run_policy(ck / "it-0001")
    last, _ = load_run_policy(runs_dir / "kept")
    name = next(iter(lora_state(last)))
    torch.testing.assert_close(lora_state(last)[name], lora_state(run.model)[name])
    assert not torch.equal(lora_state(early)[name], lora_state(last)[name])


def recipe_from(tmp_path, text: str):
    """`load_recipe` of `text` written to `tmp_path/r.yaml` (its errors name that file)."""
    f = tmp_path / "r.yaml"
    f.write_text(text)
    return load_recipe(f)


def test_a_kept_checkpoint_past_the_last_iteration_is_a_located_error(tmp_path):
    with pytest.raises(
        KitchenError, match=r"r.yaml:3: keep_checkpoints: iterations \[9\] lie beyond"
    ):
        recipe_from(tmp_path, "name: x\ntrain: {iterations: 4}\nkeep_checkpoints: [2, 9]\n")


def test_bad_recipes_are_located(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\npolicy: {path: p}\nrollout: {k: 0}\n")
    with pytest.raises(KitchenError) as e:
        load_recipe(bad)
    text = str(e.value)
    assert f"{bad}:2: policy" in text and "lora" in text
    assert f"{bad}:3: rollout.k" in text
    bad.write_text("name: x\nadvantage: {preset: ppo}\n")
    with pytest.raises(KitchenError, match=r"r.yaml:2: advantage: unknown preset 'ppo'"):
        load_recipe(bad)
    bad.write_text("name: x\ncompare:\n  base: {preset: grpo}\n  odd: {preset: ppo}\n")
    with pytest.raises(KitchenError, match=r"r.yaml:4: compare.odd: unknown preset 'ppo'"):
        load_recipe(bad)


def test_a_compare_arm_differs_in_the_advantage_estimator_only():
    """`Recipe.variant(arm)`: the arm's preset over the base's state key and loss; every other
    field as the base's; the arm's own overrides win."""
    r = tiny_recipe("cmp", compare={"grpo": {"preset": "grpo"}, "rloo": {"preset": "rloo"}})
    v = r.variant("grpo")
    assert v.name == "cmp-grpo" and v.compare == {}
    a, b = r.model_dump(), v.model_dump()
    assert {k for k in a if a[k] != b[k]} == {"name", "advantage", "compare"}
    base, arm = r.advantage.resolve(), v.advantage.resolve()
    assert arm.name == "grpo" and arm.loss_agg == base.loss_agg == "token-mean"
    assert all(getattr(arm, k) == getattr(base, k) for k in SHARED_FIELDS)
    assert arm.use_buffer is False and arm.alpha.alpha0 == 0.0
    own = tiny_recipe(
        "own", compare={"g": {"preset": "grpo", "overrides": {"loss_agg": "seq-mean-token-sum"}}}
    )
    assert own.variant("g").advantage.resolve().loss_agg == "seq-mean-token-sum"
    with pytest.raises(KitchenError, match="no arm 'ppo'"):
        r.variant("ppo")


def test_shipped_recipes_load_and_point_at_what_ships():
    """Every shipped training recipe validates; its constitution, and a policy or GRM given as a
    path under data/, ship with the kit; each `compare` arm differs in the advantage only; the
    main job's recipe compares MAPO with GRPO."""
    checked = 0
    for f in sorted(paths.RECIPES.glob("*.yaml")):
        if f.name.startswith(("sft_", "grm_")):
            continue
        r = load_recipe(f)
        assert (paths.HOME / r.constitution).exists(), f
        for local in (r.policy.path, r.grm.model):
            if local.startswith("data/"):
                assert (paths.HOME / local / "config.json").exists(), (f, local)
        for arm in r.compare:
            v = r.variant(arm)
            assert v.advantage.resolve().name == r.compare[arm].preset
            assert v.model_dump(exclude={"name", "advantage", "compare"}) == r.model_dump(
                exclude={"name", "advantage", "compare"}
            )
        checked += 1
    assert checked >= 3
    main = load_recipe(paths.RECIPES / "tiny_mapo.yaml")
    assert main.advantage.resolve().name == "mapo" and "grpo" in main.compare


def test_an_advantage_that_reads_no_review_trains_the_same_without_the_grm(runs_dir):
    """GRPO reads the world's outcome alone, so the GRM's reviews change nothing its update
    sees: with `reward.unread_reviews: skip` (the default) the GRM is neither loaded nor run,
    and two iterations end with the same adapter, to the bit, and the same losses as a run that
    reviews with it; a MAPO recipe still reviews with the GRM."""
    grm = {"model": str(paths.DATA / "models" / "grm-tiny"), "batch_size": 8}
    grpo = {"preset": "grpo", "overrides": {"beta": 0.02, "state_key": "abstract"}}
    runs = {}
    for mode in ("review", "skip"):
        recipe = tiny_recipe(
            f"grpo-{mode}",
            grm=grm,
            advantage=grpo,
            reward={"reviewer": "grm", "unread_reviews": mode},
            checkpoint_every=10,
        )
        assert recipe.grm_reviews == (mode == "review")
        runs[mode] = run = Run(recipe, runs_dir / recipe.name, progress=False)
        for _ in range(2):
            run.step()
    assert runs["skip"].grm is None and runs["review"].grm.stats["lines"] > 0
    a, b = lora_state(runs["review"].model), lora_state(runs["skip"].model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("loss/total", "adv/global_std", "reward/global_mean", "judge/compliance"):
        assert [m[key] for m in runs["review"].metrics] == [m[key] for m in runs["skip"].metrics]
    assert "grm/parsed" in runs["review"].metrics[0] and "grm/parsed" not in runs["skip"].metrics[0]
    mapo_recipe = tiny_recipe("mapo-grm", grm=grm, reward={"reviewer": "grm"})
    assert mapo_recipe.grm_reviews


def test_gpu_recipe_path_runs_on_a_cpu_in_small_shape(runs_dir):
    """recipes/gpu_qwen_qlora.yaml's path — a LoRA policy, the GRM a second adapter on the same
    base, the KL reference that base with the adapters off — in a small shape on a CPU (the
    shipped tiny policy as the base, no quantisation): one iteration reviews with the GRM
    adapter and moves the policy adapter only; the base and the GRM adapter stay as they were.
    The GRM adapter is untrained here (its lines do not parse), so flagged reviews are kept and the
    world's outcome carries the advantage."""
    doc = yaml.safe_load((paths.RECIPES / "gpu_qwen_qlora.yaml").read_text())
    doc |= {
        "name": "gpu-small",
        "policy": doc["policy"] | {"path": POLICY, "quantization": "none", "lora": {"r": 4}},
        "grm": doc["grm"]
        | {"model": POLICY, "max_context_tokens": 1024, "max_new_tokens": 16, "batch_size": 8},
        "rollout": {"k": 4, "max_turns": 6, "max_new_tokens": 32},
        "reward": {"reviewer": "grm", "flagged": "keep"},
        "train": doc["train"] | {"iterations": 1, "tasks_per_iteration": 2, "lr": 1e-2},
        "eval_every": 0,
        "samples_per_iteration": 0,
        "torch_threads": 1,
    }
    run = Run(Recipe.model_validate(doc), runs_dir / "gpu-small", progress=False)
    params = dict(run.model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    lines = run.grm.stats["lines"]
    m = run.step()
    moved = {k for k, v in before.items() if not torch.equal(v, params[k].detach())}
    assert moved and all(f".{run.adapter}." in k for k in moved), sorted(moved)[:5]
    assert any(".grm." in k for k in before)  # the GRM adapter is on the same base
    assert run.grm.stats["lines"] > lines and m["grm/parsed"] >= 0
    assert m["train/step_samples"] > 0 and m["kl/mean"] >= 0


def _bench_gpu(*args):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(paths.HOME / "benchmarks" / "bench_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout[out.stdout.index("{") :])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_of_shared_base():
    """Qwen2.5-0.5B-shaped QLoRA: policy + KL reference + GRM on one base vs policy alone."""
    res = _bench_gpu("--iterations", "2")
    assert res["peak_gb_policy_only"] > 0 and res["ratio"] > 1.0
    assert res["ratio"] <= 1.5, res  # the goal is 1.2x; this catches a second copy of the weights


# --- runs that cannot learn fail loudly; metrics of nothing are not numbers -------------------


def test_errors_inside_advantage_overrides_are_located_at_their_field(tmp_path):
    """A bad override is `PATH:LINE: advantage.overrides.<field>: ...` (not a pydantic dump at the
    block's line): a NaN, a value out of range, a rule across fields (α above 1 with the convex
    mix), an unknown field; a compare arm's overrides the same way."""
    f = tmp_path / "r.yaml"
    head = "name: x\nadvantage:\n  preset: mapo\n  overrides:\n"
    cases = {
        "    beta: .nan\n": (5, "advantage.overrides.beta", "finite"),
        "    beta: -1\n": (5, "advantage.overrides.beta", "greater than or equal to 0"),
        "    state_key: abstract\n    alpha: {kind: linear, alpha0: 0.2, alpha1: 1.5}\n": (
            6,
            "advantage.overrides.alpha",
            "must lie in [0, 1]",
        ),
        "    betta: 0.1\n": (5, "advantage.overrides.betta", "did you mean 'beta'"),
    }
    for body, (line, where, needle) in cases.items():
        f.write_text(head + body)
        with pytest.raises(KitchenError) as e:
            load_recipe(f)
        (p,) = e.value.problems
        assert (p.line, p.where) == (line, where) and needle in p.message, str(p)
        assert "pydantic" not in p.message and "validation error" not in p.message
    f.write_text("name: x\ncompare:\n  g:\n    preset: grpo\n    overrides: {gamma: 3}\n")
    with pytest.raises(KitchenError, match=r"r.yaml:5: compare.g.overrides.gamma: .*less than"):
        load_recipe(f)


def test_k_of_one_is_rejected_for_estimators_that_normalise_within_a_task(tmp_path):
    """K = 1 with GRPO (task-group z-scores: every advantage 0) is a located error at
    rollout.k; REINFORCE++ (batch normalisation) may use K = 1."""
    with pytest.raises(KitchenError, match=r"r.yaml:2: rollout.k: k: 1 episode per task"):
        recipe_from(tmp_path, "name: x\nrollout: {k: 1}\nadvantage: {preset: grpo}\n")
    fine = recipe_from(tmp_path, "name: x\nrollout: {k: 1}\nadvantage: {preset: reinforce_pp}\n")
    assert fine.rollout.k == 1


def test_step_progress_with_a_signal_that_never_reads_it_is_rejected(tmp_path):
    """`reward.step_progress` pays the local reward; an arm that compares each clause's verdicts
    on their own (`local_signal: clauses`) never reads it, so the recipe says so where it is."""
    with pytest.raises(KitchenError, match=r"r.yaml:2: reward.step_progress: .*compare.c"):
        recipe_from(
            tmp_path,
            "name: x\nreward: {step_progress: 1}\ncompare:\n  c:\n    preset: mapo\n"
            "    overrides: {local_signal: clauses}\n",
        )
    assert recipe_from(tmp_path, "name: x\nreward: {step_progress: 1}\n").reward.step_progress == 1


def test_guard_fields_without_the_guard_are_rejected(tmp_path):
    """`train.guard_share` or `guard_budget` off their defaults while the guard is off would
    change nothing: the recipe says so where it is; with the guard on it loads."""
    with pytest.raises(KitchenError, match=r"r.yaml:2: train.guard_share: .*guard is 'off'"):
        recipe_from(tmp_path, "name: x\ntrain: {guard_share: 0.5}\n")
    on = recipe_from(
        tmp_path, "name: x\ntrain: {guard: learn, guard_share: 0.5, guard_budget: 5}\n"
    )
    assert on.train.guard_budget == 5


def test_preflight_stops_a_token_budget_the_context_cannot_hold(runs_dir):
    """Before the first iteration: a turn budget that leaves no room after the first prompt in
    the policy's context stops the run at rollout.max_new_tokens; nothing is trained or logged."""
    recipe = tiny_recipe("ctx", rollout={"max_new_tokens": 100_000})
    with pytest.raises(KitchenError) as e:
        cook(recipe, progress=False)
    (p,) = e.value.problems
    assert p.where == "rollout.max_new_tokens" and "max_position_embeddings" in p.message
    assert not (runs_dir / "ctx" / "metrics.parquet").exists()


def test_preflight_rejects_a_reviewer_that_cannot_write_reviews(runs_dir):
    """A wrong GRM checkpoint (the policy itself) writes none of its verdicts on two scripted
    dialogues: a located error at grm.model before the first iteration."""
    recipe = tiny_recipe("wrong-grm", reward={"reviewer": "grm"}, grm={"model": POLICY})
    with pytest.raises(KitchenError) as e:
        cook(recipe, progress=False)
    (p,) = e.value.problems
    assert p.where == "grm.model" and "0% of its verdicts" in p.message


def test_a_run_that_trains_on_nothing_stops_with_a_located_error(runs_dir):
    """Every turn truncated by a 2-token budget and truncated turns left out
    (`reward.truncated = drop`): after `max_untrained_iterations` such iterations the run stops at
    rollout.max_new_tokens, and the metrics it logged say NaN for rates over nothing and 0 step
    samples, never a perfect score."""
    recipe = tiny_recipe(
        "idle",
        rollout={"max_new_tokens": 2, "max_turns": 2},
        train={"iterations": 5, "max_untrained_iterations": 2},
        reward={"truncated": "drop"},
    )
    with pytest.raises(KitchenError) as e:
        cook(recipe, progress=False)
    (p,) = e.value.problems
    assert p.where == "rollout.max_new_tokens" and "iterations 0-1 trained on nothing" in p.message
    import polars as pl

    m = pl.read_parquet(runs_dir / "idle" / "metrics.parquet")
    assert m.height == 2 and m["train/step_samples"].to_list() == [0, 0]
    assert m["rollout/truncated_frac"].to_list() == [1.0, 1.0]
    assert m["reward/local_mean"].is_nan().all() and "loss/total" not in m.columns
    # a one-iteration run that never trained is an error too, even below the limit
    once = tiny_recipe(
        "idle-once", rollout={"max_new_tokens": 2, "max_turns": 2}, reward={"truncated": "drop"}
    )
    with pytest.raises(KitchenError, match="trained on nothing"):
        cook(
            once.model_copy(update={"train": once.train.model_copy(update={"iterations": 1})}),
            progress=False,
        )


def test_metrics_of_an_iteration_without_a_turn_are_nan(concierge):
    """Episodes that ended before their first turn (the context rule): compliance, the local
    reward, the truncated share and the GRM's parse rate are NaN — not the 1.0 the issue saw —
    and 0 step samples were trained on."""
    import math

    from kitchen.buffer import BufferConfig, ReplayBuffer
    from kitchen.judge import judge
    from kitchen.review import Review
    from kitchen.rollout import RolloutStats
    from kitchen.train import Iteration, RewardConfig, episode_rewards, iteration_metrics
    from kitchen.train import step_samples as make_samples

    from .test_evaluate import unplayed

    trajs, pcs = unplayed("train", 2, concierge)
    judged = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    grm = [
        Review(
            trajectory=t.id,
            personal_version=pc.version,
            source="grm",
            turns=0,
            clauses=pc.ids,
            verdicts=[],
        )
        for t, pc in zip(trajs, pcs, strict=True)
    ]
    rewards = episode_rewards(trajs, grm, pcs, RewardConfig())
    cfg = tiny_recipe("m").advantage.resolve()
    samples = make_samples(trajs, rewards, cfg, lambda i: i)
    x = Iteration(
        0, trajs, pcs, RolloutStats(episodes=2), grm, judged, 0.1, rewards, samples, None, {}
    )
    m = iteration_metrics(x, ReplayBuffer(BufferConfig()), grm=True)
    for key in ("judge/compliance", "reward/local_mean", "rollout/truncated_frac", "grm/parsed"):
        assert math.isnan(m[key]), (key, m[key])
    assert m["train/step_samples"] == 0 and m["episode/turns"] == 0.0
    assert not any(k.startswith(("loss/", "adv/", "policy/")) for k in m)


def test_a_diverged_update_stops_before_its_optimiser_step(runs_dir, monkeypatch):
    """A loss that is not finite stops the run at train.lr before the step: the adapter's
    weights are as they were (NaN weights would make every later rollout garbage)."""
    from kitchen import train

    real = train.mapo_loss

    def nan_loss(*a, **k):
        loss, m = real(*a, **k)
        return loss * float("nan"), m | {"loss/total": float("nan")}

    run = Run(tiny_recipe("nan", train={"iterations": 1}), progress=False)
    before = lora_state(run.model)
    monkeypatch.setattr(train, "mapo_loss", nan_loss)
    with pytest.raises(KitchenError) as e:
        run.step()
    (p,) = e.value.problems
    assert p.where == "train.lr" and "diverged" in p.message
    after = lora_state(run.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_truncated_turns_train_with_the_worst_local_reward_or_not_at_all(concierge):
    """`reward.truncated`: 'worst' trains on a turn that ran out of its token budget with the
    lowest local reward (whatever its review said); 'drop' leaves it out of the step samples."""
    from kitchen.jobs import pair_jobs
    from kitchen.judge import judge
    from kitchen.train import RewardConfig, episode_rewards
    from kitchen.train import step_samples as make_samples
    from kitchen.world import World

    task, pc, diner = pair_jobs("train", 1, 0, concierge)[0]
    w = World()
    w.reset(task, pc.dimensions, profile=pc.profile, diner=diner)
    w.step("Hello! Happy to help you today.", tokens=[5, 6], logprobs=[-1.0, -1.0])
    w.step(
        "It is vegetarian. It is vegetarian. It is",
        tokens=[7] * 3,
        logprobs=[-1.0] * 3,
        truncated=True,
    )
    trajs, pcs = [w.traj], [pc]
    reviews = [judge(w.traj, pc)]
    cfg = tiny_recipe("m").advantage.resolve()
    (worst,) = episode_rewards(trajs, reviews, pcs, RewardConfig(reviewer="judge"))
    assert worst.local[1] == -1.0 and worst.valid[1] and worst.contributions[1] == {"truncated": -1}
    assert make_samples(trajs, [worst], cfg, lambda i: i).turn.tolist() == [0, 1]
    assert set(worst.scores[1].values()) == {-1.0} and len(worst.scores[1]) == len(pc.clauses)
    weights = {c.id: c.weight for c in pc.clauses}
    with_clauses = make_samples(trajs, [worst], cfg, lambda i: i, clause_weights=weights)
    assert with_clauses.clauses.shape == (2, len(weights))
    assert with_clauses.clauses[1].tolist() == [-1.0] * len(weights)
    assert with_clauses.clause_weight.tolist() == list(weights.values())
    drop = episode_rewards(trajs, reviews, pcs, RewardConfig(reviewer="judge", truncated="drop"))
    assert drop[0].local[1] != -1.0
    assert make_samples(trajs, drop, cfg, lambda i: i).turn.tolist() == [0]


def test_a_run_with_form_clauses_splits_every_turns_reward_into_form_and_content(runs_dir):
    """`form_clauses`: each stored step sample carries the share of its local reward the form
    clauses gave (their contributions) and the code of its verdicts on them (base 3: 0 n/a,
    1 pass, 2 violate); the update moves the adapter. A clause the constitution lacks is a
    located problem before anything loads."""
    from kitchen.review import clause_scores, turn_rewards

    form = ["T3", "T4", "T6"]
    over = {"beta": 0.02, "state_key": "abstract", "form_clauses": form}
    run = Run(tiny_recipe("form", advantage={"overrides": over}), progress=False)
    before = lora_state(run.model)
    run.step()
    after = lora_state(run.model)
    assert sum((after[k] - before[k]).abs().sum().item() for k in before) > 0
    stored = run.buffer.samples(run.buffer.rows())
    row = {
        (k, t): i for i, (k, t) in enumerate(zip(stored.traj, stored.turn.tolist(), strict=True))
    }
    checked, codes = 0, set()
    for traj, review, pc in zip(
        run.last["trajectories"], run.last["reviews"], run.last["pcs"], strict=True
    ):
        _, valid, contrib = turn_rewards(review, pc)
        for t, scores in enumerate(clause_scores(review, pc)):
            if (traj.id, t) not in row:
                continue
            i = row[traj.id, t]
            share = sum(contrib[t].get(c, 0.0) for c in form) if valid[t] else 0.0
            digits = [{1.0: 1, -1.0: 2}.get(scores.get(c, 0.0), 0) for c in form]
            assert stored.form_reward[i].item() == pytest.approx(share, abs=1e-6)
            assert stored.form_key[i].item() == sum(3**j * d for j, d in enumerate(digits))
            codes.add(stored.form_key[i].item())
            checked += 1
    assert checked >= 8 and len(codes) >= 2
    bad = tiny_recipe("form-bad", advantage={"overrides": over | {"form_clauses": ["T3", "T99"]}})
    problems = file_problems(bad)
    assert len(problems) == 1 and "'T99' is not a clause" in problems[0].message
    assert problems[0].where == "advantage.overrides.form_clauses"


def test_bench_nb05_changes_one_field_and_says_which_is_wrong():
    """benchmarks/bench_nb05.py: `--set key=value` changes a dotted recipe field (values read as
    YAML), the run length and held-out size are set, an α schedule spans the run, and a field the
    recipe lacks or a malformed change is a KitchenError that names it."""
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_nb05")
    recipe = load_recipe(paths.RECIPES / "tiny_mapo.yaml")
    out = bench.changed(recipe, ["train.lr=1e-3", "reward.reviewer=judge"], 5, 12)
    assert out.train.lr == 1e-3 and out.reward.reviewer == "judge"
    assert out.train.iterations == 5 and out.eval.tasks == 12
    assert out.advantage.overrides["alpha"]["steps"] == 5
    assert recipe.train.lr != 1e-3  # the original is untouched
    with pytest.raises(KitchenError, match="no field nope.lr"):
        bench.changed(recipe, ["nope.lr=1"], 5, 12)
    with pytest.raises(KitchenError, match="expected key=value"):
        bench.changed(recipe, ["train.lr"], 5, 12)


def test_bench_nb05_reads_the_episodes_per_task_kind(runs_dir, monkeypatch):
    """`--episodes`: the held-out jobs played by the run's policy, per task kind — turns, how the
    episodes ended, the share fulfilled, actions and violations per episode — and the counts add
    up to the episodes played. `Run.evaluate` reads the same episodes without playing them
    again, and its reading is the one it gives when it plays them itself."""
    import re

    from kitchen import train as train_module
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_nb05")
    recipe = tiny_recipe(
        "nb05-episodes",
        eval={"tasks": 8, "samples": 1, "long_share": 0.5},
        rollout={"long_max_turns": 6},
    )
    run = Run(recipe, progress=False)
    played = held_out_episodes(run.model, run.tok, run.recipe, run.constitution)
    own = run.evaluate()
    plays = []
    monkeypatch.setattr(train_module, "held_out_episodes", lambda *a: plays.append(a))
    given = run.evaluate(played)
    assert plays == []
    drop = ("time/eval_s",)
    assert {k: v for k, v in given.items() if k not in drop} == {
        k: v for k, v in own.items() if k not in drop
    }
    assert "eval/long_compliance" in given and "eval/short_compliance" in given
    text = bench.episodes_reading(*played)
    heads = re.findall(
        r"^    (meals|single dishes) \((\d+)\): ([\d.]+) turns, ended (\{.*\})", text, re.M
    )
    assert [h[0] for h in heads] == ["meals", "single dishes"]
    assert sum(int(h[1]) for h in heads) == 8
    for _, n, turns, ends in heads:
        assert 1 <= float(turns) <= 6 and sum(eval(ends).values()) == int(n)
    assert text.count("actions an episode:") == 2 and "violations an episode:" in text


def test_fast_autocast_is_bfloat16_only_where_the_device_multiplies_it(monkeypatch):
    """`train.autocast: fast` runs the update under bfloat16 autocast on a CPU with AMX and in
    float32 on one without; 'bfloat16' always does, 'none' never."""
    from kitchen import models
    from kitchen import train as train_module

    cpu = torch.device("cpu")
    for amx in (True, False):
        monkeypatch.setattr(models, "cpu_has_bf16_matmul", lambda amx=amx: amx)
        on = []
        for mode in ("none", "bfloat16", "fast"):
            with train_module.update_autocast(mode, cpu):
                on.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        assert on == [False, torch.bfloat16, torch.bfloat16 if amx else False]


def test_blocked_candidates_are_step_samples_at_their_state(concierge):
    """`train.guard: learn`: each candidate the guard blocked follows its episode's turns as a
    sample at the state of the turn it was a candidate for, with the lowest local reward, a
    violation of the axioms it broke and `blocked` set — unless the guard's fallback was played
    at that turn; without `learn` they are not trained on."""
    from kitchen.guard import FALLBACK
    from kitchen.jobs import pair_jobs
    from kitchen.judge import judge
    from kitchen.train import RewardConfig, episode_rewards
    from kitchen.train import step_samples as make_samples
    from kitchen.world import Blocked, World

    task, pc, diner = pair_jobs("train", 1, 0, concierge)[0]
    w = World()
    w.reset(task, pc.dimensions, profile=pc.profile, diner=diner)
    w.step("Hello! Happy to help you today.", tokens=[5, 6], logprobs=[-1.0, -1.0])
    w.traj.blocked.append(
        Blocked(turn=1, attempt=0, tokens=[8, 9, 10], logprobs=[-2.0] * 3, clauses=["A1"])
    )
    w.step("Let me look.", tokens=[7], logprobs=[-1.0])
    w.traj.blocked.append(  # every try blocked, the fallback played: nothing to compare with
        Blocked(turn=2, attempt=2, tokens=[11], logprobs=[-2.0], clauses=["A3"])
    )
    w.step(FALLBACK, guarded=True)
    trajs, pcs, reviews = [w.traj], [pc], [judge(w.traj, pc)]
    cfg = tiny_recipe("m").advantage.resolve()
    weights = {c.id: c.weight for c in pc.clauses}
    reward = RewardConfig(reviewer="judge")
    (learn,) = episode_rewards(trajs, reviews, pcs, reward, blocked=True)
    s = make_samples(trajs, [learn], cfg, lambda i: i, clause_weights=weights)
    assert s.turn.tolist() == [0, 1, 1] and s.blocked.tolist() == [False, False, True]
    assert s.state[2] == s.state[1] == w.traj.turns[1].exact_key
    assert s.abstract[2] == w.traj.turns[1].abstract_key and s.actions()[2] == [8, 9, 10]
    assert s.local_reward[2] == learn.blocked == -1.0 and s.ret[2] == -1.0 and s.valid[2]
    verdicts = dict(zip(weights, s.clauses[2].tolist(), strict=True))
    assert verdicts["A1"] == -1.0 and all(math.isnan(v) for c, v in verdicts.items() if c != "A1")
    (drop,) = episode_rewards(trajs, reviews, pcs, reward)
    plain = make_samples(trajs, [drop], cfg, lambda i: i)
    assert drop.blocked is None and plain.turn.tolist() == [0, 1] and plain.blocked is None


def test_clip_reads_the_collection_log_probs_on_later_passes(runs_dir, monkeypatch):
    """`advantage.clip` with three passes over a batch: the first pass starts where the samples
    were drawn (ratio 1, nothing clipped), later passes find tokens already moved past ε."""
    from kitchen import train

    over = {"beta": 0.02, "state_key": "abstract", "clip": 0.05}
    recipe = tiny_recipe(
        "clip",
        advantage={"preset": "mapo", "overrides": over},
        train={"iterations": 1, "epochs": 3, "minibatch": 10_000, "lr": 3e-2},
    )
    seen = []
    real = train.mapo_loss

    def spy(*args, **kw):
        loss, m = real(*args, **kw)
        seen.append(m["clip/frac"])
        return loss, m

    run = Run(recipe, progress=False)
    monkeypatch.setattr(train, "mapo_loss", spy)
    m = run.step()
    assert len(seen) == 3 and seen[0] == 0.0 and seen[-1] > 0.0
    assert m["clip/frac"] == pytest.approx(sum(seen) / 3)


def test_guard_share_and_budget_reach_the_training_rollouts(runs_dir):
    """`guard_share: 0.5` puts the first half of each job's K rollouts behind the guard and the
    rest not; at `guard_budget: 0` every blocked candidate is followed by the fallback, so none
    of them stands beside a played try of the policy's and none is trained on."""
    recipe = tiny_recipe(
        "guard-share",
        train={
            "iterations": 1,
            "guard": "learn",
            "guard_share": 0.5,
            "guard_budget": 0,
            "tasks_per_iteration": 4,  # enough episodes that the shipped policy breaks a line
        },
    )
    run = Run(recipe, progress=False)
    m = run.step()
    k, trajs = recipe.rollout.k, run.last["trajectories"]
    behind = [t for i, t in enumerate(trajs) if i % k < k // 2]
    free = [t for i, t in enumerate(trajs) if i % k >= k // 2]
    assert free and not any(t.blocked for t in free)
    assert sum(len(t.blocked) for t in behind) == m["guard/blocked"] > 0
    assert all(b.attempt == 0 for t in behind for b in t.blocked)
    assert sum(ti.guarded for t in behind for ti in t.turns) == m["guard/blocked"]
    assert m["train/blocked_samples"] == 0


def test_training_behind_the_guard_lowers_what_it_blocked(runs_dir):
    """`train.guard: learn` on the shipped policy: the rollout plays behind the axiom guard, the
    candidates it blocked within its budget enter the update with a negative advantage, and after
    one update the policy gives them less probability at the states where it wrote them."""
    recipe = tiny_recipe(
        "guard", train={"iterations": 1, "guard": "learn", "tasks_per_iteration": 4}
    )
    run = Run(recipe, progress=False)
    before = lora_state(run.model)
    m = run.step()
    # a candidate blocked past the guard's budget is followed by the fallback, not trained on
    assert 0 < m["train/blocked_samples"] <= m["guard/blocked"]
    assert m["judge/axiom_violations"] == 0  # what the diner saw kept every red line
    trajs = run.last["trajectories"]
    adv = torch.tensor([a for _, a in run.last["blocked_advantages"]])
    assert len(adv) == m["train/blocked_samples"] and adv.mean() < 0

    def blocked_logprobs() -> torch.Tensor:
        out = []
        for t in trajs:
            for b in t.blocked:
                prompt = render_prompt(run.tok, t.prompt_messages(b.turn))
                packed, mask = scored_alone(run.tok, run.model.eval(), prompt, b.tokens)
                out.append((packed.sum() / mask.sum()).item())
        return torch.tensor(out)

    new = blocked_logprobs()
    restore(run.model, before)
    old = blocked_logprobs()
    assert (new - old).mean() < 0, (new - old).mean()
