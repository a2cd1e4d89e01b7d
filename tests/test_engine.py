"""The decoding engine: sampling rules, the ragged cache, and decoding that equals `generate` and a
teacher-forced recompute, row by row, whatever the batch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.testing import assert_close

from kitchen import paths
from kitchen.engine import (
    Engine,
    RaggedCache,
    Request,
    SamplingParams,
    compute_dtypes,
    force_generate,
    lora_merged,
    prefill_groups,
    row_uniforms,
    sample_tokens,
    self_check_tolerance,
    token_logprobs_of,
    top_p_remove,
    unsupported,
)
from kitchen.models import LoraSpec, ModelSpec, add_adapter, load_model, render_chat, token_logprobs

SYSTEM = "Concierge. Tools: @search CUISINE, @allergens DISH, @order DISH. Diner: verbosity=brief."
REQUESTS = [
    "I'd like some thai food.",
    "Find me a dish under 12 dollars, please.",
    "I need dinner.",
    "Can you get me something indian within 20 minutes?",
    "I'm in the mood for italian.",
]


@pytest.fixture(scope="module")
def policy():
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    return model.eval(), tok


def prompt(tok, request: str, extra: list[dict] | None = None) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request}]
    text = render_chat(messages + (extra or []), add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def params(tok, **kw) -> SamplingParams:
    return SamplingParams(**({"max_new_tokens": 40, "eos_token_id": tok.eos_token_id} | kw))


def recompute(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """log π of `tokens` after `prompt_ids`, by one teacher-forced forward (no cache)."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return lp[0, len(prompt_ids) - 1 :]


# ----------------------------------------------------------------------------------------------
# Sampling: pure functions


def test_top_p_removes_what_transformers_removes():
    """The nucleus rule is transformers' `TopPLogitsWarper`, token for token, ties included."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 50, generator=g) * 3
    z[0, :5] = 2.0  # ties
    for p in (0.1, 0.5, 0.9, 0.999):
        ref = TopPLogitsWarper(p)(None, z.clone()) == float("-inf")
        assert torch.equal(top_p_remove(z, p), ref)
    assert not top_p_remove(torch.tensor([[0.0, 10.0]]), 1e-9)[0, 1]  # the top token stays


def test_sample_tokens_greedy_constraint_and_inverse_cdf():
    """Greedy is argmax; a constraint is applied first; a uniform u picks the first token whose
    CDF exceeds u (hand-computed), and never a token of probability zero."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert sample_tokens(logits, torch.tensor([0.5]), 0.0).item() == 3
    allowed = torch.tensor([[True, True, False, False]])
    assert sample_tokens(logits, torch.tensor([0.5]), 0.0, allowed=allowed).item() == 1
    cdf = [0.1, 0.3, 0.6, 1.0]
    for u, want in ((0.05, 0), (0.11, 1), (0.29, 1), (0.31, 2), (0.99, 3)):
        assert sample_tokens(logits, torch.tensor([u], dtype=torch.float64), 1.0).item() == want
        assert cdf[want] > u
    # masked by top-p (p = 0.5 keeps 0.4 and 0.3): u near 0 must not land on a removed token
    assert sample_tokens(logits, torch.tensor([0.0], dtype=torch.float64), 1.0, 0.5).item() == 2


def test_sample_tokens_draw_from_the_tempered_distribution():
    """Frequencies over 20,000 seeded draws match softmax(z / T) within 1.5 percentage points."""
    z = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    u = row_uniforms([7], 20_000)[0]
    for temperature in (1.0, 0.5):
        tok = sample_tokens(z.expand(len(u), -1), u, temperature)
        freq = torch.bincount(tok, minlength=4).double() / len(u)
        assert_close(freq, torch.softmax(z[0].double() / temperature, -1), atol=0.015, rtol=0)


def test_token_logprobs_of_is_log_softmax_at_the_token():
    z = torch.randn(3, 11)
    tok = torch.tensor([0, 5, 10])
    assert_close(token_logprobs_of(z, tok), torch.log_softmax(z, -1)[torch.arange(3), tok])


def test_row_uniforms_depend_on_the_seed_only():
    a = row_uniforms([1, 2, 3], 5)
    assert torch.equal(a[1], row_uniforms([2], 5)[0]) and not torch.equal(a[0], a[1])


def test_prefill_groups_trade_padding_against_forwards():
    """Hand-checked: with a forward worth 48 positions, ten 5-token feeds and one 60-token feed
    are cheaper apart (48 + 50 + 48 + 60 = 206) than together (48 + 11·60 = 708); equal feeds
    stay together."""
    groups = prefill_groups([5] * 10 + [60])
    assert sorted(map(sorted, groups)) == [list(range(10)), [10]]
    assert prefill_groups([30, 30, 31]) == [[0, 1, 2]]
    assert sorted(i for g in prefill_groups([3, 90, 7, 40, 41, 2]) for i in g) == list(range(6))


# ----------------------------------------------------------------------------------------------
# The cache


def test_ragged_cache_keeps_rows_and_grows_without_losing_columns():
    """`reserve` grows the buffers, `keep` selects rows, `copy_row` copies one: the data a row
    held stays where it was, and the columns after the kept width are zeros."""
    cache = RaggedCache(num_layers=1, rows=3, capacity=8)
    layer = cache.layers[0]
    layer.keys_buf = torch.arange(3 * 2 * 8 * 4, dtype=torch.float).view(3, 2, 8, 4)
    layer.values_buf = -layer.keys_buf.clone()
    layer.is_initialized = True
    before = layer.keys_buf.clone()
    cache.filled = 8
    cache.reserve(300)
    assert cache.capacity >= 300 and layer.keys_buf.shape == (3, 2, cache.capacity, 4)
    assert torch.equal(layer.keys_buf[:, :, :8], before)
    cache.keep([2, 0], width=5)
    assert torch.equal(layer.keys_buf[:, :, :5], before[[2, 0], :, :5])
    assert layer.keys_buf[:, :, 5:].abs().sum() == 0 and cache.rows == 2
    cache.copy_row(0, [1], width=5)
    assert torch.equal(layer.values_buf[1, :, :5], -before[2, :, :5])


# ----------------------------------------------------------------------------------------------
# Decoding


def test_greedy_decoding_equals_generate(policy):
    """Greedy completions of a ragged batch equal `generate`'s (left-padded, batched), token for
    token, with the same stop at the end-of-turn token."""
    model, tok = policy
    prompts = [prompt(tok, r) for r in REQUESTS]
    outs = Engine(model).generate(prompts, params(tok, temperature=0.0), [0] * len(prompts))
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=40, do_sample=False,
            pad_token_id=pad, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    for o, row in zip(outs, seq[:, width:].tolist(), strict=True):
        n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        assert o.tokens == row[:n]
        assert o.finish == ("eos" if row[n - 1] == tok.eos_token_id else "length")


def test_logprobs_equal_a_teacher_forced_recompute_across_turns(policy):
    """Each row runs three requests; each request's prompt extends the last one's prompt and
    completion (prefix reuse), and every recorded log-prob equals a no-cache forward's (≤ 1e-4),
    so the cache always held exactly the prompt it was given."""
    model, tok = policy
    engine = Engine(model)
    history: dict[int, list[dict]] = {i: [] for i in range(len(REQUESTS))}
    seen: list[tuple[list[int], list[int], list[float]]] = []
    asked: dict[int, list[int]] = {}

    def ask(i: int) -> tuple[list[int], int]:
        asked[i] = prompt(tok, REQUESTS[i], history[i])
        return asked[i], 100 * i + len(history[i])

    def done(i, c):
        seen.append((asked[i], c.tokens, c.logprobs))
        text = tok.decode(c.tokens, skip_special_tokens=True)
        history[i] += [{"role": "assistant", "content": text}, {"role": "tool", "content": "ok"}]
        return ask(i) if len(history[i]) < 6 else None

    engine.serve([Request(i, *ask(i)) for i in range(len(REQUESTS))], params(tok), done)
    assert len(seen) == 3 * len(REQUESTS)
    for p, tokens, lps in seen:
        assert_close(torch.tensor(lps), recompute(model, p, tokens), atol=1e-4, rtol=0)
    full = sum(len(p) for p, _, _ in seen)
    assert engine.stats.prefill_real < full / 2  # later turns read only their new tokens


def test_a_row_samples_the_same_tokens_whatever_its_batch(policy):
    """Seeded sampling is per row: five rows served together (ending at different turns) give
    each row exactly the tokens it gets when served alone."""
    model, tok = policy

    def play(keys):
        got: dict[int, list[list[int]]] = {k: [] for k in keys}

        def done(i, c):
            got[i].append(c.tokens)
            turns = len(got[i])
            if turns >= 1 + i % 3:  # rows end after 1, 2 or 3 turns
                return None
            reply = [{"role": "assistant", "content": tok.decode(c.tokens, skip_special_tokens=True)},
                     {"role": "user", "content": "Okay."}]  # fmt: skip
            return prompt(tok, REQUESTS[i], reply * turns), 10 * i + turns

        reqs = [Request(i, prompt(tok, REQUESTS[i]), 10 * i) for i in keys]
        Engine(model).serve(reqs, params(tok, temperature=1.0, top_p=0.95), done)
        return got

    together = play(range(len(REQUESTS)))
    assert len({len(v) for v in together.values()}) == 3
    for i in range(len(REQUESTS)):
        assert together[i] == play([i])[i]


def test_static_decode_the_cuda_graph_path_gives_the_same_tokens(policy):
    """`static=True` (full-capacity views, a fixed batch: what a CUDA graph replays) samples the
    same tokens as the default path."""
    model, tok = policy
    prompts = [prompt(tok, r) for r in REQUESTS]
    p = params(tok, temperature=1.0)
    a = Engine(model).generate(prompts, p, list(range(5)))
    b = Engine(model, static=True).generate(prompts, p, list(range(5)))
    assert [o.tokens for o in a] == [o.tokens for o in b]
    for x, y in zip(a, b, strict=True):
        assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_budget_and_stop_strings_end_a_completion(policy):
    """A completion that hits `max_new_tokens` is `length` (truncated); a stop string ends it at
    the token that completes it (`stop`, not truncated); the row's next request still works."""
    model, tok = policy
    prompts = [prompt(tok, r) for r in REQUESTS]
    short = Engine(model).generate(prompts, params(tok, max_new_tokens=2), [1] * 5)
    assert all(len(o.tokens) <= 2 for o in short)
    assert all(o.truncated == (o.finish == "length") for o in short)
    assert any(o.finish == "length" for o in short)
    free = Engine(model).generate(prompts, params(tok, temperature=0.0), [0] * 5)
    stop = next(o for o in free if len(o.tokens) > 3)
    text = tok.decode(stop.tokens[:3])
    piece = text[-2:]
    cut = Engine(model).generate(
        prompts, params(tok, temperature=0.0, stop_strings=[piece]), [0] * 5, tokenizer=tok
    )
    o = cut[free.index(stop)]
    assert o.finish == "stop" and not o.truncated
    assert piece in tok.decode(o.tokens) and piece not in tok.decode(o.tokens[:-1])
    assert o.tokens == stop.tokens[: len(o.tokens)]


def test_a_long_dialogue_keeps_its_cache_over_twenty_turns(policy):
    """A synthetic long dialogue (20 requests, ~1,000 tokens of context): the last turn's
    log-probs still equal a teacher-forced recompute, and the prefill read each token once."""
    model, tok = policy
    engine = Engine(model)
    history: list[dict] = []
    last: dict = {}
    news = "thai: Tofu Satay (9$, 15min, veg); Green Curry (12$, 20min)"

    def done(_key, c):
        history.extend([
            {"role": "assistant", "content": tok.decode(c.tokens, skip_special_tokens=True)},
            {"role": "tool", "content": news},
        ])  # fmt: skip
        last.update(tokens=c.tokens, logprobs=c.logprobs)
        if len(history) >= 40:
            return None
        last["prompt"] = prompt(tok, REQUESTS[0], history)
        return last["prompt"], len(history)

    last["prompt"] = prompt(tok, REQUESTS[0])
    engine.serve([Request(0, last["prompt"], 0)], params(tok, max_new_tokens=12), done)
    assert len(history) == 40 and len(last["prompt"]) > 800
    got = torch.tensor(last["logprobs"])
    assert_close(got, recompute(model, last["prompt"], last["tokens"]), atol=1e-4, rtol=0)
    assert engine.stats.prefill_real <= len(last["prompt"]) + len(last["tokens"])


def test_shared_prompts_are_read_once(policy):
    """Rows that share a prompt (a GRM's samples) prefill it once and still sample apart."""
    model, tok = policy
    p = prompt(tok, REQUESTS[1])
    engine = Engine(model)
    outs = engine.generate([p] * 6, params(tok, temperature=1.0), list(range(6)))
    assert engine.stats.prefill_real == len(p)
    assert len({tuple(o.tokens) for o in outs}) > 1
    for o in outs:
        assert_close(torch.tensor(o.logprobs), recompute(model, p, o.tokens), atol=1e-4, rtol=0)


def test_decode_stats_count_the_attention_width_and_what_fills_it(policy):
    """Every decode step reads the batch's widest row for every row: the columns read are rows ×
    width, those holding tokens each row's own length — equal for one row, fewer for rows of
    different lengths."""
    model, tok = policy
    short, long = prompt(tok, REQUESTS[2]), prompt(tok, REQUESTS[3], [
        {"role": "assistant", "content": "Indian it is. Any allergies I should know about?"},
        {"role": "user", "content": "None at all, thank you."}])  # fmt: skip
    alone = Engine(model)
    alone.generate([short], params(tok, max_new_tokens=8), [0])
    s = alone.stats
    assert s.decode_steps > 0 and s.decode_filled == s.decode_cols == sum(
        len(short) + t + 1 for t in range(s.decode_steps)
    )
    both = Engine(model)
    both.generate([short, long], params(tok, max_new_tokens=8), [0, 1])
    s = both.stats
    assert s.decode_rows > s.decode_steps  # some steps carried both rows
    assert s.decode_filled < s.decode_cols <= s.decode_rows * (len(long) + s.decode_steps)


# ----------------------------------------------------------------------------------------------
# Which models; LoRA


def micro_model(tok, **config):
    from kitchen.models import TinyModelConfig, build_tiny_model

    small = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=32, max_positions=128)  # fmt: skip
    model = build_tiny_model(tok, small)
    for k, v in config.items():
        setattr(model.config, k, v)
    return model


def test_unsupported_names_its_reason(policy):
    """Sliding-window layers, generation processors the engine lacks, and `force_generate` are
    named reasons; a plain Qwen2 passes the self-check."""
    _, tok = policy
    assert unsupported(micro_model(tok)) is None
    sliding = micro_model(tok, use_sliding_window=True, sliding_window=8,
                          layer_types=["sliding_attention"])  # fmt: skip
    assert "sliding" in unsupported(sliding)
    penalised = micro_model(tok)
    penalised.generation_config.repetition_penalty = 1.3
    assert "repetition_penalty" in unsupported(penalised)
    with force_generate():
        assert "force_generate" in unsupported(micro_model(tok))


def test_self_check_tolerance_follows_the_compute_dtype_not_the_first_parameter(policy):
    """fp32 throughout: strict. A quantised base whose matmuls run in bf16 (its norms kept in fp32,
    as QLoRA keeps them — what made an NF4 model on an H200 fall back to generate): bf16's
    tolerance, also when the config is a dict (as saved) or names no compute dtype."""
    _, tok = policy
    model = micro_model(tok)
    assert compute_dtypes(model) == {torch.float32}
    assert self_check_tolerance(model) == 1e-3
    model.config.quantization_config = {"load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16"}
    assert compute_dtypes(model) == {torch.float32, torch.bfloat16}
    assert self_check_tolerance(model) == 5e-2
    model.config.quantization_config = {"load_in_8bit": True, "load_in_4bit": False}
    assert torch.float16 in compute_dtypes(model)
    half = micro_model(tok).to(torch.bfloat16)
    assert self_check_tolerance(half) == 5e-2


def test_a_model_left_training_with_checkpointing_decodes_as_in_eval_mode(policy):
    """The GRM reviews on the policy's base right after an update, the model still in training
    mode; with gradient checkpointing transformers 5.17 then drops the cache (what broke the first
    GPU run; this test fails there without the fix, while 5.24 keeps the cache). The engine
    decodes in eval mode and hands the model back training."""
    model, tok = policy
    p = prompt(tok, REQUESTS[0])
    model.eval()
    (want,) = Engine(model).generate([p], params(tok, max_new_tokens=8), [0])
    model.gradient_checkpointing_enable()
    model.train()
    try:
        (got,) = Engine(model).generate([p], params(tok, max_new_tokens=8), [0])
        assert model.training
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert got.tokens == want.tokens
    assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def test_lora_merge_restores_the_base_exactly_and_lora_still_trains(policy):
    """Decoding with the adapter merged gives the unmerged log-probs (≤ 1e-4); afterwards the
    base weights are bit-for-bit what they were, and generate → train gives every LoRA B matrix
    a non-zero gradient."""
    _, tok = policy
    model, _ = load_model(
        ModelSpec(path=str(paths.DATA / "models" / "policy-tiny"), lora=LoraSpec(r=4, dropout=0.0))
    )
    for n, p in model.named_parameters():  # a non-zero adapter, so merging changes the weights
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    prompts = [prompt(tok, r) for r in REQUESTS[:3]]
    model.eval()
    with lora_merged(model) as merged:
        outs = Engine(model).generate(prompts, params(tok), [3, 4, 5])
    assert merged
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    for p, o in zip(prompts, outs, strict=True):
        assert_close(torch.tensor(o.logprobs), recompute(model, p, o.tokens), atol=1e-4, rtol=0)
    model.train()
    ids = torch.tensor([prompts[0] + outs[0].tokens])
    lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    (-lp.sum()).backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_qlora_trains_after_engine_decoding(policy, tmp_path):
    """nf4 + LoRA on CPU (bitsandbytes): the engine decodes (eval, no_grad — the 4-bit trap's
    trigger; no merge for 4-bit layers), then training gives the LoRA B matrices gradients."""
    pytest.importorskip("bitsandbytes")
    _, tok = policy
    spec = ModelSpec(path=str(paths.DATA / "models" / "policy-tiny"), quantization="nf4",
                     device="cpu", lora=LoraSpec(r=4))  # fmt: skip
    model, _ = load_model(spec)
    p = prompt(tok, REQUESTS[0])
    model.eval()
    with lora_merged(model) as merged:
        (out,) = Engine(model).generate([p], params(tok, max_new_tokens=6), [0])
    assert not merged
    model.train()
    ids = torch.tensor([p + out.tokens])
    lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    (-lp.sum()).backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_fresh_adapter_on_the_engine_keeps_the_base_outputs(policy):
    """A fresh LoRA adapter (B = 0) decodes exactly what the base does (greedy)."""
    model, tok = policy
    prompts = [prompt(tok, r) for r in REQUESTS[:2]]
    want = Engine(model).generate(prompts, params(tok, temperature=0.0), [0, 0])
    fresh, _ = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    fresh = add_adapter(fresh, "policy", LoraSpec(r=4)).eval()
    got = Engine(fresh).generate(prompts, params(tok, temperature=0.0), [0, 0])
    assert [o.tokens for o in got] == [o.tokens for o in want]


# ----------------------------------------------------------------------------------------------
# The GRM's review conversations run on the engine too: tests/test_grm.py checks that they
# write the same greedy lines as through `generate`.


def test_fallback_is_logged_once_with_its_reason(policy, caplog):
    """A model the engine cannot serve decodes with `generate`, and the reason is logged."""
    from kitchen.engine import fallback_reason

    _, tok = policy
    model = micro_model(tok)
    model.generation_config.no_repeat_ngram_size = 3
    with caplog.at_level(logging.WARNING, logger="kitchen.engine"):
        assert "no_repeat_ngram_size" in fallback_reason(model, "test")
        fallback_reason(model, "test")
    assert sum("no_repeat_ngram_size" in r.message for r in caplog.records) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_decode_the_same_tokens_as_eager(policy):
    """On a GPU: the graphed decode step samples the same tokens as the eager one."""
    _, tok = policy
    model, _ = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny"), device="cuda"))
    prompts = [prompt(tok, r) for r in REQUESTS]
    p = params(tok, temperature=1.0)
    graphed = Engine(model.eval(), cuda_graphs=True)
    a = graphed.generate(prompts, p, list(range(5)))
    b = Engine(model, cuda_graphs=False, static=False).generate(prompts, p, list(range(5)))
    assert graphed.stats.graphs >= 1
    assert [o.tokens for o in a] == [o.tokens for o in b]
