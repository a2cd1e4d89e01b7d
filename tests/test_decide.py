"""kitchen.decide: the plateau test, the imitation ceiling, the cost calculator, the verdict."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kitchen import decide, paths
from kitchen.decide import CostInputs, ThroughputRecord

from .test_notebooks import load_app

# --------------------------------------------------------------------------- question 1


def test_plateau_recovers_a_power_law():
    """y = 2·x^(−0.5) exactly: b = 0.5, doubling projects 1 − 2^(−0.5) ≈ 29.3%, not a plateau."""
    xs = [100, 200, 300, 400, 500, 600]
    ys = [2 * x**-0.5 for x in xs]
    p = decide.plateau(xs, ys, tail=0.5)
    assert p.steps == [300, 400, 500, 600]
    assert math.isclose(p.exponent, 0.5, rel_tol=1e-9)
    assert math.isclose(p.log_c, math.log(2), rel_tol=1e-9)
    assert math.isclose(p.projected_gain, 1 - 2**-0.5, rel_tol=1e-9)
    assert math.isclose(p.observed_gain, 1 - (300 / 600) ** 0.5, rel_tol=1e-9)
    assert not p.plateaued


def test_plateau_flat_or_rising_curve_has_plateaued():
    """A flat tail projects 0 gain; a rising one (over-fitting) a negative gain: both plateaued."""
    flat = decide.plateau([1, 2, 3, 4], [1.0, 0.5, 0.5, 0.5], tail=0.6)
    assert flat.plateaued and abs(flat.projected_gain) < 1e-12
    rising = decide.plateau([1, 2, 3, 4], [1.0, 0.5, 0.6, 0.7], tail=0.6)
    assert rising.plateaued and rising.projected_gain < 0


def test_plateau_on_accuracy_uses_the_error():
    """higher_is_better: the power law is fitted to 1 − accuracy; values come back as given."""
    acc = [1 - 0.4 * x**-1.0 for x in (10, 20, 40)]
    p = decide.plateau([10, 20, 40], acc, tail=1.0, higher_is_better=True)
    assert math.isclose(p.exponent, 1.0, rel_tol=1e-9)
    assert p.values == pytest.approx(acc)


def test_plateau_needs_two_points():
    with pytest.raises(ValueError, match="two points"):
        decide.plateau([0, 10], [5.0, 1.0])  # step 0 cannot enter a log fit


def test_shipped_sft_log_is_the_cold_start_run():
    """The shipped trainer log ends where PROVENANCE.md says: held-out loss 0.168 at step 1,000."""
    rows = decide.load_sft_log()
    evals = [r for r in rows if "eval_loss" in r]
    assert evals[-1]["step"] == 1000
    assert evals[-1]["eval_loss"] == pytest.approx(0.168, abs=5e-4)
    assert (
        "**0.168** (1,000)" in (paths.DATA / "models" / "policy-tiny" / "PROVENANCE.md").read_text()
    )
    assert evals[0]["step"] == 0


def test_imitation_gap_splits_what_is_left():
    """remaining = imitable + beyond when the teacher is better; all beyond when it is worse."""
    rows = decide.imitation_gap({"A": 0.6, "B": 0.8, "C": 1.0}, {"A": 0.9, "B": 0.5, "D": 0.1})
    a, b = rows
    assert a == pytest.approx(
        {"metric": "A", "policy": 0.6, "teacher": 0.9, "remaining": 0.4, "imitable": 0.3,
         "beyond": 0.1}
    )  # fmt: skip
    assert b["imitable"] == 0 and b["beyond"] == pytest.approx(0.2)
    assert len(rows) == 2  # C and D are in one mapping only
    assert decide.beyond_share(rows) == pytest.approx((0.1 + 0.2) / (0.4 + 0.2))
    assert decide.beyond_share([]) == 0.0


def test_answer_sft():
    """Yes only when plateaued, mostly beyond the data and no cheaper fix helps."""
    flat = decide.plateau([1, 2, 3, 4], [1.0, 0.5, 0.5, 0.5], tail=0.6)
    falling = decide.plateau([100, 200], [1.0, 0.5])
    assert decide.answer_sft(flat, 0.7).ok is True
    assert decide.answer_sft(flat, None).ok is True
    assert decide.answer_sft(flat, 0.3).ok is False
    assert decide.answer_sft(flat, 0.7, cheaper_fixes_help=True).ok is False
    assert decide.answer_sft(falling, 0.9).ok is False


# --------------------------------------------------------------------------- question 2


def test_answer_reward():
    a = decide.answer_reward
    assert a(verifiable=True, constitution_valid=False, grm_kappa=None).ok is True
    assert a(verifiable=False, constitution_valid=False, grm_kappa=0.9).ok is False
    assert a(verifiable=False, constitution_valid=True, grm_kappa=None).ok is None
    assert a(verifiable=False, constitution_valid=True, grm_kappa=0.55).ok is False
    assert a(verifiable=False, constitution_valid=True, grm_kappa=0.6).ok is True


def test_grm_kappa_reads_a_calibration_report(tmp_path):
    """Human agreement is preferred over judge agreement; a missing report is (None, why)."""
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"command": "c", "judge": {"kappa": 0.7}, "human": None}))
    assert decide.grm_kappa(f) == (0.7, "c, against the judge")
    f.write_text(json.dumps({"judge": {"kappa": 0.7}, "human": {"kappa": 0.5}}))
    assert decide.grm_kappa(f)[0] == 0.5
    kappa, why = decide.grm_kappa(tmp_path / "none.json")
    assert kappa is None and "no calibration report" in why


# --------------------------------------------------------------------------- question 3


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Qwen2.5-7B", "Llama-3.1-8B"])
def test_parameter_counts_match_transformers(name):
    """The shape formula counts exactly what transformers builds (meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    a = decide.ARCHITECTURES[name]
    kw = dict(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate,
        vocab_size=a.vocab,
        tie_word_embeddings=a.tied,
    )
    cls, cfg = (
        (Qwen2ForCausalLM, Qwen2Config(**kw))
        if a.qkv_bias
        else (LlamaForCausalLM, LlamaConfig(**kw))
    )
    with torch.device("meta"):
        model = cls(cfg)
    assert sum(p.numel() for p in model.parameters()) == a.parameters()
    linear = sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    assert linear == a.linear_parameters()


def test_shipped_tiny_policy_shape_and_lora_count():
    """policy-tiny: 1,910,528 parameters (PROVENANCE.md); LoRA 'all-linear' adds r·(in+out) per
    linear layer, exactly what peft adds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = decide.architectures()["policy-tiny"]
    assert tiny.parameters() == 1_910_528
    cfg = AutoConfig.from_pretrained(paths.DATA / "models" / "policy-tiny")
    model = get_peft_model(
        AutoModelForCausalLM.from_config(cfg),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == tiny.lora_parameters(4)


def _record(**over) -> ThroughputRecord:
    base = dict(
        device="NVIDIA H100 80GB HBM3",
        model="m",
        parameters=1_000_000_000,
        quantization="nf4",
        rollout_tokens_per_s=1000.0,
        update_tokens_per_s=4000.0,
        review_tokens_per_s=2000.0,
        command="cmd",
        date="2026-11-30",
    )
    return ThroughputRecord(**(base | over))


def _inputs(**over) -> CostInputs:
    base = dict(
        policy="Qwen2.5-1.5B",
        k=4,
        tasks_per_iteration=2,
        iterations=10,
        turns=5,
        tokens_per_turn=100,
        other_tokens_per_turn=20,
        review_tokens=200,
        votes=1,
        device="H100 80GB",
    )
    return CostInputs(**(base | over))


def test_cost_counts_and_hours_by_hand():
    """80 dialogues: 40,000 generated tokens, 80 reviews (16,000 tokens), 48,000 update tokens;
    speeds scaled by 1e9 / P."""
    inp = _inputs()
    est = decide.estimate_cost(inp, [_record()])
    assert (est.episodes, est.generated_tokens, est.reviews) == (80, 40_000, 80)
    assert (est.review_tokens, est.update_tokens) == (16_000, 48_000)
    p = decide.ARCHITECTURES["Qwen2.5-1.5B"].parameters()
    scale = 1e9 / p
    assert est.seconds["rollout"] == pytest.approx(40_000 / (1000 * scale))
    assert est.seconds["review"] == pytest.approx(16_000 / (2000 * scale))
    assert est.seconds["update"] == pytest.approx(48_000 / (4000 * scale))
    assert est.hours == pytest.approx(sum(est.seconds.values()) / 3600)
    assert any("1/parameters" in a for a in est.assumptions)
    assert "cmd" in est.source and "2026-11-30" in est.source


def test_cost_without_a_measurement_says_what_to_run():
    est = decide.estimate_cost(_inputs(device="L4"), [_record()])
    assert est.hours is None and est.seconds is None
    assert "no L4 measurement recorded yet" in est.missing
    assert "benchmarks/bench_gpu.py --out data/throughput/l4.json" in est.missing
    assert est.generated_tokens == 40_000  # the counts do not need a measurement


def test_cost_reviews_borrow_the_rollout_speed_when_unmeasured():
    est = decide.estimate_cost(_inputs(), [_record(review_tokens_per_s=None)])
    p = decide.ARCHITECTURES["Qwen2.5-1.5B"].parameters()
    assert est.seconds["review"] == pytest.approx(16_000 / (1000 * 1e9 / p))
    assert any("rollout figure" in a for a in est.assumptions)


def test_for_device_matches_names_and_nearest_size():
    small, big = _record(parameters=10**8), _record(parameters=10**10)
    assert decide.for_device([small, big], "H100 80GB", 2 * 10**9).parameters == 10**10
    assert decide.for_device([small, big], "H100 80GB", 10**8).parameters == 10**8
    assert decide.for_device([small], "A100 80GB") is None
    assert decide.for_device([_record(device="cpu")], "cpu") is not None


def test_memory_formula_terms():
    """QLoRA stores linear weights in 4.127 bits; the judge (votes 0) puts no GRM on the device;
    `fits` compares the peak with the GPU's memory."""
    a = decide.ARCHITECTURES["Qwen2.5-7B"]
    lora = decide.estimate_memory(_inputs(policy="Qwen2.5-7B", method="lora"), a, a)
    qlora = decide.estimate_memory(_inputs(policy="Qwen2.5-7B", method="qlora"), a, a)
    assert lora.parts["weights"] == pytest.approx(a.parameters() * 2 / 1e9)
    lin = a.linear_parameters()
    assert qlora.parts["weights"] == pytest.approx(
        (lin * 4.127 / 8 + (a.parameters() - lin) * 2) / 1e9
    )
    assert qlora.parts["policy adapter + AdamW"] == pytest.approx(a.lora_parameters(16) * 16 / 1e9)
    judge = decide.estimate_memory(_inputs(votes=0), a, a)
    assert judge.parts["review KV cache"] == 0 and judge.parts["grm adapter"] == 0
    big = decide.estimate_memory(_inputs(policy="Qwen2.5-14B", method="lora", device="T4"), a, a)
    assert big.device_gb == 16 and big.fits is False
    assert set(big.formulas) == set(big.parts)


def test_bench_gpu_output_is_a_record(tmp_path):
    """`bench_gpu.py --out` JSON reads as a record: medians after the warm-up iteration."""
    f = tmp_path / "h100.json"
    its = [
        {"rollout_tokens_per_s": r, "reviews_per_s": 2.0, "update_tokens_per_s": u}
        for r, u in ((10.0, 20.0), (100.0, 200.0), (300.0, 400.0))
    ]
    f.write_text(
        json.dumps(
            {"shape": "qwen2.5-0.5b", "device": "NVIDIA H100 80GB HBM3", "iterations": its,
             "peak_gb_policy_ref_grm": 10.0}
        )
    )  # fmt: skip
    rec = decide.read_throughput(f)
    assert rec.rollout_tokens_per_s == 200.0 and rec.update_tokens_per_s == 300.0
    assert rec.parameters == decide.ARCHITECTURES["Qwen2.5-0.5B"].parameters()
    assert rec.review_tokens_per_s == 2.0 * 256
    assert rec.quantization == "nf4"
    assert decide.for_device([rec], "H100 80GB") is rec
    # With the run's settings: a review is its lines (one per turn) of `review` tokens each.
    doc = json.loads(f.read_text())
    doc |= {"settings": {"review": 128, "turns": 4}, "episodes_per_rollout": 64}
    doc["iterations"] = [it | {"review_lines": 192} for it in its]
    f.write_text(json.dumps(doc))
    assert decide.read_throughput(f).review_tokens_per_s == 2.0 * 128 * 3
    f.write_text(json.dumps(doc | {"iterations": [], "phases": {"nf4": "failed: X"}}))
    with pytest.raises(ValueError, match="measured no iteration.*failed: X"):
        decide.read_throughput(f)


def test_shipped_throughput_records_are_complete():
    """Every shipped record says what measured it and when; the CPU one exists."""
    recs = decide.load_throughput()
    assert any(r.device == "cpu" for r in recs)
    for r in recs:
        assert r.command and r.date and r.parameters > 0
        assert r.rollout_tokens_per_s > 0 and r.update_tokens_per_s > 0


def test_inputs_from_recipes():
    """The GPU recipe gives Qwen2.5-1.5B QLoRA with the GRM as an adapter; the tiny one, the
    measured dialogue shape when given."""
    from kitchen.train import load_recipe

    gpu = CostInputs.from_recipe(load_recipe(paths.RECIPES / "gpu_qwen_qlora.yaml"))
    assert (gpu.policy, gpu.method, gpu.grm_shares_base) == ("Qwen2.5-1.5B", "qlora", True)
    assert (gpu.turns, gpu.tokens_per_turn, gpu.review_tokens) == (8, 160, 8 * 128)
    w = {"turns": 5.0, "generated_tokens_per_turn": 10.0, "other_tokens_per_turn": 39.0}
    tiny = CostInputs.from_recipe(load_recipe(paths.RECIPES / "tiny_mapo.yaml"), w, device="cpu")
    assert (tiny.policy, tiny.turns, tiny.tokens_per_turn, tiny.device) == (
        "policy-tiny",
        5.0,
        10.0,
        "cpu",
    )


def test_answer_cost():
    inp = _inputs()
    est = decide.estimate_cost(inp, [_record()])
    assert decide.answer_cost(est, est.hours * 2).ok is True
    assert decide.answer_cost(est, est.hours / 2).ok is False
    assert decide.answer_cost(est, None).ok is None
    unmeasured = decide.estimate_cost(_inputs(device="L4"), [])
    assert decide.answer_cost(unmeasured, 100).ok is None
    too_big = decide.estimate_cost(_inputs(policy="Qwen2.5-14B", method="lora", device="T4"), [])
    assert decide.answer_cost(too_big, 100).ok is False


# --------------------------------------------------------------------------- the verdict


def _a(ok):
    return decide.Answer(question="q", ok=ok, summary="s — why")


@pytest.mark.parametrize(
    "sft, reward, cost, verdict",
    [
        (True, True, True, "do RL"),
        (True, False, True, "don't"),
        (False, False, True, "don't"),
        (False, True, True, "not yet"),
        (True, True, False, "not yet"),
        (True, None, True, "not yet"),
        (None, True, None, "not yet"),
    ],
)
def test_recommend_rule(sft, reward, cost, verdict):
    r = decide.recommend(_a(sft), _a(reward), _a(cost))
    assert r.verdict == verdict
    assert "**q**" in r.text()


# --------------------------------------------------------------------------- measuring


def test_measure_writes_a_record(tmp_path, monkeypatch):
    """A 2-iteration run (1 left out as warm-up) gives positive speeds and the dialogue shape."""
    from kitchen.train import Recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        Recipe.model_validate(
            {
                "name": "measure-test",
                "policy": {"path": str(paths.DATA / "models" / "policy-tiny"), "lora": {"r": 4}},
                "reward": {"reviewer": "judge"},
                "rollout": {"k": 2, "max_turns": 3, "max_new_tokens": 24},
                "train": {"iterations": 2, "tasks_per_iteration": 1, "task_pool": 4},
                "eval_every": 0,
                "samples_per_iteration": 0,
                "torch_threads": 1,
            }
        ).model_dump_json()
    )
    out = tmp_path / "cpu.json"
    assert decide.main(["measure", str(recipe), "--out", str(out)]) == 0
    rec = decide.read_throughput(out)
    assert rec.device == "cpu" and rec.iterations == 1 and rec.reviewer == "judge"
    assert rec.rollout_tokens_per_s > 0 and rec.update_tokens_per_s > 0
    assert rec.reviews_per_s is None  # the judge's speed says nothing about a GRM's
    assert 0 < rec.workload["turns"] <= 3
    assert rec.parameters == 1_910_528
    assert rec.command.startswith("python -m kitchen.decide measure")


# --------------------------------------------------------------------------- notebook 00


def test_00_should_you_rl_values():
    """The notebook's answers on the kit's own evidence: the shipped SFT curve is still falling
    (doubling is projected to buy ~16%), so the verdict is 'not yet'; the teacher comparison and
    the cost estimate were computed."""
    _, defs = load_app("00_should_you_rl.py").run()
    curve = defs["curve"]
    assert not curve.plateaued and curve.projected_gain == pytest.approx(0.164, abs=0.01)
    assert {r["metric"] for r in defs["gap"]} >= {"success", "A1", "T1"}
    assert 0 <= defs["share"] <= 1
    assert defs["sft_answer"].ok is False
    if defs["kappa"] is None:
        assert defs["reward_answer"].ok is None
    cost = defs["cost"]
    assert cost.generated_tokens > 0 and cost.memory.total_gb > 0
    assert cost.hours is not None or "bench_gpu.py" in cost.missing
    assert defs["recommendation"].verdict == "not yet"


def test_answer_markdown_numbers_the_question_and_lists_every_reason():
    a = decide.Answer(
        question="Has SFT plateaued?", ok=True, summary="yes", reasons=["flat", "cheap"]
    )
    assert a.markdown(1) == "**Question 1 — Has SFT plateaued?** yes\n\n- flat\n- cheap"
