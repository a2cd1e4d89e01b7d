"""The GRM at work: review conversations on the engine and on `generate`, structure, windows,
budgets, flags, cascade and voting (kitchen.grm). The shipped GRM's quality is measured by
`kitchen grm calibrate` (tests/test_calibrate.py); here only the plumbing is under test, with the
shipped GRM as the reviewer (a model that never writes `=>` would have every line cut by the
review grammar)."""

from __future__ import annotations

import random

import pytest

from kitchen import paths
from kitchen.critique import parse_review, read_line
from kitchen.grm import GRM, GRMConfig, LineGrammar, merge_cascade, verdict_tensor
from kitchen.grmdata import pool
from kitchen.injection import attacks, message_turns, with_text
from kitchen.judge import judge
from kitchen.models import ModelSpec, load_model


@pytest.fixture(scope="module")
def stand_in():
    """The shipped tiny GRM, as a model that writes readable lines."""
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "grm-tiny")))
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def dialogues():
    return [
        (t, pc) for t, pc, _ in pool(6, "heldout", 21, {"grm": 0.5, "sft": 0.5}, long_share=0.5)
    ]


def _lines(review):
    return sorted({v.turn for v in review.verdicts})


def test_line_grammar_forces_the_marker():
    vocab = ["t", "1", "2", "t1", " ", "t12", "x", "1 "]
    g = LineGrammar(vocab)
    allowed = {vocab[i] for i in g.allowed("t12 ", "")}
    assert allowed == {"t", "t1", "t12"}
    assert {vocab[i] for i in g.allowed("t12 ", "t1")} == {"2"}
    assert g.allowed("t12 ", "t12 ", whole=False) is None  # the marker only: the rest is free
    assert g.allowed("t12 ", "t13") is None  # diverged (only without the constraint): free


def test_line_grammar_bars_line_breaks_and_special_tokens_from_the_first_token_on():
    vocab = ["<eos>", "<pad>", "t", "3", " =>", " =>\n\n", " ok\r", "2 x", "3 ok", "3 \n"]
    g = LineGrammar(vocab, eos=0, special=[1])
    assert {vocab[i] for i in g.allowed("t3 ", "t")} == {"3", "3 ok"}  # not a break past it
    body = {vocab[i] for i in g.allowed("t3 ", "t3 ok")}
    assert body == {"t", "3", " =>", "2 x", "3 ok"}  # no \n, no \r, no <pad>, no <eos> yet


def test_the_shipped_grms_grammar_never_allows_a_break_or_a_special_token():
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "grm-tiny")))
    g = GRM(model, tok)._line_grammar()
    special = set(tok.all_special_ids) - {tok.eos_token_id}
    for written in ("", "t", "t1", "t12 chat", "t12 chat => A1+"):
        for i in g.allowed("t12 ", written):
            assert i not in special and len(f"x{tok.decode([i])}x".splitlines()) == 1, (written, i)


VOCAB = ["<eos>", "t3 ", "ok", ";", " =>", "=", ">", " =>\n", " A", "1", "+", "-", " T",
         " no", " ", "A1+", "\n"]  # fmt: skip


def _next(g, written):
    return {VOCAB[i] for i in g.allowed("t3 ", written)}


def test_line_grammar_lets_a_line_end_only_where_it_is_readable():
    g = LineGrammar(VOCAB, eos=0)
    body = set(VOCAB) - {"<eos>", " =>\n", "\n"}  # no line break, ever
    assert _next(g, "t3 ok") == body  # no verdicts yet: the line may not end
    assert _next(g, "t3 ok =>") == body | {"<eos>"}  # no verdicts is a readable list
    assert _next(g, "t3 ok => A1+") == body | {"<eos>"}
    assert _next(g, "t3 ok => A1") == body  # half an entry
    assert _next(g, "t3 ok => no") == body  # not an entry: the GRM must go on ...
    assert _next(g, "t3 ok => no => A1-") == body | {"<eos>"}  # ... a later arrow ends it
    assert g.allowed("t3 ", "t3 ok", whole=False) is None  # the marker alone


def test_a_line_with_a_break_inside_is_unreadable():
    assert read_line("t0 a\rb => A1+") is None and read_line("t0 a b => A1+ ") is not None
    assert parse_review("t0 a\rb => A1+", turns=[0], clauses=["A1"]).parsed_fraction == 0


def test_a_critique_with_its_own_arrow_reads_by_the_last_one():
    r = parse_review(
        ["t0 chat => no rec yet; 11 words => A2+ T3-"], turns=[0], clauses=["A2", "T3"]
    )
    assert r.table() == {(0, "A2"): "pass", (0, "T3"): "violate"}
    assert r.verdicts[0].reason == "chat => no rec yet; 11 words"


def test_every_line_the_grammar_lets_through_parses():
    """Random walks through the grammar: every finished line is read whole by the parser."""
    rng = random.Random(0)
    g = LineGrammar(VOCAB, eos=0)
    ended = 0
    for _ in range(300):
        text = ""
        for _ in range(12):
            options = g.allowed("t3 ", text)
            if 0 in options and rng.random() < 0.5:  # end wherever the grammar lets it
                ended += 1
                r = parse_review([text], turns=[3], clauses=["A1", "T1"])
                assert r.parsed_fraction == 1, text
                break
            text += VOCAB[rng.choice([i for i in options if i != 0])]
    assert ended > 50  # the walks do end, often


def test_every_turn_gets_one_structured_line_on_both_paths(stand_in, dialogues):
    """With structure on, each turn's line starts with its marker, so every turn is judged
    exactly once; the engine and `generate` write the same greedy lines."""
    model, tok = stand_in
    trajs, pcs = [t for t, _ in dialogues], [pc for _, pc in dialogues]
    cfg = GRMConfig(batch_size=4)
    fast = GRM(model, tok, cfg)
    slow = GRM(model, tok, cfg.model_copy(update={"engine": "generate"}))
    a, b = fast.review(trajs, pcs), slow.review(trajs, pcs)
    for ra, rb, t in zip(a, b, trajs, strict=True):
        assert ra.turns == len(t.turns) and _lines(ra) == list(range(len(t.turns)))
        assert ra.parsed_fraction == 1 and rb.parsed_fraction == 1
        assert [v.reason for v in ra.verdicts] == [v.reason for v in rb.verdicts]
        assert ra.table() == rb.table()
    assert fast.stats["lines"] == sum(len(t.turns) for t in trajs)


@pytest.mark.parametrize("engine", ["fast", "generate"])
def test_a_grm_left_training_reviews_as_in_eval_mode_and_stays_training(engine, dialogues):
    """The GRM shares the policy's base, which an update has just left in training mode: with
    dropout in its attention (0.5 here) a review in that mode would draw other lines. Both
    decoding paths review in eval mode and hand the model back training."""
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "grm-tiny")))
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    short = min(dialogues, key=lambda d: len(d[0].turns))
    trajs, pcs = [short[0]], [short[1]]
    grm = GRM(model, tok, GRMConfig(batch_size=4, engine=engine))
    model.eval()
    want = [r.table() for r in grm.review(trajs, pcs)]
    model.train()
    got = [r.table() for r in grm.review(trajs, pcs)]
    assert model.training
    assert got == want


def test_a_line_cut_by_its_budget_is_masked_and_flagged(stand_in, dialogues):
    model, tok = stand_in
    (traj, pc), *_ = dialogues
    cfg = GRMConfig(max_new_tokens=8)
    r = GRM(model, tok, cfg).review([traj], [pc])[0]
    cut = [f for f in r.flags if f.endswith("review budget")]
    assert cut, "an 8-token budget cuts the GRM's lines"
    for f in cut:
        t = int(f.split(":")[0][1:])
        mine = [v for v in r.verdicts if v.turn == t and v.clause not in cfg.rule_only]
        assert mine and all(v.verdict is None for v in mine)
        # the clauses the GRM is not shown keep their rule verdicts, budget or not
        assert all(v.verdict for v in r.verdicts if v.turn == t and v.clause in cfg.rule_only)


def test_rule_only_clauses_are_left_out_of_the_grm_prompt_and_judged_by_rule(stand_in, dialogues):
    from kitchen.critique import review_turns

    model, tok = stand_in
    (traj, pc), *_ = dialogues
    assert "T10" in pc.ids
    grm = GRM(model, tok, GRMConfig(rule_only=["T10"]))
    assert "T10" not in review_turns(traj, grm.shown(pc))[0]
    assert "T10" in review_turns(traj, pc)[0]
    r = grm.review([traj], [pc])[0]
    ref = judge(traj, pc)
    assert "T10" in r.clauses and r.source == "cascade"
    assert {k: v for k, v in r.table().items() if k[1] == "T10"} == {
        k: v for k, v in ref.table().items() if k[1] == "T10"
    }


def test_long_dialogues_are_reviewed_in_windows_covering_every_turn(stand_in, dialogues):
    model, tok = stand_in
    traj, pc = max(dialogues, key=lambda x: len(x[0].turns))
    assert len(traj.turns) > 6
    grm = GRM(model, tok, GRMConfig(max_new_tokens=16, max_window_turns=4))
    r = grm.review([traj], [pc])[0]
    assert _lines(r) == list(range(len(traj.turns)))
    assert grm.stats["lines"] == len(traj.turns)


def test_flags_come_from_the_rule_not_the_reviewer(stand_in, dialogues):
    model, tok = stand_in
    traj, pc = next((t, p) for t, p in dialogues if message_turns(t))
    attacked = with_text(traj, message_turns(traj)[0], attacks("heldout")[0].text)
    r = GRM(model, tok, GRMConfig(max_new_tokens=24)).review([attacked], [pc])[0]
    assert any(f.startswith(f"t{message_turns(traj)[0]}:") for f in r.flags)


def test_cascade_takes_the_rule_verdicts_and_skips_the_grm_when_nothing_is_left(
    stand_in, dialogues
):
    model, tok = stand_in
    traj, pc = dialogues[0]
    ref = judge(traj, pc)
    some = GRM(model, tok, GRMConfig(max_new_tokens=24, cascade=["A1", "T3"])).review([traj], [pc])[
        0
    ]
    for v in some.verdicts:
        if v.clause in ("A1", "T3"):
            assert v.verdict == ref.get(v.turn, v.clause).verdict
    every = GRM(model, tok, GRMConfig(cascade=list(pc.ids)))
    r = every.review([traj], [pc])[0]
    assert r.table() == ref.table() and every.stats["lines"] == 0


def test_merge_cascade_keeps_the_grm_elsewhere():
    grm = parse_review(["t0 chat => A2- T3+"], turns=[0], clauses=["A2", "T3"])
    rule = parse_review(["t0 chat => A2+ T3-"], turns=[0], clauses=["A2", "T3"])
    merged = merge_cascade(grm, rule, ["A2"])
    assert merged.table() == {(0, "A2"): "pass", (0, "T3"): "pass"} and merged.source == "cascade"


def test_sampled_reviews_are_voted_and_repeatable(stand_in, dialogues):
    model, tok = stand_in
    trajs, pcs = [t for t, _ in dialogues[:2]], [pc for _, pc in dialogues[:2]]
    cfg = GRMConfig(samples=3, temperature=1.0, seed=5)
    grm, twin = GRM(model, tok, cfg), GRM(model, tok, cfg)
    voted, samples = grm.review_with_samples(trajs, pcs)
    again, _ = twin.review_with_samples(trajs, pcs)
    assert [r.table() for r in voted] == [r.table() for r in again]
    assert grm.last_text == twin.last_text  # seeded: the same lines
    assert all(len(s) == 3 for s in samples)
    assert len(set(grm.last_text[0])) > 1  # the samples differ


def test_verdict_tensor_codes():
    r = parse_review(["t0 x => A1+ T3-", None], turns=range(2), clauses=["A1", "T3", "T5"])
    t = verdict_tensor([r], ["A1", "T3", "T5"])
    assert t.shape == (1, 2, 3)
    assert t[0, 0].tolist() == [1.0, -1.0, 0.0] and t[0, 1].isnan().all()


def test_bench_grm_lookahead_counts_what_a_draft_would_save(stand_in, dialogues):
    """benchmarks/bench_grm.py --lookahead: prompt lookup drafts what followed the newest tokens'
    last earlier occurrence; a draft that matches is accepted whole, one that does not costs its
    forward; and the recorded completions are the GRM's review lines."""
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_grm")
    assert bench.prompt_lookup([5, 6, 7, 9, 5, 6, 7], k=2) == [9, 5]
    assert bench.prompt_lookup([1, 2, 3], k=4) == []  # nothing recurs: no draft
    # the line repeats the prompt: after the first token every forward takes a draft of 3 and
    # the model's own token (4 tokens), so 9 tokens take 1 + 2 = 3 forwards
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert bench.tokens_per_forward([(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9])], k=3) == 3.0
    assert bench.tokens_per_forward([(prompt, [11, 12, 13])], k=3) == 1.0  # never right
    model, tok = stand_in
    grm = GRM(model, tok, GRMConfig(batch_size=4))
    trajs, pcs = [t for t, _ in dialogues[:2]], [pc for _, pc in dialogues[:2]]
    assert bench.forward_ms(grm, rows=2, width=16, q=3, repeats=1) > 0
    records = bench.review_completions(grm, trajs, pcs)
    assert len(records) == sum(len(t.turns) for t in trajs)
    lines = sorted(tok.decode(g, skip_special_tokens=True).strip() for _, g in records)
    assert lines == sorted(x for text in grm.last_text for x in text[0].split("\n"))


def test_bench_grm_compare_reads_both_grms_on_the_same_dialogues(stand_in, dialogues, capsys):
    """benchmarks/bench_grm.py --compare: one row per GRM with the lines it wrote and their
    tokens a line, its agreement with the judge (here the same GRM twice: the same row)."""
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_grm")
    model, tok = stand_in
    trajs, pcs = [t for t, _ in dialogues[:3]], [pc for _, pc in dialogues[:3]]
    refs = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    grms = {name: GRM(model, tok, GRMConfig(batch_size=4)) for name in ("a", "b")}
    bench.compare(grms, trajs, pcs, refs, rounds=1)
    out = capsys.readouterr().out
    rows = {
        r.split("|")[1].strip(): r.split("|")[3:]
        for r in out.splitlines()
        if r[:3] in ("| a", "| b")
    }
    lines = [x for t in grms["a"].last_text for x in t[0].splitlines() if x.strip()]
    tokens = sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in lines)
    assert int(rows["a"][0]) == len(lines) >= sum(len(t.turns) for t in trajs) // 2
    assert float(rows["a"][1]) == round(tokens / len(lines), 1)
    assert rows["a"] == rows["b"]
    assert "review time b / a:" in out


def test_fast_review_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    """`GRMConfig.dtype: fast` loads the GRM in bfloat16 on a CPU with AMX and as `auto`
    (float32 on a CPU) without it; the other settings pass through unchanged."""
    import torch

    from kitchen import grm as grm_module
    from kitchen import models

    probe = models.cpu_has_bf16_matmul
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for amx, want in ((True, "bfloat16"), (False, "auto")):
        monkeypatch.setattr(models, "cpu_has_bf16_matmul", lambda amx=amx: amx)
        assert grm_module.review_dtype("fast") == want
        assert [grm_module.review_dtype(d) for d in ("auto", "float32", "bfloat16")] == [
            "auto",
            "float32",
            "bfloat16",
        ]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert probe() is True
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert probe() is False  # the private probe gone from torch: float32, as before
