"""Models: tokenizer and chat format, the tiny model, loading, adapters, log-probs, the 4-bit trap."""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from kitchen.config import KitchenError
from kitchen.models import (
    CHAT_TEMPLATE,
    IM_END,
    SPECIAL_TOKENS,
    LoraSpec,
    ModelSpec,
    TinyModelConfig,
    adapter_names,
    adapters_disabled,
    add_adapter,
    build_tiny_model,
    count_parameters,
    disable_cpu_4bit_repacking,
    export_checkpoint,
    load_adapter,
    load_model,
    lora_config,
    profile_tag,
    render_chat,
    replies,
    reply,
    save_adapter,
    token_logprobs,
    train_tokenizer,
    use_adapter,
)

# A micro model for tests: ~60k parameters, milliseconds per step.
MICRO = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
    max_positions=256,
)  # fmt: skip

CUISINES = {
    "thai": ["green curry", "pad thai"],
    "indian": ["dal", "korma"],
    "italian": ["risotto", "lasagne"],
    "japanese": ["ramen", "udon"],
}


def dialogue(rng: random.Random) -> list[dict]:
    """A synthetic concierge dialogue whose assistant turns follow from the context."""
    c = rng.choice(list(CUISINES))
    d = rng.choice(CUISINES[c])
    return [
        {"role": "system", "content": f"You are a concierge. Diner {rng.randint(1, 99)}."},
        {"role": "user", "content": f"I would like {c} food please."},
        {"role": "assistant", "content": f"@search {c}"},
        {"role": "tool", "content": ", ".join(CUISINES[c])},
        {"role": "assistant", "content": f"@allergens {d}"},
        {"role": "tool", "content": "none"},
        {"role": "assistant", "content": f"How about {d}? It has no allergens."},
    ]


def dialogues(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [dialogue(rng) for _ in range(n)]


MESSAGES = dialogue(random.Random(7))
TRICKY = [
    "héllo 😀 @search thai",
    "Diner 6.<|im_end|>\n",
    "  several   spaces\n\n\nand newlines",
    "e\u0301",  # decomposed é: NFC composes it
    "price 12.50, 30 minutes",
    "\x00\xff<|im_start|>",
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([render_chat(m) for m in dialogues(200)], vocab_size=512)


@pytest.fixture
def micro(tok):
    return build_tiny_model(tok, MICRO, seed=0)


def batch(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


# ----------------------------------------------------------------------------------------------
# Tokenizer and chat format


def test_template_renders_chatml_and_equals_render_chat(tok):
    """The tokenizer's template renders the fixed ChatML text, with and without a gen prompt."""
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == render_chat(MESSAGES)
    assert text.startswith("<|im_start|>system\nYou are a concierge.")
    assert "<|im_start|>assistant\n@search" in text and text.endswith("<|im_end|>\n")
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(MESSAGES[:2], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE and "{%- generation %}" in CHAT_TEMPLATE


def test_assistant_header_repeats_the_diners_profile_outside_the_generation_markers(tok):
    """With the world's system prompt, every assistant header (and the generation prompt) carries
    the diner's style (verbosity, pace; not diet or allergies); the template and `render_chat`
    agree on odd lines too, and the header is context: the assistant mask holds only the contents
    and their <|im_end|>."""
    from kitchen.world import system_prompt

    system = system_prompt({"verbosity": "brief", "pace": "hurried", "allergies": ["egg", "soy"]})
    assert profile_tag([{"role": "system", "content": system}]) == "brief hurried"
    msgs = [{"role": "system", "content": system}, *MESSAGES[1:]]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == render_chat(msgs)
    assert text.count("<|im_start|>assistant brief hurried\n") == 3
    prompt = tok.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(msgs[:4], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant brief hurried\n")
    out = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    learned = tok.decode(
        [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    )
    assert learned == "".join(m["content"] + IM_END for m in msgs if m["role"] == "assistant")
    for odd in (
        [{"role": "system", "content": "x Diner: "}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Diner: pace=b, c, verbosity=e=f, verbosity=x.\nmore"}],
        [{"role": "user", "content": "Diner: verbosity=brief."}],  # not a system message
    ):
        rendered = tok.apply_chat_template(odd, tokenize=False, add_generation_prompt=True)
        assert rendered == render_chat(odd, add_generation_prompt=True)
    assert render_chat(odd, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert (
        profile_tag(
            [{"role": "system", "content": "Diner: pace=b, c, verbosity=e=f, verbosity=x."}]
        )
        == "b x"
    )


def test_tokenizer_round_trips_through_save_and_auto_tokenizer(tok, micro, tmp_path):
    """Saved beside a qwen2 config (as in every checkpoint), AutoTokenizer loads a tokenizer that
    encodes, decodes, renders and masks exactly as the trained one does."""
    from transformers import AutoTokenizer

    micro.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    for s in [*TRICKY, render_chat(MESSAGES)]:
        assert back(s)["input_ids"] == tok(s)["input_ids"], s
        assert back.decode(back(s)["input_ids"]) == tok.decode(tok(s)["input_ids"])
    assert back.apply_chat_template(MESSAGES, tokenize=False) == render_chat(MESSAGES)
    a = tok.apply_chat_template(MESSAGES, return_dict=True, return_assistant_tokens_mask=True)
    b = back.apply_chat_template(MESSAGES, return_dict=True, return_assistant_tokens_mask=True)
    assert a["input_ids"] == b["input_ids"] and a["assistant_masks"] == b["assistant_masks"]
    assert (back.eos_token, back.pad_token, back.padding_side) == (IM_END, "<|endoftext|>", "left")


def test_generation_markers_cover_assistant_content_and_im_end(tok):
    """The assistant mask is exactly each assistant content plus its <|im_end|>: the model
    learns what to say and when to stop, never the diner's or the tools' text."""
    out = tok.apply_chat_template(MESSAGES, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    want = "".join(m["content"] + IM_END for m in MESSAGES if m["role"] == "assistant")
    assert learned == want
    context = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "I would like" in context and "@search" not in context


def test_prompt_tokens_are_a_prefix_of_the_dialogue_tokens(tok):
    """Tokens of a generation prompt + the reply = tokens of the rendered dialogue (rollouts
    concatenate token ids, training re-tokenises text: they must agree)."""
    prompt = tok(render_chat(MESSAGES[:2], add_generation_prompt=True))["input_ids"]
    full = tok(render_chat(MESSAGES[:3]))["input_ids"]
    assert full[: len(prompt)] == prompt
    assert tok.decode(full[len(prompt) :]) == "@search " + MESSAGES[1]["content"].split()[3] + (
        "<|im_end|>\n"
    )


def test_special_tokens_are_atomic_and_not_learnt_as_merges(tok):
    """Specials get ids 0-2 and encode as one token; no merge wastes vocabulary on their parts."""
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok("<|im_start|>user")["input_ids"][0] == 1
    fragments = [t for t in tok.get_vocab() if ("<|" in t or "|>" in t) and t not in SPECIAL_TOKENS]
    assert fragments == []
    assert len(tok) <= 512


def test_vocab_size_too_small_is_a_clear_error():
    """A vocabulary smaller than the byte alphabet cannot work; say so."""
    with pytest.raises(KitchenError, match="at least 512"):
        train_tokenizer(["abc"], vocab_size=100)


# ----------------------------------------------------------------------------------------------
# The tiny model


def test_default_tiny_model_is_about_two_million_parameters(tok):
    """`parameter_count` is exact, and the default shape is in the 1-3M range the CPU budget
    allows (1,969,088 with a 2,048-token vocabulary)."""
    cfg = TinyModelConfig()
    assert cfg.parameter_count(2048) == 1_969_088
    model = build_tiny_model(tok, cfg)
    assert count_parameters(model) == cfg.parameter_count(len(tok))
    untied = cfg.model_copy(update={"tie_embeddings": False})
    assert count_parameters(build_tiny_model(tok, untied)) == untied.parameter_count(len(tok))


def test_tiny_model_ids_and_seeded_init(tok, micro):
    """Vocab, eos, pad ids come from the tokenizer; the seed fixes the weights and leaves the
    caller's RNG alone."""
    assert micro.config.vocab_size == len(tok)
    assert micro.config.eos_token_id == tok.eos_token_id == micro.generation_config.eos_token_id
    assert micro.config.pad_token_id == tok.pad_token_id == micro.generation_config.pad_token_id
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    again = build_tiny_model(tok, MICRO, seed=0)
    assert torch.rand(1) == before  # the global RNG did not move
    other = build_tiny_model(tok, MICRO, seed=1)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(micro.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(micro.state_dict()[w], other.state_dict()[w])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"hidden_size": 100, "num_heads": 3}, "divisible"),
        ({"hidden_size": 96, "num_heads": 32}, "even"),
        ({"num_heads": 6, "num_kv_heads": 4}, "must divide"),
    ],
)
def test_tiny_config_rejects_impossible_shapes(bad, message):
    """Shapes the attention cannot use are refused with a message that says how to fix them."""
    with pytest.raises(ValueError, match=message):
        TinyModelConfig(**bad)


# ----------------------------------------------------------------------------------------------
# Log-probabilities


def test_token_logprobs_equal_log_softmax_gather_and_entropy(tok, micro):
    """logp = log_softmax(logits)[next token], entropy = -Σ p log p, 0 where the target is
    padding; chunking changes nothing; logp carries gradients, entropy does not by default."""
    ids, am = batch(tok, [render_chat(MESSAGES[:2]), render_chat(MESSAGES)])  # row 0 left-padded
    assert am[0, 0] == 0 and am[1].all()
    logp, ent = token_logprobs(micro, ids, am)
    assert logp.shape == ent.shape == (2, ids.shape[1] - 1)

    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = micro(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1]
    ls = torch.log_softmax(logits.float(), -1)
    want_logp = ls.gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_ent = -(ls.exp() * ls).sum(-1)
    valid = am[:, 1:].bool()
    assert_close(logp.detach()[valid], want_logp[valid], rtol=1e-5, atol=1e-5)
    assert_close(ent[valid], want_ent[valid], rtol=1e-5, atol=1e-5)
    assert (logp.detach()[~valid] == 0).all() and (ent[~valid] == 0).all()

    assert logp.requires_grad and not ent.requires_grad
    chunked, chunked_ent = token_logprobs(micro, ids, am, chunk_size=1)
    assert_close(chunked, logp)
    assert_close(chunked_ent, ent)
    _, ent_grad = token_logprobs(micro, ids, am, entropy_grad=True)
    assert ent_grad.requires_grad


def test_token_logprobs_match_what_generate_sampled_from(tok, micro):
    """Rollout log-probs (generate's logits) equal training log-probs (token_logprobs on the
    whole sequence), left padding included."""
    prompts = [render_chat(MESSAGES[:2], add_generation_prompt=True), render_chat(MESSAGES[:6])]
    ids, am = batch(tok, prompts)
    micro.eval()
    with torch.no_grad():
        out = micro.generate(
            input_ids=ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6, do_sample=True,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    seq, T = out.sequences, ids.shape[1]
    sampled = torch.stack(out.logits, 1).float().log_softmax(-1)  # [B, 6, V]
    want = sampled.gather(-1, seq[:, T:, None]).squeeze(-1)
    full_am = torch.cat([am, torch.ones_like(seq[:, T:])], 1)
    with torch.no_grad():
        logp, _ = token_logprobs(micro, seq, full_am)
    assert_close(logp[:, T - 1 :], want, rtol=1e-4, atol=1e-4)


def test_token_logprobs_rejects_mismatched_shapes(tok, micro):
    """Shapes are checked up front, not deep inside the model."""
    ids, am = batch(tok, ["hello"])
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_logprobs(micro, ids, am[:, :-1])


# ----------------------------------------------------------------------------------------------
# Adapters on one base


def _logits(model, ids, am):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).logits


def _train_step(model, ids, am, lr=1e-2):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    model(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def test_adapters_disabled_is_the_base_and_adapters_are_independent(tok, micro):
    """A fresh adapter equals the base; after training, the policy differs from the base while
    `adapters_disabled` (the KL reference) still is the base; training the policy leaves the GRM
    adapter untouched, and only the active adapter requires grad."""
    ids, am = batch(tok, [render_chat(MESSAGES)])
    micro.eval()
    base = _logits(micro, ids, am)
    model = add_adapter(micro, "policy", LoraSpec(r=4, dropout=0.0))
    model = add_adapter(model, "grm", LoraSpec(r=4, dropout=0.0))
    assert adapter_names(model) == ["policy", "grm"] and model.active_adapter == "policy"
    assert_close(_logits(model, ids, am), base)  # B = 0 at init

    use_adapter(model, "policy")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".policy." in n for n in trainable)
    grm_before = {n: p.clone() for n, p in model.named_parameters() if ".grm." in n}
    for _ in range(3):
        _train_step(model, ids, am)
    policy = _logits(model, ids, am)
    assert not torch.allclose(policy, base, atol=1e-4)
    with adapters_disabled(model):
        assert_close(_logits(model, ids, am), base)
    assert_close(_logits(model, ids, am), policy)  # the context restored the adapter

    assert all(torch.equal(p, grm_before[n]) for n, p in model.named_parameters() if ".grm." in n)
    use_adapter(model, "grm", trainable=False)
    assert_close(_logits(model, ids, am), base)  # the untrained GRM adapter is still the base
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(KitchenError, match="no adapter named 'judge'"):
        use_adapter(model, "judge")


def test_save_and_load_adapter_round_trip(tok, micro, tmp_path):
    """save_adapter writes peft files into the folder itself; loading them onto a fresh copy of
    the base reproduces the adapted model's outputs."""
    ids, am = batch(tok, [render_chat(MESSAGES)])
    model = add_adapter(micro, "policy", LoraSpec(r=4, dropout=0.0))
    _train_step(model, ids, am)
    want = _logits(model, ids, am)
    folder = save_adapter(model, "policy", tmp_path / "policy")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in folder.iterdir()
    }
    save_adapter(model, "policy", folder)  # overwriting replaces it whole
    fresh = build_tiny_model(tok, MICRO, seed=0).eval()
    loaded = load_adapter(fresh, folder, "policy", trainable=False)
    assert_close(_logits(loaded, ids, am), want)
    with pytest.raises(KitchenError, match="no adapter_config.json"):
        load_adapter(loaded, tmp_path, "x")


# ----------------------------------------------------------------------------------------------
# Loading


def test_load_model_reads_a_tiny_checkpoint(tok, micro, tmp_path):
    """A saved checkpoint loads through ModelSpec with the same outputs, tokenizer padding left."""
    micro.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, back = load_model(ModelSpec(path=str(tmp_path), device="cpu"))
    ids, am = batch(tok, [render_chat(MESSAGES)])
    micro.eval()
    model.eval()
    assert_close(_logits(model, ids, am), _logits(micro, ids, am))
    assert back.padding_side == "left" and back.pad_token_id == tok.pad_token_id


def test_a_training_run_or_its_checkpoint_names_its_policy_adapter(tmp_path):
    """`kitchen eval --policy runs/<name>` (or a checkpoint of it, or its `latest` pointer) finds
    the adapter the run saved: the newest checkpoint's for the run and the pointer."""
    from kitchen.models import find_checkpoint

    run = tmp_path / "run"
    for name in ("it-0003", "it-0006"):
        (run / "checkpoints" / name / "adapter").mkdir(parents=True)
        (run / "checkpoints" / name / "adapter" / "adapter_config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("it-0006\n")
    newest = str(run / "checkpoints" / "it-0006" / "adapter")
    assert find_checkpoint(str(run)) == ("adapter", newest)
    assert find_checkpoint(str(run / "checkpoints" / "latest")) == ("adapter", newest)
    older = run / "checkpoints" / "it-0003"
    assert find_checkpoint(str(older)) == ("adapter", str(older / "adapter"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(KitchenError, match="or at a training run"):
        find_checkpoint(str(tmp_path / "empty"))


def test_export_checkpoint_stores_float16_and_loads_back_in_float32(tok, micro, tmp_path):
    """The shipped-checkpoint format: half the bytes, float32 again after load_model, logits
    within float16 rounding of the original, and extra files (PROVENANCE.md) kept."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    micro.save_pretrained(src)
    tok.save_pretrained(src)
    dst.mkdir()
    (dst / "PROVENANCE.md").write_text("how it was made")
    export_checkpoint(src, dst)
    full = (src / "model.safetensors").stat().st_size
    half = (dst / "model.safetensors").stat().st_size
    assert half < 0.6 * full
    assert (dst / "PROVENANCE.md").read_text() == "how it was made"
    model, _ = load_model(ModelSpec(path=str(dst), device="cpu"))
    assert next(model.parameters()).dtype == torch.float32
    ids, am = batch(tok, [render_chat(MESSAGES)])
    micro.eval()
    model.eval()
    assert_close(_logits(model, ids, am), _logits(micro, ids, am), atol=5e-2, rtol=1e-2)


def test_reply_is_greedy_and_stops_at_the_end_of_the_turn(tok, micro):
    """`reply` returns only the new assistant text, the same text twice when greedy, and leaves
    the model's train/eval mode as it was."""
    micro.train()
    a = reply(micro, tok, MESSAGES[:2], max_new_tokens=8)
    b = reply(micro, tok, MESSAGES[:2], max_new_tokens=8)
    assert a == b and isinstance(a, str) and IM_END not in a and "<|im_start|>" not in a
    assert micro.training
    c = reply(micro, tok, MESSAGES[:2], max_new_tokens=8, temperature=1.0, seed=3)
    assert c == reply(micro, tok, MESSAGES[:2], max_new_tokens=8, temperature=1.0, seed=3)


def test_replies_sample_a_batch_from_the_whole_distribution(tok, micro):
    """`replies`: n answers in one batch, reproducible under a seed, all equal (and `reply`'s)
    when greedy; sampling keeps every token, as rollouts do (no top-k cut: transformers' default
    of 50 would leave most of the vocabulary out)."""
    greedy = replies(micro, tok, MESSAGES[:2], n=3, max_new_tokens=8)
    assert greedy == [reply(micro, tok, MESSAGES[:2], max_new_tokens=8)] * 3
    hot = {"n": 6, "max_new_tokens": 8, "temperature": 5.0}
    a = replies(micro, tok, MESSAGES[:2], seed=1, **hot)
    assert len(a) == 6 and a == replies(micro, tok, MESSAGES[:2], seed=1, **hot)
    assert len(set(a)) > 1 and a != replies(micro, tok, MESSAGES[:2], seed=2, **hot)
    calls = []
    generate = micro.generate
    micro.generate = lambda **kw: calls.append(kw) or generate(**kw)
    try:
        replies(micro, tok, MESSAGES[:2], seed=1, **hot)
    finally:
        del micro.generate
    assert calls[0]["top_k"] == 0 and calls[0]["top_p"] == 1.0


def test_load_model_errors_say_what_to_do(tok, micro, tmp_path, monkeypatch):
    """Missing folder, a folder that is no checkpoint, an unreachable hub name: KitchenError."""
    with pytest.raises(KitchenError, match="no such folder.*kitchen sft"):
        load_model(ModelSpec(path=str(tmp_path / "missing")))
    with pytest.raises(KitchenError, match="no config.json"):
        load_model(ModelSpec(path=str(tmp_path)))
    with pytest.raises(KitchenError, match="no such folder"):  # data/ is local: not a hub name
        load_model(ModelSpec(path="data/no-such-model"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    with pytest.raises(KitchenError, match="hub.*download it where you can"):
        load_model(ModelSpec(path="kitchen-test/no-such-model"))
    if not torch.cuda.is_available():
        micro.save_pretrained(tmp_path / "tiny")
        tok.save_pretrained(tmp_path / "tiny")
        with pytest.raises(KitchenError, match="no CUDA GPU"):
            load_model(ModelSpec(path=str(tmp_path / "tiny"), device="cuda"))


# ----------------------------------------------------------------------------------------------
# QLoRA on CPU and the 4-bit trap


def _lora(model, part):
    return {n: p for n, p in model.named_parameters() if f"lora_{part}" in n}


def test_qlora_on_cpu_trains_after_generate(tok, micro, tmp_path):
    """nf4 + LoRA on CPU: generate (eval, no_grad — the trap's trigger), then train: every LoRA
    weight gets a gradient, the B matrices a non-zero one, and an optimiser step moves them."""
    bitsandbytes = pytest.importorskip("bitsandbytes")
    micro.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    spec = ModelSpec(path=str(tmp_path), quantization="nf4", device="cpu", lora=LoraSpec(r=4))
    model, tk = load_model(spec)
    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)

    prompt = tk([render_chat(MESSAGES[:2], add_generation_prompt=True)], return_tensors="pt")
    model.eval()
    with torch.no_grad():
        seq = model.generate(**prompt, max_new_tokens=5, do_sample=True)
    model.train()
    loss = model(input_ids=seq, labels=seq).loss
    loss.backward()
    lora_a, lora_b = _lora(model, "A"), _lora(model, "B")
    assert lora_a and all(p.grad is not None for p in [*lora_a.values(), *lora_b.values()])
    assert all(p.grad.abs().sum() > 0 for p in lora_b.values())
    before = {n: p.detach().clone() for n, p in lora_b.items()}
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    assert all(not torch.equal(p, before[n]) for n, p in lora_b.items())


def test_cpu_4bit_trap_is_real_without_the_workaround(tok, micro, tmp_path):
    """Canary: without `disable_cpu_4bit_repacking`, generate → train breaks LoRA training on this
    CPU (backward raises, or LoRA gradients are None/zero). If this starts failing, bitsandbytes
    fixed the trap and the workaround (and this test) can go."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn.modules import has_avx512bf16
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not has_avx512bf16():
        pytest.skip("the trap needs a CPU with AVX512-BF16")
    micro.save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    raw = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=q, device_map="cpu")
    model = get_peft_model(
        prepare_model_for_kbit_training(raw, use_gradient_checkpointing=False),
        lora_config(LoraSpec(r=4)),
    )
    ids, am = batch(tok, [render_chat(MESSAGES[:2], add_generation_prompt=True)])
    model.eval()
    with torch.no_grad():
        seq = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=3)
    model.train()
    try:
        model(input_ids=seq, labels=seq).loss.backward()
    except RuntimeError:
        return  # broken: the trap is real
    grads = [p.grad for p in _lora(model, "B").values()]
    assert any(g is None or g.abs().sum() == 0 for g in grads), "trap gone: see docstring"
    assert disable_cpu_4bit_repacking(model) > 0


def test_int8_lora_trains_on_cpu(tok, micro, tmp_path):
    """int8 quantisation + LoRA loads and back-propagates into the adapter on CPU."""
    pytest.importorskip("bitsandbytes")
    micro.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, _ = load_model(
        ModelSpec(path=str(tmp_path), quantization="int8", device="cpu", lora=LoraSpec(r=4))
    )
    ids, am = batch(tok, [render_chat(MESSAGES)])
    model(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in _lora(model, "B").values())


# ----------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_bf16_lora_and_qlora_train_on_gpu(tok, micro, tmp_path, quantization):
    """On a GPU: bf16 LoRA and 4-bit QLoRA load on cuda, generate, and train the adapter; the
    disabled-adapter reference equals the base; token_logprobs runs on the device."""
    if quantization == "nf4":
        pytest.importorskip("bitsandbytes")
    micro.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    spec = ModelSpec(path=str(tmp_path), device="cuda", dtype="bfloat16",
                     quantization=quantization, lora=LoraSpec(r=4, dropout=0.0))  # fmt: skip
    model, tk = load_model(spec)
    assert next(model.parameters()).device.type == "cuda"
    ids, am = (t.cuda() for t in batch(tk, [render_chat(MESSAGES[:2], add_generation_prompt=True)]))
    model.eval()
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=am).logits
        seq = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=True)
    model.train()
    model(input_ids=seq, labels=seq).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in _lora(model, "B").values())
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    model.eval()
    with torch.no_grad(), adapters_disabled(model):
        ref = model(input_ids=ids, attention_mask=am).logits
    assert_close(ref, base)
    logp, ent = token_logprobs(model, seq, torch.ones_like(seq))
    assert logp.is_cuda and torch.isfinite(logp).all() and (ent >= 0).all()
