"""GRM training data, the GRM recipe and `kitchen grm train`, and the calibration report."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from kitchen import paths
from kitchen.calibrate import (
    GRMRecipe,
    agreement,
    calibration_set,
    grm_calibrate_main,
    grm_train_main,
    load_grm_recipe,
    read_labelled,
    scripted_mix,
    write_grm_data,
)
from kitchen.config import KitchenError
from kitchen.files import read_jsonl
from kitchen.grm import parse_review
from kitchen.judge import judge
from kitchen.models import ModelSpec, load_model

from .test_models import MICRO

SHIPPED = paths.RECIPES / "grm_tiny.yaml"


def _window(prompt: str) -> tuple[int, int]:
    first, last = re.search(r"review turns t(\d+)-t(\d+)$", prompt).groups()
    return int(first), int(last)


def test_shipped_grm_recipe_is_valid_and_fits_the_context():
    """recipes/grm_tiny.yaml validates; prompt + review budgets fit the tiny model's context;
    the SFT recipe it builds reads the data it writes."""
    recipe = load_grm_recipe(SHIPPED)
    tiny = recipe.sft.model.tiny
    assert recipe.review.max_prompt_tokens + recipe.review.max_new_tokens <= tiny.max_positions
    assert recipe.sft.max_length <= tiny.max_positions
    sft = recipe.sft_recipe(paths.RUNS / "x")
    assert sft.data.train.endswith("x/data/train.jsonl") and sft.output_dir.endswith("x")
    assert recipe.install == "data/models/grm-tiny"
    more = load_grm_recipe(paths.RECIPES / "grm_tiny_more.yaml")
    assert more.data.reuse == "runs/grm_tiny" and more.sft.model.base.path == "runs/grm_tiny/final"
    assert more.review == recipe.review  # the second stage reviews as the first was trained


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"sft": {"data": {"train": "a.jsonl"}}}, "filled in by the GRM recipe"),
        ({"review": {"max_prompt_tokens": 2000}}, "exceeds sft.model.tiny.max_positions"),
        ({"data": {"mix": {"grm": 1, "sloppy": 1}}}, "unknown agent 'sloppy'"),
        ({"data": {"policy_samples": 10, "policy": None}}, "needs `policy:`"),
    ],
)
def test_bad_grm_recipes_say_what_to_fix(tmp_path, change, needle):
    doc = yaml.safe_load(SHIPPED.read_text())
    for key, sub in change.items():
        for k, v in sub.items():
            if isinstance(v, dict) and isinstance(doc[key].get(k), dict):
                doc[key][k] = doc[key][k] | v
            else:
                doc[key][k] = v
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(KitchenError) as e:
        load_grm_recipe(bad)
    assert needle in str(e.value) and str(bad) in str(e.value)


def test_grm_data_targets_are_the_judges_verdicts_for_the_prompted_turns(tmp_path):
    """Every training row — plain, or rendered as a truncation window — asks for turns
    first..last, and its target review parses back to the judge's verdicts for exactly those
    turns; the mix follows its shares; held-out trajectories are kept for agreement."""
    mix = {"grm": 0.5, "sft": 0.25, "ideal": 0.25}
    stats = write_grm_data(tmp_path, n_train=40, n_eval=8, seed=3, mix=mix, augment=0.5)
    assert stats["train"]["sources"] == {"grm": 20, "sft": 10, "ideal": 10, "policy": 0}
    train = list(read_jsonl(tmp_path / "train.jsonl"))
    assert len(train) == 40
    pairs = {t.id: (t, pc) for t, pc, _ in scripted_mix(40, "train", 3, mix)}
    windows = 0
    for row in train:
        traj, pc = pairs[row["trajectory"]]
        first, last = _window(row["messages"][1]["content"])
        windows += (first, last) != (0, len(traj.turns) - 1)
        got = parse_review(
            row["messages"][2]["content"], turns=range(first, last + 1), clauses=pc.ids
        )
        want = [
            (v.turn, v.clause, v.verdict)
            for v in judge(traj, pc).verdicts
            if first <= v.turn <= last
        ]
        assert [(v.turn, v.clause, v.verdict) for v in got.verdicts] == want
    assert windows > 0  # augment=0.5 rendered some rows as windows
    held = read_labelled(tmp_path / "eval_trajectories.jsonl")
    assert len(held) == 8 and all(t.id.startswith("heldout") for t, _ in held)


def test_calibration_set_is_heldout_and_shared_by_source():
    triples = calibration_set(9, seed=5, policy=None)
    assert len(triples) == 9 and {s for _, _, s in triples} == {"grm", "sft"}
    assert all(t.task.id.startswith("heldout") for t, _, _ in triples)


def test_grm_train_main_end_to_end(tmp_path, monkeypatch):
    """A micro GRM recipe: data, SFT, held-out agreement and the float16 install all happen; a
    second fresh run into the same folder is refused."""
    monkeypatch.setenv("KITCHEN_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "install": str(tmp_path / "installed"),
        "data": {"n_train": 24, "n_eval": 4, "labels": None, "augment": 0.2},
        "review": {"max_prompt_tokens": 900, "max_new_tokens": 24},
        "sft": {
            "model": {
                "tiny": MICRO.model_dump() | {"max_positions": 1024},
                "tokenizer": {"vocab_size": 512},
            },
            "max_steps": 4,
            "batch_size": 4,
            "max_length": 1024,
            "eval_every": 4,
            "save_every": 4,
        },
    }
    GRMRecipe.model_validate(recipe)
    path = tmp_path / "grm.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert grm_train_main(path) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["train"]["examples"] == 24
    assert summary["heldout_agreement"]["reviews"] == 4
    assert len(summary["eval_loss"]) == 2 and summary["timings"]["train_s"] > 0
    model, tok = load_model(ModelSpec(path=str(tmp_path / "installed"), device="cpu"))
    assert tok.chat_template and model.config.max_position_embeddings == 1024
    with pytest.raises(KitchenError, match="already holds a trained GRM"):
        grm_train_main(path)
    # a second stage: the same review data (data.reuse), training on from the first's weights
    more = recipe | {"output_dir": str(tmp_path / "more"), "install": None}
    more["data"] = {"reuse": str(tmp_path / "run")}
    more["sft"] = recipe["sft"] | {"model": {"base": {"path": str(tmp_path / "run" / "final")}}}
    more["sft"]["max_steps"] = 2
    path.write_text(yaml.safe_dump(more))
    assert grm_train_main(path) == 0
    again = json.loads((tmp_path / "more" / "summary.json").read_text())
    assert again["data"] == summary["data"] and (tmp_path / "more" / "final").is_dir()


def test_calibrate_with_the_shipped_grm_writes_every_number(tmp_path, capsys):
    """`kitchen grm calibrate` on a few held-out dialogues: the table, the voting comparison,
    per-source numbers and the human section (from a labels folder) all come out, in [0, 1]."""
    from kitchen.calibrate import HumanLabel, save_label

    labels = tmp_path / "labels"
    traj, pc, _ = calibration_set(3, seed=8, policy=None)[0]
    ref = judge(traj, pc)
    v = next(v for v in ref.verdicts if v.verdict in ("pass", "violate"))
    save_label(
        labels,
        HumanLabel(
            trajectory=traj.id, turn=v.turn, clause=v.clause, verdict=v.verdict, annotator="test"
        ),
        traj,
        pc,
    )
    out = tmp_path / "cal.json"
    assert grm_calibrate_main(n=4, votes=2, labels=str(labels), out=str(out), policy=None) == 0
    text = capsys.readouterr().out
    assert "parse failures" in text and "vote of 2" in text and "confusion" in text
    rep = json.loads(out.read_text())
    judge_rep = rep["judge"]
    assert judge_rep["reviews"] == 4 and set(judge_rep["by_source"]) == {"grm", "sft"}
    for key, value in judge_rep["voting"].items():
        assert 0.0 <= value <= 1.0, key
    assert rep["human"]["cells"] == 1 and rep["judge_vs_human"]["accuracy"] == 1.0


def test_agreement_counts_masked_cells_as_disagreement():
    ((traj, pc, _),) = calibration_set(1, seed=2, policy=None)
    ref = judge(traj, pc)
    masked = ref.model_copy(
        update={
            "verdicts": [v.model_copy(update={"verdict": None}) for v in ref.verdicts],
            "parsed_fraction": 0.0,
        }
    )
    rep = agreement([masked], [ref])
    assert rep.accuracy == 0.0 and rep.masked_rate == 1.0 and rep.parse_failure_rate == 1.0
