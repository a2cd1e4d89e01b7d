"""The GRM recipe and `kitchen grm train`, and the calibration report (kitchen.calibrate)."""

from __future__ import annotations

import json
import math
from itertools import pairwise

import pytest
import yaml

from kitchen import paths
from kitchen.calibrate import (
    GRMRecipe,
    agreement,
    calibration_set,
    cohen_kappa,
    grm_calibrate_main,
    grm_train_main,
    load_grm_recipe,
    perturbation_report,
    targets,
    violations_by_turn,
)
from kitchen.config import KitchenError
from kitchen.critique import parse_review
from kitchen.grmdata import HumanLabel, save_label
from kitchen.injection import attacks, flags
from kitchen.judge import judge
from kitchen.models import ModelSpec, load_model

from .test_models import MICRO

SHIPPED = paths.RECIPES / "grm_tiny.yaml"


def test_shipped_grm_recipe_is_valid_and_fits_the_context():
    """recipes/grm_tiny.yaml validates; the review budget fits the tiny model's context; the SFT
    recipe it builds reads the data it writes."""
    recipe = load_grm_recipe(SHIPPED)
    tiny = recipe.sft.model.tiny
    assert recipe.review.max_context_tokens <= tiny.max_positions
    assert recipe.sft.max_length <= tiny.max_positions
    sft = recipe.sft_recipe(paths.RUNS / "x")
    assert sft.data.train.endswith("x/data/train.jsonl") and sft.output_dir.endswith("x")
    # stages 1-7, each continuing the one before on new dialogues
    names = ["grm_tiny", "grm_tiny_diners", "grm_tiny_cards", "grm_tiny_lines", "grm_tiny_recall"]
    names += ["grm_tiny_limits", "grm_tiny_orders"]
    stages = [load_grm_recipe(paths.RECIPES / f"{n}.yaml") for n in names]
    for before, after in pairwise(stages):
        assert after.sft.model.base.path == f"runs/{before.output_dir}/final"
        assert after.data.variants > 0
    # stage 8 (shorter lines: ids as tokens, no length) continues stage 7, then trains on
    short = load_grm_recipe(paths.RECIPES / "grm_tiny_short.yaml")
    assert short.sft.model.base.path == f"runs/{stages[-1].output_dir}/final"
    assert not short.data.line_length and short.sft.model.add_tokens
    more = load_grm_recipe(paths.RECIPES / "grm_tiny_short_more.yaml")
    assert more.sft.model.base.path == f"runs/{short.output_dir}/final"
    assert not more.data.line_length and not more.sft.model.add_tokens  # stage 8 added them
    # stage 9 weighs the refused-dish near miss more, and installs the shipped GRM
    refused = load_grm_recipe(paths.RECIPES / "grm_tiny_refused.yaml")
    assert refused.sft.model.base.path == f"runs/{more.output_dir}/final"
    assert refused.data.refused_again > more.data.refused_again and not refused.data.line_length
    chain = [*stages, short, more, refused]
    assert [s.install for s in chain] == [None] * 9 + ["data/models/grm-tiny"]
    assert all(s.review == stages[0].review for s in chain)  # one review budget throughout
    assert len({s.data.seed for s in chain}) == len(chain)  # new dialogues at every stage


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"sft": {"data": {"train": "a.jsonl"}}}, "filled in by the GRM recipe"),
        ({"review": {"max_context_tokens": 9000}}, "exceeds sft.model.tiny.max_positions"),
        ({"data": {"mix": {"grm": 1, "sloppy": 1}}}, "unknown agent 'sloppy'"),
        ({"data": {"policy_samples": 10, "policy": None}}, "needs `policy:`"),
        ({"data": {"near_misses": 0.8, "adversarial": 0.5}}, "at most 1"),
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


def test_calibration_set_is_heldout_and_shared_by_source():
    triples = calibration_set(9, seed=5, policy=None, long_share=0.5)
    assert len(triples) == 9 and {s.split("+")[0] for _, _, s in triples} == {"grm", "sft"}
    assert all(t.task.id.startswith("heldout") for t, _, _ in triples)
    assert any(t.task.courses for t, _, _ in triples)


def test_agreement_recall_per_verdict_and_masked_cells():
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
    perfect = agreement([ref], [ref])
    assert perfect.accuracy == 1.0
    for c in perfect.clauses:
        assert all(r in (None, 1.0) for r in c.recall.values())
    # a reviewer that calls every violation a pass has violation recall 0
    lenient = ref.model_copy(
        update={
            "verdicts": [
                v.model_copy(update={"verdict": "pass" if v.verdict == "violate" else v.verdict})
                for v in ref.verdicts
            ]
        }
    )
    for c in agreement([lenient], [ref]).clauses:
        assert c.recall["violate"] in (None, 0.0)


def test_rates_of_nothing_are_not_numbers():
    rep = agreement([], [])
    assert math.isnan(rep.accuracy) and math.isnan(rep.decided_accuracy) and rep.cells == 0
    assert math.isnan(cohen_kappa([[0, 0], [0, 0]]))
    assert math.isnan(cohen_kappa([[5, 0], [0, 0]]))  # one class only: kappa is undefined
    assert cohen_kappa([[5, 0], [0, 5]]) == 1.0


def test_perturbation_report_measures_flags_flips_and_reward_gains():
    """With the rule judge as the 'reviewer' (it cannot be steered): rewordings change no other
    turn's verdict, every held-out attack is flagged, and no attack raises the reward above the
    largest rewording's (the flag rule takes it to the minimum)."""
    pairs = [(t, pc) for t, pc, _ in calibration_set(8, seed=9, policy=None)]

    def reviewer(trajs, pcs):
        return [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]

    out = perturbation_report(reviewer, pairs, attacks_per_dialogue=3)
    words, hits = out["rewording"], out["attack"]
    assert words.cases > 0 and words.changed == 0.0 and words.flagged == 0.0
    assert hits.cases > 0 and hits.flagged == 1.0 and hits.above_rewording == 0
    assert hits.reward_gain_max <= 0.0
    assert set(out["attack_kinds"]) <= {a.kind for a in attacks("heldout")}


def test_targets_say_met_or_miss():
    ((traj, pc, _),) = calibration_set(1, seed=2, policy=None)
    ref = judge(traj, pc)
    goals = {g["target"]: g["met"] for g in targets(agreement([ref], [ref]), {})}
    assert goals["decided agreement"] and goals["reviews parsed completely"]


def test_grm_train_main_end_to_end(tmp_path, monkeypatch):
    """A micro GRM recipe: data, SFT, held-out agreement and the float16 install all happen; a
    second fresh run into the same folder is refused."""
    monkeypatch.setenv("KITCHEN_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "install": str(tmp_path / "installed"),
        "data": {"n_train": 16, "n_eval": 3, "labels": None, "pool_factor": 1.5},
        "review": {"max_context_tokens": 1024, "max_new_tokens": 16, "max_window_turns": 6},
        "sft": {
            "model": {
                "tiny": MICRO.model_dump() | {"max_positions": 1024},
                "tokenizer": {"vocab_size": 512},
            },
            "max_steps": 3,
            "batch_size": 4,
            "max_length": 1024,
            "eval_every": 3,
            "save_every": 3,
        },
    }
    GRMRecipe.model_validate(recipe)
    path = tmp_path / "grm.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert grm_train_main(path) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["train"]["dialogues"] == 16
    assert "A1" in summary["data"]["train"]["mix"]
    assert summary["heldout_agreement"]["reviews"] == 3
    assert len(summary["eval_loss"]) == 2 and summary["timings"]["train_s"] > 0
    model, tok = load_model(ModelSpec(path=str(tmp_path / "installed"), device="cpu"))
    assert tok.chat_template and model.config.max_position_embeddings == 1024
    with pytest.raises(KitchenError, match="already holds a trained GRM"):
        grm_train_main(path)


def test_calibrate_main_writes_every_section(tmp_path, capsys):
    """`kitchen grm calibrate` on a few held-out dialogues, with a stand-in reviewer (the shipped
    policy; any causal LM runs the pipeline): the table, per-source numbers, the voting
    comparison, the rewording and attack measures, the targets and the human section all come
    out; rates are in [0, 1] or not numbers."""
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
    stand_in = str(paths.DATA / "models" / "policy-tiny")
    code = grm_calibrate_main(
        grm=stand_in,
        n=3,
        votes=2,
        temperatures=[1.0],
        labels=str(labels),
        out=str(out),
        policy=None,
        perturb=2,
        cascade=["T3"],
    )
    assert code == 0
    text = capsys.readouterr().out
    for needle in ("parse failures", "vote of 2", "confusion", "rewording", "targets", "cascade"):
        assert needle in text
    rep = json.loads(out.read_text())
    assert rep["judge"]["reviews"] == 3 and rep["perturbation"]["attack"]["flagged"] == 1.0
    assert "violations_by_turn" in rep["judge"]
    for key, value in rep["judge"]["voting"].items():
        assert value is None or 0.0 <= value <= 1.0, key
    assert rep["human"]["cells"] == 1 and rep["judge_vs_human"]["accuracy"] == 1.0
    assert rep["cascade"]["clauses"] == ["T3"]
    assert {g["target"] for g in rep["targets"]} >= {
        "decided agreement",
        "held-out attacks flagged",
    }


def test_calibrate_rejects_bad_inputs_with_what_to_fix(tmp_path):
    with pytest.raises(KitchenError, match="--grm: no checkpoint folder"):
        grm_calibrate_main(grm=str(tmp_path / "nope"), n=1)
    with pytest.raises(KitchenError, match="--cascade: unknown clause 'Z9'"):
        grm_calibrate_main(n=1, cascade=["Z9"])


def test_parse_failures_count_against_the_reviewer():
    ((traj, pc, _),) = calibration_set(1, seed=3, policy=None)
    broken = parse_review("", turns=range(len(traj.turns)), clauses=pc.ids)
    assert agreement([broken], [judge(traj, pc)]).accuracy == 0.0
    assert flags(traj) == []


def test_violations_by_turn_split_the_recall_by_the_turns_action():
    """Every violation of the judge lands in one (clause, kind of turn) cell; a reviewer that
    passes every order but catches the rest is caught out on `order` alone."""
    triples = calibration_set(12, seed=3, policy=None, long_share=0.5)
    trajs = [t for t, _, _ in triples]
    refs = [judge(t, pc) for t, pc, _ in triples]
    perfect = violations_by_turn(refs, refs, trajs)
    total = sum(v.verdict == "violate" for r in refs for v in r.verdicts)
    assert sum(n for kinds in perfect.values() for _, n in kinds.values()) == total > 0
    assert all(c == n for kinds in perfect.values() for c, n in kinds.values())
    assert any("order" in kinds for kinds in perfect.values())

    def blind_to_orders(ref, traj):
        def verdict(v):
            if v.verdict == "violate" and traj.turns[v.turn].action.tool == "order":
                return v.model_copy(update={"verdict": "pass"})
            return v

        return ref.model_copy(update={"verdicts": [verdict(v) for v in ref.verdicts]})

    split = violations_by_turn(
        [blind_to_orders(r, t) for r, t in zip(refs, trajs, strict=True)], refs, trajs
    )
    for clause, kinds in split.items():
        for kind, (caught, n) in kinds.items():
            assert caught == (0 if kind == "order" else n), (clause, kind)
