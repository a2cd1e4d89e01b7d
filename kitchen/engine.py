"""The decoding engine: continuous batching with KV caches that live across a dialogue's turns.

A rollout plays many short turns: the policy writes ~10 tokens, a tool or the diner answers, the
policy writes again. `generate` starts every call from nothing, so each turn re-reads the whole
conversation (an 8-turn dialogue pays its prefix eight times), every row of a batch waits for its
longest row, and its decode loop carries machinery a rollout does not use. `Engine.serve` keeps
one batch of *rows* (episodes) with their key/value states for the whole rollout:

1. **Requests.** A row starts with a request — its whole prompt (token ids) and a seed. When its
   completion ends, the caller's `on_done` sees it at once (the world steps, the guard checks)
   and answers with the row's next request or None (the episode ended). Rows do not wait for
   each other between turns; new rows are admitted while others run (`max_rows` at a time).
2. **Prefix reuse.** A request keeps the longest common prefix of its prompt and the ids whose
   K/V the row already holds, and feeds the rest — in a dialogue, the last action's end token,
   the tool or diner message and the generation prompt. Whatever differs (a re-tokenised action,
   a guard's rejected candidate) is not reused, so the model always reads exactly the prompt the
   caller gave. At least one token is fed: its logits start the completion.
3. **Prefill** of the rows that have new tokens, once a quarter of the rows wait (or nothing else
   runs), in groups of similar length (a small dynamic programme trades padding against the cost
   of one more forward), each group left-padded so that its rows' last tokens line up and
   `logits_to_keep=1` serves them. Rows that share a prompt (a GRM's samples) prefill once.
4. **Decode**: one forward for all rows, one token for each decoding row; rows waiting for their
   prefill ride along (their slot writes past their end, where nothing reads). Finished rows
   leave the batch (`index_select`) once they are a quarter of it.
5. **Sampling**: temperature, then nucleus (top-p, with transformers' exact rule), then a draw by
   inverse CDF from a uniform of the request's *own* seeded stream. The recorded log-prob of each
   token is under the untempered, unconstrained policy (docs/method.md#policy-update: the loss
   needs log π itself). An optional constraint (the GRM's review structure) masks tokens first.

The cache (`RaggedCache`) is a transformers `Cache` whose layers (`RaggedLayer`, a `DynamicLayer`)
hold `[rows, kv_heads, capacity, head_dim]` buffers and a length per row: row b's tokens fill
columns `[0, length_b)` with no holes, a token's column is its position (what RoPE sees), new
tokens are written at each row's own end, and a forward may read and write a subset of the rows.
Capacity grows geometrically (no `torch.cat` per step, which re-copies a `DynamicCache` every
token) and attention reads only the filled width. The mask goes in as a ready 4D tensor (key
column ≤ query column), which transformers uses as is.

Hardware. On a CPU the engine runs eagerly. `torch.compile` did not pay on the shipped tiny
policy (one thread, 2 cores: the whole model with dynamic shapes took 61 s to compile and then
16 ms a decode step against 9 ms eager; the engine's decode step with static shapes, 49 s and
4.2 ms against 3.6 ms; dynamo's `eager` and `aot_eager` backends, which only take the Python
out, 11 and 20 ms against 8 ms), so it is not used. A LoRA adapter is merged into its base for the
duration of a rollout where that is exact (`lora_merged`): on a CPU the adapter's extra matmuls
and Python calls more than doubled the step. On CUDA the decode step is captured as a CUDA graph
(over full-capacity views, a fixed batch: `static` mode, which CPU tests run eagerly) and replayed
until the batch changes, since there kernel launches, not arithmetic, bound a small model's step;
a capture error or a replay that disagrees with the eager step switches graphs off, with a
warning.

Which models. Any causal LM whose forward takes a 4D mask, explicit position ids, a `Cache` and
`logits_to_keep` — transformers' decoder-only models with `sdpa` or `eager` attention.
`unsupported` names the reason a model cannot be served (sliding-window or non-attention layers,
another attention kernel, generation-config processors the engine does not implement, or a failed
self-check of the engine's logits against a plain forward); callers then fall back to `generate`
and log the reason.

Departures from `generate` (transformers):
1. Every request draws from its own random stream, seeded by the caller, so a row's tokens do not
   depend on which rows share its batch (an episode sampled among 31 others equals the same
   episode sampled alone). `generate` draws a batch from one stream: with the same seeds the two
   sample different (equally distributed) tokens; greedy decoding agrees.
2. A row that ends leaves the batch and the next turn starts when its own turn ends; `generate`
   steps every row until the longest is done and pads the others.
3. A stop string ends a row at the token that completes it (its text may run on inside that
   token, as in transformers' `StopStringCriteria`); the tokens stop there, unpadded, and the
   completion is not marked truncated.
4. Only what a rollout uses is implemented (temperature, top-p, stop strings, a token-mask
   constraint). A generation config that asks for more (repetition penalty, min-p, ...) makes
   the model unsupported rather than silently ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, DynamicLayer

log = logging.getLogger("kitchen.engine")

WAIT_SHARE = 4  # prefill once 1/WAIT_SHARE of the rows wait for it (or nothing else runs)
DROP_SHARE = 4  # finished rows leave the batch once they are 1/DROP_SHARE of it
PREFILL_CHUNK = 256  # prefill positions per forward (bounds the [rows, 1, q, kv] mask)
FORWARD_COST = 48  # one more forward costs about this many prefill positions (CPU, tiny policy)
GROWTH = 256  # cache capacity is rounded up to a multiple of this many columns

_FORCE_GENERATE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "force_generate", default=False
)


@contextlib.contextmanager
def force_generate() -> Iterator[None]:
    """Within this context `unsupported` answers for every model, so rollouts and GRM reviews take
    the `generate` path — for benchmarks that compare the two paths in one process."""
    token = _FORCE_GENERATE.set(True)
    try:
        yield
    finally:
        _FORCE_GENERATE.reset(token)


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """`model` in eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def lora_merged(model: Any) -> Iterator[bool]:
    """Fold the active LoRA adapter into its base weights while decoding, W' = W + (α/r)·B·A, then
    restore the base exactly (from a saved copy, not W' − (α/r)·B·A, which would drift by a
    rounding error per rollout over a long run). Yields whether it merged.

    On a CPU a LoRA layer costs three matmuls and a few Python calls where a merged one costs one:
    the tiny policy's decode step was ~2x slower with its adapter than without. While merged,
    each LoRA layer is also swapped out of the model for its base layer, since all it would do
    is call it. It merges only
    where that is exact and safe: a peft model with one LoRA adapter (a second one — the GRM on
    the policy's base — could be switched on mid-rollout), plain floating-point `nn.Linear` base
    layers (not bitsandbytes' 4/8-bit ones, where merging re-quantises), on a CPU (on CUDA the
    graphed decode step makes the extra kernels cheap, and the copy would cost GPU memory).
    """
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        yield False
        return
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    names = list(getattr(model, "peft_config", {}))
    bases = [m.get_base_layer() for m in layers]
    ok = (
        bool(layers)
        and len(names) == 1
        and all(not m.merged for m in layers)
        and all(
            type(b) is torch.nn.Linear
            and b.weight.is_floating_point()
            and b.weight.device.type == "cpu"
            for b in bases
        )
    )
    if not ok:
        yield False
        return
    saved = [
        (b, b.weight.detach().clone(), None if b.bias is None else b.bias.detach().clone())
        for b in bases
    ]
    # merged, a LoRA layer only forwards to its base layer: put the base layer in its place for
    # the duration (peft's wrapper costs ~1 ms of Python per forward of the tiny policy)
    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            parent, _, child = name.rpartition(".")
            swaps.append((model.get_submodule(parent), child, m))
    model.base_model.merge_adapter()
    try:
        for parent, child, m in swaps:
            setattr(parent, child, m.get_base_layer())
        yield True
    finally:
        for parent, child, m in swaps:
            setattr(parent, child, m)
        model.base_model.unmerge_adapter()
        with torch.no_grad():
            for b, w, bias in saved:
                b.weight.copy_(w)
                if bias is not None:
                    b.bias.copy_(bias)


# --------------------------------------------------------------------------------------------
# Sampling: pure functions


def top_p_remove(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens nucleus sampling removes, with transformers' `TopPLogitsWarper` rule.

    Sort the (tempered) logits z [B, V] ascending, take the cumulative softmax c; a token is removed
    when c ≤ 1 − top_p, except the most likely one, which is always kept. Returns bool [B, V].
    """
    sorted_z, order = torch.sort(z, dim=-1)  # [B, V] ascending
    cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    remove = cum <= 1 - top_p
    remove[..., -1] = False
    return remove.scatter(-1, order, remove)


def sample_tokens(
    logits: torch.Tensor,
    u: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: greedy (`temperature` 0) or a draw by inverse CDF.

    With z = logits / T (logits [B, V] float, disallowed tokens at −∞) and top-p's removals at −∞,
    p = softmax(z) and C_i = Σ_{j ≤ i} p_j, the token is the first i with C_i > u · C_V, for the
    row's uniform u ∈ [0, 1) ([B], float64) — a draw from p (tokens with p = 0 are never hit).
    `allowed` (bool [B, V], optional) is a constraint applied before anything else. Returns [B].
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits / temperature
    if top_p < 1.0:
        z = z.masked_fill(top_p_remove(z, top_p), float("-inf"))
    cdf = torch.softmax(z, dim=-1).double().cumsum(dim=-1)  # [B, V]
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]  # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=z.shape[-1] - 1)


def token_logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log π(token) = z[token] − logsumexp(z) under the raw logits z [B, V]; returns [B] float32."""
    z = logits.float()
    return z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def row_uniforms(seeds: Sequence[int], n: int) -> torch.Tensor:
    """[len(seeds), n] float64 uniforms: row r's come from a CPU generator seeded with seeds[r]."""
    out = torch.empty(len(seeds), max(n, 1), dtype=torch.float64)
    for r, s in enumerate(seeds):
        g = torch.Generator().manual_seed(int(s) % (2**63))
        out[r] = torch.rand(max(n, 1), generator=g, dtype=torch.float64)
    return out


# --------------------------------------------------------------------------------------------
# The cache


class RaggedLayer(DynamicLayer):
    """One attention layer's K/V for rows of different lengths, in growable buffers.

    `keys_buf`, `values_buf`: [B, H, capacity, D]. The owning `RaggedCache` says where the next
    forward's tokens go (`write_rows`, `write_cols`: [b, q] buffer rows and columns), which rows
    it reads (`read_rows` [b], None: all, in order) and how many columns (`width`); `update`
    writes there and returns the first `width` columns of those rows (a view when all are read).
    """

    is_compileable = False

    def __init__(self, owner: RaggedCache):
        super().__init__()
        self.owner = owner
        self.keys_buf: torch.Tensor | None = None
        self.values_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        h, d, dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        self.keys_buf = key_states.new_zeros(o.rows, h, o.capacity, d)
        self.values_buf = value_states.new_zeros(o.rows, h, o.capacity, dv)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        # key_states [b, H, q, D] → buffer[row[b, t], :, col[b, t]] for each row b and token t
        self.keys_buf[o.write_rows, :, o.write_cols] = key_states.transpose(1, 2)
        self.values_buf[o.write_rows, :, o.write_cols] = value_states.transpose(1, 2)
        if o.read_rows is None:
            self.keys = self.keys_buf[:, :, : o.width]
            self.values = self.values_buf[:, :, : o.width]
        else:  # index_select on the view: ~6x faster than advanced indexing here
            self.keys = self.keys_buf[:, :, : o.width].index_select(0, o.read_rows)
            self.values = self.values_buf[:, :, : o.width].index_select(0, o.read_rows)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_max_length(self) -> int:
        return -1


class RaggedCache(Cache):
    """A transformers `Cache` of `RaggedLayer`s sharing one row count, capacity and write plan."""

    def __init__(self, num_layers: int, rows: int = 0, capacity: int = GROWTH):
        self.rows, self.capacity = rows, capacity
        self.width = 0
        self.filled = 0  # columns that may hold data: the widest forward so far
        self.write_rows: torch.Tensor | None = None
        self.write_cols: torch.Tensor | None = None
        self.read_rows: torch.Tensor | None = None
        super().__init__(layers=[RaggedLayer(self) for _ in range(num_layers)])

    def _buffers(self) -> Iterator[tuple[RaggedLayer, str]]:
        for layer in self.layers:
            if layer.is_initialized:
                yield layer, "keys_buf"
                yield layer, "values_buf"

    def reserve(self, capacity: int) -> None:
        """Grow every buffer to at least `capacity` columns (by half at least, in multiples of
        `GROWTH`), so a long dialogue regrows its buffers a few times, not every turn."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, int(self.capacity * 1.5))
        self.capacity = math.ceil(capacity / GROWTH) * GROWTH
        for layer, name in self._buffers():
            setattr(layer, name, _copy_into(getattr(layer, name), None, self.filled, self.capacity))

    def keep(self, rows: Sequence[int], width: int) -> None:
        """Keep only buffer rows `rows` (in that order) and their first `width` columns."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        for layer, name in self._buffers():
            old = getattr(layer, name)
            setattr(layer, name, _copy_into(old, idx.to(old.device), width, self.capacity))
        self.rows, self.filled = len(rows), width

    def add_rows(self, n: int) -> None:
        """Append `n` empty rows."""
        for layer, name in self._buffers():
            old = getattr(layer, name)
            setattr(layer, name, torch.cat([old, old.new_zeros(n, *old.shape[1:])]))
        self.rows += n

    def copy_row(self, src: int, dst: Sequence[int], width: int) -> None:
        """Rows `dst` get row `src`'s first `width` columns (samples of one prompt)."""
        for layer, name in self._buffers():
            buf = getattr(layer, name)
            buf[list(dst), :, :width] = buf[src, :, :width]


def _copy_into(
    old: torch.Tensor, rows: torch.Tensor | None, width: int, capacity: int
) -> torch.Tensor:
    """A [n, H, capacity, D] buffer holding `old`'s rows `rows` (all: None) in its first `width`
    columns and zeros after them: attention reads every column below the batch's width, masked
    or not, and masked columns must hold finite numbers (0 × NaN would poison the sum)."""
    src = old[:, :, :width] if rows is None else old[:, :, :width].index_select(0, rows)
    new = old.new_empty(src.shape[0], old.shape[1], capacity, old.shape[3])
    new[:, :, :width] = src
    new[:, :, width:].zero_()
    return new


# --------------------------------------------------------------------------------------------
# What a call asks for, and what it returns


@dataclass
class SamplingParams:
    """How the rows of one `serve` call sample."""

    max_new_tokens: int
    eos_token_id: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop_strings: Sequence[str] = ()


@dataclass
class Completion:
    """One request's answer: the generated ids (through the token that ended it), their log-probs
    under the untempered policy, and why it ended: `eos`, `stop` (a stop string) or `length`."""

    tokens: list[int]
    logprobs: list[float]
    finish: Literal["eos", "stop", "length"]

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


@dataclass
class Request:
    """A row's next completion: its whole prompt (token ids, at least one) and the seed of the
    random stream it samples from."""

    key: Hashable
    prompt: list[int]
    seed: int


# (row key, completion) -> the row's next (prompt ids, seed), or None when the row is done
OnDone = Callable[[Hashable, Completion], tuple[list[int], int] | None]
# (row key, ids generated so far) -> the token ids allowed next, or None (any)
Constraint = Callable[[Hashable, Sequence[int]], Sequence[int] | None]


@dataclass
class EngineStats:
    """Work done. `prefill_tokens` counts the positions read in prefill forwards (padding
    included), `prefill_real` the prompt tokens among them; `decode_rows` the row slots of decode
    forwards (`riders` of them rows waiting for their prefill); `decode_cols` the key columns
    their attention read (rows × the batch's width, what a decode step's attention costs) and
    `decode_filled` those that hold a row's token (the rest lie past a shorter row's end)."""

    prefill_tokens: int = 0
    prefill_real: int = 0
    prefill_forwards: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    riders: int = 0
    decode_cols: int = 0
    decode_filled: int = 0
    generated: int = 0
    graphs: int = 0


@dataclass
class _Row:
    """One row of the batch: what its cache holds and where its current request stands."""

    key: Hashable
    ids: list[int] = field(default_factory=list)  # tokens whose K/V the cache holds
    todo: list[int] = field(default_factory=list)  # prompt tokens still to feed
    u: torch.Tensor | None = None  # this request's uniforms [max_new_tokens]
    gen: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    phase: Literal["prefill", "decode", "done"] = "prefill"

    def start(self, prompt: Sequence[int], seed: int, budget: int) -> None:
        """Begin a request: keep the longest common prefix of the cache and `prompt` (at least
        one token is fed, for its logits), queue the rest."""
        if not prompt:
            raise ValueError("a request needs a prompt of at least one token")
        keep = min(_common_prefix(self.ids, prompt), len(prompt) - 1)
        del self.ids[keep:]
        self.todo = list(prompt[keep:])
        self.u = row_uniforms([seed], budget)[0]
        self.gen, self.lps, self.phase = [], [], "prefill"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefill_groups(lengths: Sequence[int], forward_cost: int = FORWARD_COST) -> list[list[int]]:
    """Partition rows into prefill forwards: indices into `lengths`, grouped.

    Each group pads its rows to its longest, so it costs `forward_cost + n_g · max_g` positions;
    over rows sorted by length the cheapest partition into runs is found by dynamic programming:
    C(j) = min_{i<j} C(i) + forward_cost + (j − i) · L_(j), with L sorted ascending.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    srt = [lengths[i] for i in order]
    best = [0.0] + [math.inf] * len(srt)
    cut = [0] * (len(srt) + 1)
    for j in range(1, len(srt) + 1):
        for i in range(j):
            c = best[i] + forward_cost + (j - i) * srt[j - 1]
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], len(srt)
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


# --------------------------------------------------------------------------------------------
# Which models the engine serves


_GENERATION_EXTRAS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "exponential_decay_length_penalty": None,
}


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _text_config(model: Any) -> Any:
    cfg = _base(model).config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _static_reason(model: Any) -> str | None:
    """Reasons visible in the model's config, before any forward."""
    base = _base(model)
    cfg = getattr(base, "config", None)
    if cfg is None or not hasattr(base, "forward"):
        return "not a transformers model"
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder model"
    text = _text_config(model)
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (only full attention is served)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "sliding-window attention"
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return f"attention implementation '{attn}' (the engine passes 4D masks: sdpa or eager)"
    params = inspect.signature(base.forward).parameters
    if "logits_to_keep" not in params:
        return "its forward takes no logits_to_keep"
    gc = getattr(base, "generation_config", None)
    for name, default in _GENERATION_EXTRAS.items():
        value = getattr(gc, name, default) if gc is not None else default
        if value is not None and value != default:
            return f"generation_config.{name}={value!r} (not implemented by the engine)"
    return None


def unsupported(model: Any) -> str | None:
    """Why the engine cannot serve `model` (None: it can). Checked once per model object: the
    config first, then a self-check that the engine's logits for two ragged rows (a prefill of
    different lengths, then one decode step) equal a plain forward's (cached on the model)."""
    if _FORCE_GENERATE.get():
        return "the generate path was asked for (kitchen.engine.force_generate)"
    cached = getattr(model, "_kitchen_engine_reason", None)
    if cached is not None:
        return cached or None
    reason = _static_reason(model) or _self_check(model)
    with contextlib.suppress(AttributeError, TypeError):
        model._kitchen_engine_reason = reason or ""
    return reason


def _self_check(model: Any) -> str | None:
    """Two ragged rows through the engine's own forwards — a prefill of different lengths, one
    token each, then one token for one row alone (a subset forward) — against plain forwards."""
    vocab = int(_text_config(model).vocab_size)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (6,), generator=g).tolist()
    b = torch.randint(0, vocab, (5,), generator=g).tolist()
    try:
        with torch.no_grad(), eval_mode(model):
            engine = Engine(model, cuda_graphs=False, static=False)
            engine._params = SamplingParams(max_new_tokens=1, eos_token_id=-1)
            rows = [_Row("a", todo=a[:4]), _Row("b", todo=b[:2])]
            cache = RaggedCache(engine.layers, rows=2)
            first = engine._feed(cache, rows, [0, 1])  # [2, V]
            rows[0].todo, rows[1].todo = a[4:5], b[2:3]
            second = engine._feed(cache, rows, [0, 1])
            rows[1].todo = b[3:4]
            third = engine._feed(cache, rows, [1])
            dev = engine.device
            ref_a = model(input_ids=torch.tensor([a[:5]], device=dev)).logits[0].float()
            ref_b = model(input_ids=torch.tensor([b[:4]], device=dev)).logits[0].float()
    except Exception as e:  # any failure means "serve it with generate", with the reason
        return f"self-check failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    got = torch.stack([first[0], second[0], first[1], second[1], third[0]]).float()
    want = torch.stack([ref_a[3], ref_a[4], ref_b[1], ref_b[2], ref_b[3]])
    scale = max(1.0, float(want.abs().max()))
    tol = self_check_tolerance(model)
    err = float((got - want).abs().max()) / scale
    if not err <= tol:
        return f"self-check: cached logits differ from a plain forward by {err:.2e} (relative)"
    return None


def compute_dtypes(model: Any) -> set[torch.dtype]:
    """The dtypes a model computes in: its floating parameters' and, for a bitsandbytes-quantised
    base, the quantisation's compute dtype (float16 where the config names none). A QLoRA model's
    first floating parameter is an fp32 norm (`prepare_model_for_kbit_training`) while its matmuls
    run in bf16, so one parameter's dtype does not say how exact its logits are."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    quant = getattr(getattr(_base(model), "config", None), "quantization_config", None)
    if quant is not None:
        get = quant.get if isinstance(quant, dict) else lambda k, d=None: getattr(quant, k, d)
        c = get("bnb_4bit_compute_dtype") if get("load_in_4bit", True) else None
        dtypes.add(getattr(torch, c) if isinstance(c, str) else (c or torch.float16))
    return dtypes


def self_check_tolerance(model: Any) -> float:
    """Relative logit error the self-check allows: 1e-3 where everything runs in fp32, else 5e-2
    (bf16 logits of a 0.5B model differ by ~1e-2 between a cached and a plain forward: measured on
    an H200 with a Qwen2.5-0.5B-shaped NF4 model, 1.41e-2)."""
    return 1e-3 if compute_dtypes(model) == {torch.float32} else 5e-2


def _plain_logits(model: Any) -> bool:
    from kitchen.models import _plain_logits as plain

    return plain(model)


def _lora_only(model: Any) -> bool:
    """No adapters, or only LoRA-family ones (which live inside the layers)."""
    configs = getattr(model, "peft_config", None) or {}
    return all(str(getattr(c, "peft_type", "")).endswith("LORA") for c in configs.values())


def _param_dtype(model: Any) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _warn_once(model: Any, reason: str, what: str) -> None:
    seen = getattr(model, "_kitchen_engine_warned", set())
    if reason in seen:
        return
    log.warning("%s: the fast engine cannot serve this model (%s); using generate", what, reason)
    seen.add(reason)
    with contextlib.suppress(AttributeError, TypeError):
        model._kitchen_engine_warned = seen


def fallback_reason(model: Any, what: str) -> str | None:
    """`unsupported(model)`, logged once per model and reason as a warning naming `what`."""
    reason = unsupported(model)
    if reason and not _FORCE_GENERATE.get():
        _warn_once(model, reason, what)
    return reason


# --------------------------------------------------------------------------------------------
# The engine


class Engine:
    """Continuous batching over one model: `serve` (requests in, completions out through a
    callback, rows kept across requests) and `generate` (one completion per prompt).

    `max_rows`: rows decoded together (more wait in a queue). `cuda_graphs`: None = on when the
    model is on CUDA. `static`: decode over the cache's full capacity (what a CUDA graph replays;
    None = with graphs) — on a CPU only to test that path. `stats` accumulates over calls.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_rows: int = 64,
        cuda_graphs: bool | None = None,
        static: bool | None = None,
    ):
        self.model = model
        self.max_rows = max_rows
        self.device = next(model.parameters()).device
        self.layers = int(_text_config(model).num_hidden_layers)
        self.vocab = int(_text_config(model).vocab_size)
        # The decoder and the output layer are called directly where logits are the output layer
        # of the last hidden state (as in `token_logprobs`): that skips the causal-LM wrappers,
        # ~1 ms of Python per forward on the tiny policy. Prompt-learning adapters (which act in
        # the wrapper) and logit soft-capping or scaling keep the whole model's forward.
        self.decoder = self.head = None
        if _plain_logits(model) and _lora_only(model):
            self.decoder = _base(model).get_decoder()
            self.head = _base(model).get_output_embeddings()
        call = self.decoder if self.decoder is not None else _base(model)
        params = inspect.signature(call.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.mask_dtype = _param_dtype(model)
        self.graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.static = self.graphs if static is None else static
        self.stats = EngineStats()
        from kitchen.models import disable_cpu_4bit_repacking

        if not getattr(model, "_kitchen_4bit_checked", False):
            disable_cpu_4bit_repacking(model)  # before the first no_grad forward (models.py)

    # -- public -------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        constraint: Constraint | None = None,
        tokenizer: Any = None,
    ) -> list[Completion]:
        """One completion per prompt (row keys are the prompts' indices)."""
        out: dict[Hashable, Completion] = {}

        def done(key: Hashable, completion: Completion) -> None:
            out[key] = completion

        requests = [
            Request(i, list(p), s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
        ]
        self.serve(requests, params, done, constraint=constraint, tokenizer=tokenizer)
        return [out[i] for i in range(len(prompts))]

    def serve(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        on_done: OnDone,
        *,
        constraint: Constraint | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Run `requests` (one per row; keys distinct) and every request `on_done` returns, until
        no row has one. `tokenizer` is needed to read stop strings."""
        if params.stop_strings and tokenizer is None:
            raise ValueError("serve: stop strings need the tokenizer to read the text")
        if params.max_new_tokens < 1:
            raise ValueError("serve: max_new_tokens must be at least 1")
        if len({r.key for r in requests}) != len(requests):
            raise ValueError("serve: two requests share a row key")
        self._params, self._on_done = params, on_done
        self._constraint, self._tok = constraint, tokenizer
        queue = deque(requests)
        rows: list[_Row] = []
        cache = RaggedCache(self.layers)
        self._graph = None
        # inference mode: nothing made here is used outside this call, and it skips autograd's
        # version counting on every op. Eval mode: a model left in training mode would sample
        # through dropout, and with gradient checkpointing transformers drops the cache.
        with torch.inference_mode(), eval_mode(self.model):
            while queue or rows:
                if queue and len(rows) < self.max_rows:
                    new = []
                    while queue and len(rows) + len(new) < self.max_rows:
                        r = queue.popleft()
                        new.append(_Row(r.key))
                        new[-1].start(r.prompt, r.seed, params.max_new_tokens)
                    cache.add_rows(len(new))
                    rows += new
                waiting = [p for p, r in enumerate(rows) if r.phase == "prefill"]
                decoding = [p for p, r in enumerate(rows) if r.phase == "decode"]
                if waiting and (not decoding or len(waiting) >= max(1, len(rows) // WAIT_SHARE)):
                    self._prefill(cache, rows, waiting)
                    decoding = [p for p, r in enumerate(rows) if r.phase == "decode"]
                if decoding:
                    self._decode(cache, rows, decoding)
                done = [p for p, r in enumerate(rows) if r.phase == "done"]
                if done and (
                    len(done) == len(rows) or len(done) >= max(1, len(rows) // DROP_SHARE)
                ):
                    keep = [p for p, r in enumerate(rows) if r.phase != "done"]
                    cache.keep(keep, max((len(rows[p].ids) for p in keep), default=0))
                    rows = [rows[p] for p in keep]

    # -- one forward --------------------------------------------------------------------------

    def _mask(self, cols: torch.Tensor, width: int) -> torch.Tensor:
        """[B, 1, q, width] additive attention mask: the query at column cols[b, t] reads the key
        columns ≤ it (0), not the others (the dtype's lowest value). Additive rather than boolean:
        eager attention needs it, and SDPA's CPU kernel ran ~15% faster with it (every query
        reads at least its own column, so no row is all masked)."""
        blocked = torch.arange(width, device=cols.device)[None, None, :] > cols[:, :, None]
        mask = torch.zeros(blocked.shape, dtype=self.mask_dtype, device=cols.device)
        return mask.masked_fill_(blocked, torch.finfo(self.mask_dtype).min)[:, None]

    def _forward(
        self,
        cache: RaggedCache,
        ids: torch.Tensor,
        cols: torch.Tensor,
        width: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model on ids [b, q], written at cache columns cols [b, q] of buffer rows `rows`
        (None: all, in order); logits after the last position [b, V]."""
        b = ids.shape[0]
        write = torch.arange(b, device=ids.device) if rows is None else rows
        cache.write_rows, cache.write_cols = write[:, None].expand_as(ids), cols
        cache.read_rows, cache.width = rows, width
        cache.filled = max(cache.filled, width)
        kwargs = {"attention_mask": self._mask(cols, width), "position_ids": cols}
        kwargs |= {"use_cache": True, self.cache_kw: cache}
        if self.decoder is not None:
            hidden = self.decoder(input_ids=ids, **kwargs).last_hidden_state[:, -1]  # [b, H]
            return self.head(hidden)
        return self.model(input_ids=ids, logits_to_keep=1, **kwargs).logits[:, -1]

    def _feed(self, cache: RaggedCache, rows: list[_Row], pos: list[int]) -> torch.Tensor:
        """Prefill rows `pos`: each its `todo` after its cached ids, left-padded into one block
        (in chunks of `PREFILL_CHUNK` positions). Returns the logits after each row's last token."""
        feeds = [rows[p].todo for p in pos]
        starts = [len(rows[p].ids) for p in pos]
        s = max(len(f) for f in feeds)
        pad = [s - len(f) for f in feeds]
        dev = self.device
        ids = torch.tensor([[0] * n + f for n, f in zip(pad, feeds, strict=True)], device=dev)
        t = torch.arange(s, device=dev)[None, :]  # [1, S]
        # row b's real tokens sit at the block's right end and fill columns start_b, start_b + 1,
        # ...; its pads go to the columns just past them, which no real query reads (key column
        # <= query column) and the row's next tokens overwrite
        cols = (
            torch.tensor(starts, device=dev)[:, None]
            + (t - torch.tensor(pad, device=dev)[:, None]) % s
        )  # [b, S]
        cache.reserve(max(starts) + s + (self._params.max_new_tokens + 1) * self.static)
        which = None if pos == list(range(len(rows))) else torch.tensor(pos, device=dev)
        logits = None
        for c in range(0, s, PREFILL_CHUNK):
            block = slice(c, min(c + PREFILL_CHUNK, s))
            width = max(starts) + block.stop
            logits = self._forward(cache, ids[:, block], cols[:, block], width, which)
            self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += len(pos) * s
        self.stats.prefill_real += sum(map(len, feeds))
        for p in pos:
            rows[p].ids += rows[p].todo
            rows[p].todo = []
        return logits

    # -- the two phases -----------------------------------------------------------------------

    def _prefill(self, cache: RaggedCache, rows: list[_Row], waiting: list[int]) -> None:
        """Prefill the waiting rows (groups of similar length; a prompt shared by rows with empty
        caches is read once and copied), then sample each row's first token."""
        first: dict[tuple, int] = {}  # shared prompt -> the row that reads it
        copies: dict[int, list[int]] = {}
        for p in waiting:
            r = rows[p]
            key = tuple(r.todo) if not r.ids else None
            if key is not None and key in first:
                copies.setdefault(first[key], []).append(p)
            else:
                if key is not None:
                    first[key] = p
                copies.setdefault(p, [])
        readers = list(copies)
        logits: dict[int, torch.Tensor] = {}
        for group in prefill_groups([len(rows[p].todo) for p in readers]):
            pos = sorted(readers[i] for i in group)
            for p, z in zip(pos, self._feed(cache, rows, pos), strict=True):
                logits[p] = z
        for src, dst in copies.items():
            if dst:
                cache.copy_row(src, dst, len(rows[src].ids))
                for p in dst:
                    rows[p].ids, rows[p].todo = list(rows[src].ids), []
                    logits[p] = logits[src]
        order = sorted(logits)
        self._sample(rows, order, torch.stack([logits[p] for p in order]))

    def _decode(self, cache: RaggedCache, rows: list[_Row], decoding: list[int]) -> None:
        """One decode forward over every row of the batch: a decoding row feeds its last token,
        any other row rides along (a pad written past its end)."""
        feed = [r.gen[-1] if r.phase == "decode" else 0 for r in rows]
        lengths = [len(r.ids) for r in rows]
        dev = self.device
        ids = torch.tensor(feed, device=dev)[:, None]
        cols = torch.tensor(lengths, device=dev)[:, None]
        cache.reserve(max(lengths) + 1)
        width = cache.capacity if self.static else max(lengths) + 1
        graph = self._graph
        if self.graphs and (graph is None or not graph.serves(cache)):
            graph = self._graph = _GraphedDecode.make(self, cache, ids, cols)
            self.stats.graphs += graph is not None
        logits = graph(ids, cols) if graph is not None else self._forward(cache, ids, cols, width)
        for p in decoding:
            rows[p].ids.append(rows[p].gen[-1])
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        self.stats.riders += len(rows) - len(decoding)
        self.stats.decode_cols += len(rows) * width
        self.stats.decode_filled += sum(lengths) + len(rows)
        self._sample(rows, decoding, logits[decoding] if len(decoding) < len(rows) else logits)

    def _sample(self, rows: list[_Row], pos: list[int], logits: torch.Tensor) -> None:
        """Sample the next token of rows `pos` from their logits [n, V]; end the requests that
        finish and start the next ones `on_done` returns."""
        params = self._params
        u = torch.stack([rows[p].u[len(rows[p].gen)] for p in pos])
        allowed = self._allowed([rows[p] for p in pos])
        tok = sample_tokens(logits.float(), u, params.temperature, params.top_p, allowed)
        lps = token_logprobs_of(logits, tok).tolist()
        for p, t, lp in zip(pos, tok.tolist(), lps, strict=True):
            r = rows[p]
            r.gen.append(t)
            r.lps.append(lp)
            self.stats.generated += 1
            finish = self._finish(r.gen)
            if finish is None and len(r.gen) >= params.max_new_tokens:
                finish = "length"
            if finish is None:
                r.phase = "decode"
                continue
            nxt = self._on_done(r.key, Completion(r.gen, r.lps, finish))
            if nxt is None:
                r.phase = "done"
            else:
                r.start(nxt[0], nxt[1], params.max_new_tokens)

    def _allowed(self, rows: list[_Row]) -> torch.Tensor | None:
        if self._constraint is None:
            return None
        lists = [self._constraint(r.key, r.gen) for r in rows]
        if all(x is None for x in lists):
            return None
        mask = torch.zeros(len(rows), self.vocab, dtype=torch.bool)
        # a list the constraint returns for many rows (the GRM's grammar has a few) becomes a
        # row of the mask once per step
        built: dict[int, torch.Tensor] = {}
        for i, x in enumerate(lists):
            if x is None:
                mask[i] = True
                continue
            row = built.get(id(x))
            if row is None:
                row = torch.zeros(self.vocab, dtype=torch.bool)
                row[torch.as_tensor(list(x), dtype=torch.long)] = True
                built[id(x)] = row
            mask[i] = row
        return mask.to(self.device)

    def _finish(self, gen: list[int]) -> str | None:
        params = self._params
        if gen[-1] == params.eos_token_id:
            return "eos"
        if params.stop_strings:
            text = self._tok.decode(gen)
            before = len(self._tok.decode(gen[:-1]))
            for s in params.stop_strings:
                if text.find(s, max(0, before - len(s) + 1)) != -1:
                    return "stop"
        return None


# --------------------------------------------------------------------------------------------
# CUDA graphs (CUDA only; the static shapes they replay are exercised on CPU by `static=True`)


@dataclass
class _GraphedDecode:
    """The decode forward of one batch, captured as a CUDA graph: fixed rows, full capacity.
    Valid while the cache's buffers stay the same tensors (no rows added or dropped, no
    regrowth)."""

    graph: Any
    ids: torch.Tensor
    cols: torch.Tensor
    logits: torch.Tensor
    buffers: tuple
    fresh: bool = True

    def serves(self, cache: RaggedCache) -> bool:
        now = _buffers_of(cache)
        return len(now) == len(self.buffers) and all(
            a is b for a, b in zip(now, self.buffers, strict=True)
        )

    @classmethod
    def make(cls, engine: Engine, cache: RaggedCache, ids: torch.Tensor, cols: torch.Tensor):
        """Capture the step for (ids, cols) and check a replay against the eager step; on any
        failure switch graphs off for the engine (with a warning) and return None."""
        if engine.device.type != "cuda" or not torch.cuda.is_available():
            engine.graphs = False
            return None
        ids, cols, width = ids.clone(), cols.clone(), cache.capacity
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up, as capture requires: the real step
                eager = engine._forward(cache, ids, cols, width).float()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = engine._forward(cache, ids, cols, width)
            graph.replay()  # the same step again: the same writes, so the same logits
            if not torch.allclose(logits.float(), eager, atol=5e-2, rtol=5e-2):
                raise RuntimeError("the graphed decode step disagrees with the eager one")
        except Exception as e:  # noqa: BLE001 - any failure: stay eager, and say why
            log.warning("kitchen.engine: CUDA graphs off (%s: %s)", type(e).__name__, e)
            engine.graphs = False
            return None
        return cls(graph, ids, cols, logits, _buffers_of(cache))

    def __call__(self, ids: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if self.fresh:  # the capture step already computed this one
            self.fresh = False
            return self.logits.clone()
        self.ids.copy_(ids)
        self.cols.copy_(cols)
        self.graph.replay()
        return self.logits.clone()


def _buffers_of(cache: RaggedCache) -> tuple:
    """The buffer tensors themselves (held, so that their memory, which the graph reads and
    writes, cannot be reused while the graph lives)."""
    return tuple(getattr(layer, name) for layer, name in cache._buffers())
