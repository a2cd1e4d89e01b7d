"""The main job (`kitchen demo`): MAPO and its one-factor GRPO arm, evaluated and reported."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml

from kitchen import demo, mapo, paths
from kitchen.config import KitchenError
from kitchen.files import read_jsonl
from kitchen.train import Recipe, load_recipe


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run folders (the parent's and the `kitchen cook` subprocesses') under tmp_path."""
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    monkeypatch.setenv("KITCHEN_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def small_recipe(tmp_path) -> str:
    """tiny_mapo.yaml in a small shape (the rule judge reviewing, two short iterations, a mixed
    held-out set so both task kinds are reported)."""
    doc = yaml.safe_load((paths.RECIPES / "tiny_mapo.yaml").read_text())
    doc |= {
        "reward": {"reviewer": "judge"},
        "rollout": {"k": 2, "max_turns": 3, "long_max_turns": 4, "max_new_tokens": 24,
                    "batch_size": 8},
        "train": doc["train"] | {"iterations": 2, "tasks_per_iteration": 1, "task_pool": 8},
        "eval": {"tasks": 2, "samples": 1, "long_share": 0.5},
        "eval_every": 1,
        "checkpoint_every": 1,
    }  # fmt: skip
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_two_runs_differ_in_the_advantage_estimator_only():
    """demo-grpo is tiny_mapo.yaml's compare arm: GRPO's advantage (no local term, no buffer)
    over MAPO's state key and loss; `iterations` shortens both runs and MAPO's α schedule."""
    docs = demo.arms(iterations=7)
    m, g = docs["demo-mapo"], docs["demo-grpo"]
    assert {k for k in m if m[k] != g[k]} == {"name", "advantage"}
    rm, rg = Recipe.model_validate(m), Recipe.model_validate(g)
    assert rm.grm_reviews and not rg.grm_reviews  # GRPO reads no review: the GRM is not run
    am, ag = rm.advantage.resolve(), rg.advantage.resolve()
    assert ag.model_dump() == mapo.one_factor(mapo.PRESETS["grpo"], am).model_dump()
    assert am.alpha.steps == 7 and rm.train.iterations == rg.train.iterations == 7
    assert rm.keep_checkpoints == rg.keep_checkpoints == [3]  # half the budget, for efficiency
    assert ag.loss_agg == am.loss_agg == "token-mean" and not ag.use_buffer


def test_more_seeds_are_more_pairs_with_shifted_seeds():
    docs = demo.arms(iterations=3, seeds=[0, 2], prefix="demo-seeds")
    assert set(docs) == {"demo-seeds-mapo-s0", "demo-seeds-grpo-s0", "demo-seeds-mapo-s2",
                         "demo-seeds-grpo-s2"}  # fmt: skip
    base = load_recipe(paths.RECIPES / "tiny_mapo.yaml").seed
    assert docs["demo-seeds-mapo-s2"]["seed"] == docs["demo-seeds-grpo-s2"]["seed"] == base + 2


def test_efficiency_is_mapos_episodes_to_grpos_final_level():
    grpo = pl.DataFrame({"episodes": [0, 100, 200, 300], "value": [0.80, 0.83, 0.85, 0.86]})
    mapo_ = pl.DataFrame({"episodes": [0, 100, 200, 300], "value": [0.80, 0.87, 0.88, 0.90]})
    e = demo.efficiency(mapo_, grpo)
    assert e["target"] == pytest.approx(0.86) and e["grpo_episodes"] == 300
    assert e["mapo_episodes"] == 100 and e["ratio"] == pytest.approx(1 / 3)
    never = demo.efficiency(grpo, mapo_)  # the other way round: GRPO never gets to 0.90
    assert never["mapo_episodes"] is None and never["ratio"] is None
    flat = pl.DataFrame({"episodes": [0, 100, 200], "value": [0.84, 0.86, 0.82]})
    e = demo.efficiency(mapo_, flat)  # GRPO ended below its start: nothing to race to
    assert e["improved"] is False and e["ratio"] is None and e["mapo_episodes"] == 100
    assert "no higher than it started" in demo.efficiency_text({0: e}, None, "long")
    assert demo._median([0.3, None, 0.5]) == 0.5 and demo._median([None]) is None


def test_run_state_reuses_only_a_run_of_the_same_recipe(tmp_path):
    """A folder is 'new' without a checkpoint or when its recipe differs from today's (an older
    demo), 'partial' before the last iteration, 'done' after it."""
    doc = demo.arms(iterations=3)["demo-mapo"]
    folder = tmp_path / "demo-mapo"
    assert demo._state(folder, doc) == "new"
    ck = folder / "checkpoints" / "it-0002"
    ck.mkdir(parents=True)
    torch.save({}, ck / "state.pt")
    (folder / "checkpoints" / "latest").write_text("it-0002\n")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(doc))
    assert demo._state(folder, doc) == "partial"
    assert demo._state(folder, doc | {"train": doc["train"] | {"iterations": 2}}) == "new"
    (folder / "checkpoints" / "latest").write_text("it-0003\n")
    (folder / "checkpoints" / "it-0002").rename(folder / "checkpoints" / "it-0003")
    assert demo._state(folder, doc) == "done"


def test_a_retrained_model_under_the_same_path_makes_old_runs_stale(tmp_path):
    """`models_digest` fingerprints the weights of the policy and GRM a recipe names, so a run
    trained before a new GRM was installed under the same path is not reused."""
    doc = demo.arms(iterations=1)["demo-mapo"]
    grm = tmp_path / "grm"
    grm.mkdir()
    (grm / "model.safetensors").write_bytes(b"first weights")
    doc["grm"]["model"] = str(grm)
    before = demo.models_digest(doc)
    assert set(before) == {doc["policy"]["path"], str(grm)}
    assert demo.models_digest(doc) == before
    (grm / "model.safetensors").write_bytes(b"retrained weights")
    after = demo.models_digest(doc)
    assert after[str(grm)] != before[str(grm)]
    assert after[doc["policy"]["path"]] == before[doc["policy"]["path"]]


def test_a_failed_training_run_is_reported_with_its_log(tmp_path, runs_dir):
    doc = demo.arms(iterations=1)["demo-grpo"]
    doc["policy"]["path"] = str(tmp_path / "no-such-model")
    (tmp_path / "out").mkdir()
    with pytest.raises(KitchenError, match=r"training run demo-grpo failed .*demo-grpo.log"):
        demo.cook_side_by_side({"demo-grpo": doc}, tmp_path / "out", progress=False)


def test_main_job_end_to_end_in_a_small_shape(tmp_path, runs_dir, monkeypatch):
    """Both runs train, are evaluated against the SFT policy — the recipe's own, here a copy of
    the shipped one — on held-out single dishes and meals, and the report, results and table
    say what each run's advantage computes."""
    import shutil

    sft = tmp_path / "my-sft"
    shutil.copytree(paths.DATA / "models" / "policy-tiny", sft)
    recipe = Path(small_recipe(tmp_path))
    recipe.write_text(recipe.read_text().replace("data/models/policy-tiny", str(sft)))
    played, kept = {}, set()
    real = demo.held_out

    def spy(policies, *args, **kwargs):
        played.update(policies)
        kept.update(f.stem for f in (runs_dir / "demo" / "held_out").glob("*.json"))
        return real(policies, *args, **kwargs)

    monkeypatch.setattr(demo, "held_out", spy)
    results = demo.main_job(
        iterations=2, eval_tasks=6, eval_samples=1, progress=False, recipe=recipe
    )
    assert Path(played["sft"]) == sft  # the baseline is the recipe's policy
    # every policy was played in a slot training left free, before the evaluation began
    assert kept == set(played) == {"sft", "demo-mapo", "demo-grpo", "demo-mapo-half"}
    saved = json.loads((runs_dir / "demo" / "results.json").read_text())
    assert saved["sft_policy"] == str(sft)
    assert set(saved["held_out"]) == {"sft", "demo-mapo", "demo-grpo", "demo-mapo-half"}
    # MAPO at half its budget (iteration 1 of 2, a kept checkpoint), played without the guard
    assert (runs_dir / "demo-mapo" / "checkpoints" / "it-0001" / "state.pt").exists()
    assert "guarded" not in results["held_out"]["demo-mapo-half"]["long"]
    for kind in ("long", "short"):
        h = results["half_budget"][kind][0]
        assert (h["mapo_episodes"], h["grpo_episodes"]) == (2, 4)
        lo_hi = h["difference"]
        assert lo_hi[1] <= lo_hi[0] <= lo_hi[2]
        assert h["grpo_final"] == results["held_out"]["demo-grpo"][kind]["compliance"]
    for name in ("demo-mapo", "demo-grpo"):
        for kind in ("long", "short"):
            r = results["held_out"][name][kind]
            w = r["win_rate_vs_sft"]
            assert 0.0 <= w[1] <= w[0] <= w[2] <= 1.0
            assert r["guarded"]["axiom_violations"] <= r["axiom_violations"]
            assert {g["clause"] for g in r["groups"]} == {"T3", "T4", "T6"}
        assert pl.read_parquet(runs_dir / name / "metrics.parquet").height == 2
        # the held-out curve starts at the SFT policy (iteration 0), then every eval_every
        assert [r["iteration"] for r in read_jsonl(runs_dir / name / "eval.jsonl")] == [0, 1, 2]
    a, b = (
        load_recipe(runs_dir / n / "recipe.yaml").model_dump() for n in ("demo-mapo", "demo-grpo")
    )
    assert {k for k in a if a[k] != b[k]} == {"name", "advantage"}
    assert "A_local  not used" in results["advantage"]["grpo"]
    assert "replay buffer" in results["advantage"]["mapo"]
    assert set(results["sample_efficiency"]["long"]) == {0}
    html = (runs_dir / "demo" / "report.html").read_text()
    assert "differ in the advantage estimator alone" in html and html.count("<svg") > 10
    assert saved["arithmetic"] == demo.arithmetic(load_recipe(recipe))
    assert f"GRM review in {saved['arithmetic']['review']}" in html
    assert "Side by side" in html and "— sft —" in html
    assert html.count("clause verdicts of this run are the rule judge") == 2  # judge-reviewed
    assert "mapo: win rate vs SFT" in demo.summary(results)
    table = (runs_dir / "demo" / "table.md").read_text()
    assert "**long tasks**" in table and "T3 pass, verbosity=brief" in table
    assert (
        "MAPO after 2 episodes (its run's checkpoint, mid-schedule) against GRPO after 4" in table
    )
    assert "with half the episodes" in demo.summary(results)
    assert "| win rate vs SFT | — |" in table  # the SFT policy is not compared with itself
    # the headline win rate counts every held-out episode (6 tasks: both kinds)
    assert set(results["all_vs_sft"]) == {"demo-mapo", "demo-grpo"}
    assert "**all held-out episodes**" in table and "all held-out episodes — mapo" in demo.summary(
        results
    )


def test_numbers_over_nothing_read_no_data():
    """A held-out compliance or win rate over nothing (NaN) reads "no data" in the summary and
    the table, and an efficiency with no curve has no ratio."""
    nan = float("nan")
    group = {"group": "verbosity=brief", "clause": "T3", "pass": nan}
    run = {
        "episodes": 0,
        "win_rate_vs_sft": (nan, nan, nan),
        "success": nan,
        "compliance": nan,
        "axiom_violations": 0,
        "guarded": {"axiom_violations": 0},
        "groups": [group],
    }
    sft = {"episodes": 0, "success": nan, "compliance": nan, "axiom_violations": 0,
           "groups": [group]}  # fmt: skip
    results = {
        "seeds": [0],
        "eval": {"tasks": 0, "samples": 1},
        "held_out": {"sft": {"long": sft}, "demo-mapo": {"long": run}, "demo-grpo": {"long": run}},
        "mapo_vs_grpo": {0: (nan, nan, nan)},
        "all_vs_sft": {"demo-mapo": (nan, nan, nan), "demo-grpo": (nan, nan, nan)},
        "sample_efficiency": {"long": {0: demo.efficiency(pl.DataFrame(), pl.DataFrame())},
                              "short": {}},
        "median_ratio": {"long": None, "short": None},
        "seconds": 60.0,
    }  # fmt: skip
    text = demo.summary(results)
    assert "nan" not in text.lower() and text.count("no data") >= 5
    table = demo.seeds_table(results, "demo")
    assert "nan" not in table.lower() and "no data" in table


def test_held_out_episodes_are_kept_and_replayed_only_when_their_key_changes(tmp_path, monkeypatch):
    """An interrupted multi-seed evaluation resumes: a policy whose weights and settings are
    unchanged is read back from the cache, not played again; other settings or other weights
    under the same path play again."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kitchen.evaluate import EvalConfig

    model = tmp_path / "policy"
    shutil.copytree(paths.DATA / "models" / "policy-tiny", model)
    sft = {"sft": model}
    cfg = EvalConfig(tasks=2, samples=1, long_share=0.5, bootstrap=100)
    first, eps = demo.held_out(sft, cfg, progress=False, parallel=1, cache=tmp_path / "kept")
    assert (tmp_path / "kept" / "sft.json").exists()
    # another whole model (a cold start, not a run) plays as an arm: the same weights, the same
    # seeded episodes, every judged score tied
    arms, _ = demo.held_out({**sft, "copy": model}, cfg, progress=False, parallel=1)
    assert {kind: arms["copy"][kind]["win_rate_vs_sft"][0] for kind in arms["copy"]} == {
        kind: 0.5 for kind in first["sft"]
    }

    def no_play(*a, **k):
        raise AssertionError("played again")

    monkeypatch.setattr(demo, "evaluate", no_play)
    again, eps2 = demo.held_out(sft, cfg, progress=False, parallel=1, cache=tmp_path / "kept")
    assert again == first and eps2 == eps
    with pytest.raises(AssertionError, match="played again"):  # other settings
        demo.held_out(sft, cfg.model_copy(update={"seed": 1}), False, 1, tmp_path / "kept")
    weights = next(model.glob("*.safetensors"))
    state = load_file(weights)
    name = next(iter(state))
    state[name] = state[name] + 0.01
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="played again"):  # other weights, same path
        demo.held_out(sft, cfg, False, 1, tmp_path / "kept")


def test_a_saved_adapter_plays_as_an_arm_and_its_weights_key_its_episodes(tmp_path, monkeypatch):
    """A saved adapter (data/models/mapo-tiny: base + LoRA, not a run folder) plays the held-out
    jobs as an arm, as `bench_arms.py mapo=data/models/mapo-tiny` asks; its episodes are keyed
    by its weights, so a changed adapter under the same path plays again."""
    import shutil

    from kitchen.evaluate import EvalConfig

    adapter = tmp_path / "mapo-tiny"
    shutil.copytree(paths.DATA / "models" / "mapo-tiny", adapter)
    cfg = EvalConfig(tasks=1, samples=1, long_share=0.0, bootstrap=100)
    assert demo._full_model("rl", adapter) and not demo._full_model("rl", tmp_path)
    key, played = demo._played_key("rl", adapter, cfg)
    results, eps = demo.held_out(
        {"sft": paths.DATA / "models" / "policy-tiny", "rl": adapter}, cfg, False, 1
    )
    assert played == 1 and len(eps["rl"]["policy"]) == 1 and "rl" in results
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    changed = demo._played_key("rl", adapter, cfg)[0]
    assert changed != key
    # the same adapter on another base (a re-trained SFT policy) plays again too
    base = tmp_path / "policy-tiny"
    shutil.copytree(paths.DATA / "models" / "policy-tiny", base)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    on_copy = demo._played_key("rl", adapter, cfg)[0]
    base_weights = next(base.glob("*.safetensors"))
    base_weights.write_bytes(base_weights.read_bytes() + b" ")
    assert demo._played_key("rl", adapter, cfg)[0] != on_copy
    # guarded episodes depend on the judge's rules (the guard asks it), unguarded ones do not
    plain, guarded = (demo._played_key("rl", adapter, cfg, g)[0] for g in (False, True))
    monkeypatch.setattr(demo, "RULES_VERSION", demo.RULES_VERSION + 1)
    assert demo._played_key("rl", adapter, cfg, guard=True)[0] != guarded
    assert demo._played_key("rl", adapter, cfg)[0] == plain


def test_the_shipped_mapo_adapter_is_the_main_jobs_run_and_moves_the_policy():
    """data/models/mapo-tiny (notebook 06's RL policy) was trained by today's main-job recipe, and
    it changes the SFT policy's next-token distribution. A change to recipes/tiny_mapo.yaml fails
    this test on purpose until the adapter is re-trained (`make demo`) and re-shipped."""
    from kitchen.models import ModelSpec, load_adapter, load_model

    folder = paths.DATA / "models" / "mapo-tiny"
    shipped = load_recipe(folder / "recipe.yaml").model_dump()
    assert shipped == Recipe.model_validate(demo.arms()["demo-mapo"]).model_dump()
    base, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    ids = torch.tensor([tok.encode("I'd like a meal of thai food")])
    with torch.no_grad():
        before = base(ids).logits
        policy = load_adapter(base, folder, "policy", trainable=False).eval()
        after = policy(ids).logits
    assert (after - before).abs().max() > 1e-2


def test_half_runs_are_mapo_on_half_the_budget_with_their_own_schedules():
    """`arms(half_runs=True)` adds, per seed, MAPO trained on half the iterations: the same
    recipe, its α schedule ending with it, no kept checkpoint of its own."""
    docs = demo.arms(iterations=8, seeds=[0, 1], prefix="demo-seeds", half_runs=True)
    assert set(docs) == {f"demo-seeds-{m}-s{s}" for m in ("mapo", "grpo") for s in (0, 1)} | {
        f"demo-seeds-mapo-s{s}-half-run" for s in (0, 1)
    }
    full, half = docs["demo-seeds-mapo-s1"], docs["demo-seeds-mapo-s1-half-run"]
    assert half["train"]["iterations"] == 4 and full["train"]["iterations"] == 8
    assert half["advantage"]["overrides"]["alpha"]["steps"] == 4
    assert half["keep_checkpoints"] == [] and half["seed"] == full["seed"]
    same = {k for k in full if full[k] == half[k]}
    assert set(full) - same == {"name", "train", "advantage", "keep_checkpoints"}
    assert {k for k in full["train"] if full["train"][k] != half["train"][k]} == {"iterations"}
    assert set(demo.arms(iterations=8)) == {"demo-mapo", "demo-grpo"}  # off by default


def test_main_job_measures_sample_efficiency_with_half_runs(tmp_path, runs_dir):
    """With `half_runs`, MAPO at half its budget is a run of its own (played unguarded, no
    curve of its own, not in the headline win rates) and the table says so."""
    results = demo.main_job(
        iterations=2,
        eval_tasks=6,
        eval_samples=1,
        progress=False,
        recipe=small_recipe(tmp_path),
        half_runs=True,
    )
    assert (runs_dir / "demo-mapo-half-run" / "checkpoints").is_dir()
    assert pl.read_parquet(runs_dir / "demo-mapo-half-run" / "metrics.parquet").height == 1
    assert set(results["held_out"]) == {"sft", "demo-mapo", "demo-grpo", "demo-mapo-half"}
    assert "guarded" not in results["held_out"]["demo-mapo-half"]["long"]
    assert set(results["all_vs_sft"]) == {"demo-mapo", "demo-grpo"}
    for kind in ("long", "short"):
        h = results["half_budget"][kind][0]
        assert h["mapo_half_from"] == "run" and (h["mapo_episodes"], h["grpo_episodes"]) == (2, 4)
    table = (runs_dir / "demo" / "table.md").read_text()
    assert "MAPO after 2 episodes (a run of its own) against GRPO after 4" in table


def test_kept_settings_reads_what_the_episodes_were_played_with(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(
        json.dumps({"eval": {"tasks": 7, "samples": 3, "long_share": 0.25}, "other": 1})
    )
    cfg = demo.kept_settings(tmp_path)
    assert (cfg.tasks, cfg.samples, cfg.long_share) == (7, 3, 0.25)
    with pytest.raises(KitchenError, match=r"empty.*results\.json.*no evaluation settings"):
        demo.kept_settings(tmp_path / "empty")
    (tmp_path / "results.json").write_text(json.dumps({"policies": {}}))  # no "eval" key
    with pytest.raises(KitchenError, match="no evaluation settings"):
        demo.kept_settings(tmp_path)


def test_the_job_says_when_fast_settings_fall_back_to_float32(monkeypatch):
    """`fast` review and update are bfloat16 on a CPU with AMX and float32 on one without, which
    the job tells the user (it takes longer) and records; settings that ask for no bfloat16 get
    no note."""
    import kitchen.models as models

    recipe = load_recipe(paths.RECIPES / "tiny_mapo.yaml")
    assert (recipe.grm.dtype, recipe.train.autocast) == ("fast", "fast")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "cpu_has_bf16_matmul", lambda: False)
    arith = demo.arithmetic(recipe)
    assert arith == {"device": "cpu", "review": "float32", "update": "float32"}
    assert "float32" in demo.precision_note(recipe, arith)
    plain = recipe.model_copy(
        update={
            "grm": recipe.grm.model_copy(update={"dtype": "float32"}),
            "train": recipe.train.model_copy(update={"autocast": "none"}),
        }
    )
    assert demo.precision_note(plain, demo.arithmetic(plain)) is None
    monkeypatch.setattr(models, "cpu_has_bf16_matmul", lambda: True)
    arith = demo.arithmetic(recipe)
    assert arith == {"device": "cpu", "review": "bfloat16", "update": "bfloat16 autocast"}
    assert demo.precision_note(recipe, arith) is None
