"""Models: the tiny policy the kit trains itself, any Hugging Face causal LM, LoRA/QLoRA adapters.

The kit needs two kinds of model behind one interface (docs/method.md#cold-start):

- **The embedded default** (the cold start): a byte-level BPE tokenizer trained here with the
  `tokenizers` library and a Qwen2-style causal LM of about 2M parameters built from
  `TinyModelConfig`, random-initialised, then taught by `kitchen.sft` on synthetic concierge
  dialogues. It trains SFT and runs RL on 2 CPU cores.
- **Any Hugging Face causal LM** named by a `ModelSpec`: a local checkpoint folder (the kit's own
  tiny checkpoints live in `data/models/<name>/`) or a hub name where the machine has access, in
  bf16/fp32 or quantised (4-bit NF4 QLoRA, or int8) with bitsandbytes, with a LoRA adapter from
  peft (Hu et al. 2021, "LoRA"; Dettmers et al. 2023, "QLoRA").

One GPU holds one copy of the weights: the policy and the GRM are two named LoRA adapters on one
shared (optionally 4-bit) base (`add_adapter`, `use_adapter`), and the KL reference is that base
with every adapter switched off (`adapters_disabled`). `token_logprobs` is the one place where
per-token log-probabilities and entropies are computed, for rollouts and for training alike.

The chat format is ChatML, fixed because other modules parse it: each message renders as
`<|im_start|>{role}\\n{content}<|im_end|>\\n`; the generation prompt is `<|im_start|>assistant\\n`, and
in the kit's own template the assistant header carries the diner's style
(`<|im_start|>assistant brief hurried\\n`, `profile_tag`);
`<|im_end|>` is the eos token (generation stops there) and `<|endoftext|>` pads. Each assistant
message's content *and its* `<|im_end|>` sit inside `{% generation %}` markers, so TRL's
assistant-only loss teaches the model to stop (the newline after it is not the model's to emit).

The CPU 4-bit trap (measured on these machines): on CPUs with AVX512-BF16, bitsandbytes' `Linear4bit` repacks its
weights for a fast CPU kernel the first time it runs in eval mode under `no_grad` — e.g. the first
`generate` of a rollout — and that packed layout breaks every later training backward (LoRA
gradients come back `None`, or the backward raises). `disable_cpu_4bit_repacking` switches the
repacking off on every `Linear4bit` (and unpacks any layer already packed); `load_model` and
`load_adapter` call it before any forward, and `token_logprobs` checks once per model in case a
model was built elsewhere. `tests/test_models.py` runs generate → train and asserts non-zero LoRA
gradients.

Departures and choices:
1. The tiny model is Qwen2 (not Llama) because Qwen2's ChatML conventions (eos `<|im_end|>`, pad
   `<|endoftext|>`, no BOS) are the chat format above; its q/k/v biases cost a few hundred
   parameters. Embeddings are tied: at this size the embedding matrix is a fifth of the model.
2. The tokenizer's pipeline (NFC normalisation, Qwen2's split regex — digits one at a time —,
   byte-level symbols) is Qwen2's, not GPT-2's: transformers 5 loads any tokenizer saved beside a
   `qwen2` config as `Qwen2Tokenizer`, which rebuilds the pipeline from vocab and merges with
   those components. Training with the same ones makes the tokenizer identical however it is
   loaded. Special tokens are stripped from the texts before the merges are learnt, so no
   vocabulary is spent on fragments such as `<|` or `im_`.
3. `dtype: auto` means bf16 on a CUDA GPU that supports it and float32 elsewhere — not "the
   checkpoint's dtype" as in transformers — because bf16 training on CPU is slow and lossy.
4. A folder that holds a peft adapter (`adapter_config.json`, e.g. the `final/` of a LoRA SFT run)
   loads its base from `base_model_name_or_path`, with this spec's dtype and quantisation, and then
   the adapter, trainable. That keeps "a path is a model" true for LoRA runs too.
5. `token_logprobs` passes `position_ids` derived from the attention mask, so left-padded rows get
   the positions they would have alone (what `generate` does); for RoPE models the offset would
   cancel anyway, but absolute-position models need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from kitchen.config import KitchenError, StrictModel

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2ForCausalLM

# ----------------------------------------------------------------------------------------------
# The chat format

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2 in a tokenizer trained here
ROLES = ("system", "user", "assistant", "tool")

#: Where the world's system prompt shows the diner's profile (`kitchen.world.system_prompt`).
PROFILE_MARK = "Diner: "
#: The profile fields the assistant header repeats: the style ones (`profile_tag` says why).
HEADER_FIELDS = ("verbosity", "pace")

# Jinja, as transformers renders it. `tool_calls` is ignored on purpose: `content` always holds the
# raw action text the policy produced (e.g. `@search thai`), which is what the tiny model learns.
# The assistant header repeats the diner's style from the system message (`profile_tag`),
# outside the `{% generation %}` markers: the model reads it, it is never trained to write it.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(head='<|im_start|>assistant\\n') %}"
    "{%- if messages and messages[0]['role'] == 'system' and '"
    + PROFILE_MARK
    + "' in messages[0]['content'] %}"
    "{%- set line = messages[0]['content'].split('"
    + PROFILE_MARK
    + "')[-1].split('\\n')[0].strip().rstrip('.') %}"
    "{%- set ns.head = '<|im_start|>assistant' %}"
    "{%- for field in line.split(', ') %}{%- set kv = field.split('=') %}"
    "{%- if kv | length == 2 and kv[0] in " + repr(list(HEADER_FIELDS)) + " %}"
    "{%- set ns.head = ns.head + ' ' + kv[1] %}{%- endif %}{%- endfor %}"
    "{%- set ns.head = ns.head + '\\n' %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- ns.head }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- ns.head }}{%- endif %}"
)


def profile_tag(messages: Sequence[dict[str, Any]]) -> str | None:
    """The diner's style as the assistant header repeats it: the values of the `HEADER_FIELDS`
    among the `key=value` fields after `PROFILE_MARK` in a leading system message (up to its end
    of line, without the closing full stop), space-separated in the order shown — `brief hurried`
    for `Diner: verbosity=brief, pace=hurried, diet=any, allergies=egg.` None where there is no
    such message (the GRM's prompts, any other chat).

    Why the header repeats it: a meal's dialogue runs to ~1,000 tokens, and a 4-layer policy that
    saw the profile only at the top of it learnt nothing of the data's verbosity rule (brief
    diners got the longest messages: 13.1 words on held-out meals, detailed ones 11.8). In the
    header the style is two tokens from every action. Only the style: with the whole profile
    repeated (diet and allergies too) the policy broke the allergen red line more often on
    held-out diners (A1 violated in 28% of allergic diners' turns against 21%) — an allergy list
    it never saw in training sat next to every action. A model whose own template lacks this
    still reads the system message."""
    if not messages or messages[0].get("role") != "system":
        return None
    content = str(messages[0].get("content") or "")
    if PROFILE_MARK not in content:
        return None
    line = content.split(PROFILE_MARK)[-1].split("\n")[0].strip().rstrip(".")
    pairs = [field.split("=") for field in line.split(", ")]
    return " ".join(kv[1] for kv in pairs if len(kv) == 2 and kv[0] in HEADER_FIELDS)


def assistant_header(messages: Sequence[dict[str, Any]]) -> str:
    """`<|im_start|>assistant\\n`, with the profile tag before the newline where there is one."""
    tag = profile_tag(messages)
    return f"{IM_START}assistant{' ' + tag if tag else ''}\n"


def render_chat(messages: Iterable[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
    """`CHAT_TEMPLATE` in plain Python: the same text, without needing a tokenizer first.

    Used to render training dialogues before the tokenizer that will carry the template exists.
    A test asserts it equals `tokenizer.apply_chat_template(messages, tokenize=False)`.
    """
    messages = list(messages)
    head = assistant_header(messages)
    text = "".join(
        f"{head}{m['content']}{IM_END}\n"
        if m["role"] == "assistant"
        else f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n"
        for m in messages
    )
    return text + (head if add_generation_prompt else "")


_SPECIALS_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
# Qwen2's pre-tokenizer split: words with one leading non-letter (so "@search" is one piece),
# digits one by one, punctuation runs, newlines apart from what follows them.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    *,
    min_frequency: int = 2,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer on `texts`, with the ChatML specials and chat template.

    Byte-level means every string — any language, emoji, invalid-looking input — encodes without
    an unknown token; the 256 byte symbols are the initial alphabet and merges fill the rest of
    `vocab_size`. The split regex keeps a newline and the text after it in separate pre-tokens,
    so the tokens of a prompt ending in `<|im_start|>assistant\\n` plus the tokens the model
    generates equal the tokenisation of the whole text (rollouts rely on that).

    Returns a fast tokenizer with `eos_token="<|im_end|>"`, `pad_token="<|endoftext|>"`, no BOS,
    `padding_side="left"` (batched generation) and `chat_template=CHAT_TEMPLATE`. It round-trips
    through `save_pretrained` / `AutoTokenizer.from_pretrained`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise KitchenError(
            f"vocab_size {vocab_size} is below the {floor} byte symbols and special tokens; "
            "use at least 512"
        )
    # Exactly the pipeline transformers' Qwen2Tokenizer rebuilds from vocab + merges (departure 2):
    # NFC, Qwen2's split regex, byte-level symbols, no post-processor.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_SPECIALS_RE.sub("\n", t) for t in texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


# ----------------------------------------------------------------------------------------------
# The tiny model


class TinyModelConfig(StrictModel):
    """Shape of the kit's own Qwen2-style model. The defaults give 1,969,088 parameters with a
    2,048-token vocabulary (embedding 393,216 tied with the output layer; 4 blocks of 393,920):
    about 7k tokens/s of SFT on 2 CPU cores, so ~1M tokens of dialogue is a ~2-minute epoch."""

    hidden_size: int = Field(
        192,
        ge=16,
        description="Width of the residual stream. 192 with 4 layers is ~2M parameters, "
        "which trains at ~7k tokens/s on 2 CPU cores (measured).",
    )
    num_layers: int = Field(
        4,
        ge=1,
        description="Transformer blocks. 4: the rest of the ~2M-parameter CPU budget.",
    )
    num_heads: int = Field(
        6,
        ge=1,
        description="Attention heads; hidden_size / num_heads is the "
        "head dimension (32 by default), which must be even for RoPE.",
    )
    num_kv_heads: int = Field(
        2,
        ge=1,
        description="Key/value heads (grouped-query attention, as "
        "in Qwen2); must divide num_heads. 2: smaller KV cache in rollouts.",
    )
    intermediate_size: int = Field(
        512,
        ge=1,
        description="Width of the SwiGLU MLP. 512 ≈ 2.7× "
        "hidden_size, close to the usual 8/3 ratio.",
    )
    max_positions: int = Field(
        1024,
        ge=16,
        description="Longest sequence in tokens (RoPE has no "
        "position parameters, so this only bounds use). Dialogues run ~300.",
    )
    tie_embeddings: bool = Field(
        True,
        description="Share the input embedding with the output "
        "layer: saves vocab × hidden parameters, a fifth of the model.",
    )
    rope_theta: float = Field(
        10_000.0, gt=0, description="RoPE base. 10,000 is ample for 1k positions."
    )

    @model_validator(mode="after")
    def _shapes(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "pick num_heads that divides it"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head dimension hidden_size / num_heads must be even for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )
        return self

    def parameter_count(self, vocab_size: int) -> int:
        """Exact parameter count of `build_tiny_model` for a vocabulary of `vocab_size`."""
        h, i = self.hidden_size, self.intermediate_size
        kv = (h // self.num_heads) * self.num_kv_heads
        attn = (h * h + h) + 2 * (h * kv + kv) + h * h  # q (bias), k, v (bias), o (no bias)
        block = attn + 3 * h * i + 2 * h  # SwiGLU gate/up/down + two RMSNorms
        head = 0 if self.tie_embeddings else vocab_size * h
        return vocab_size * h + self.num_layers * block + h + head


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig | None = None, *, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for `tokenizer` (vocab = `len(tokenizer)`).

    The eos (`<|im_end|>`), pad and bos (`<|endoftext|>`, Qwen's convention; no BOS is inserted)
    ids are set on both the model config and its generation config, so `generate` stops at the end
    of an assistant turn. Initialisation draws from a private RNG seeded with `seed`: the same
    seed gives the same weights without disturbing the caller's random state.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = config or TinyModelConfig()
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    qc = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(qc)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = pad
    return model


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (4-bit weights count as stored, i.e. half their logical size)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ----------------------------------------------------------------------------------------------
# Loading any causal LM


class LoraSpec(StrictModel):
    """A LoRA adapter (Hu et al. 2021): `W + (alpha / r) · B A`, with B initialised to zero."""

    name: str = Field(
        "policy",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Adapter name on the shared base ('policy', 'grm'). Default 'policy'.",
    )
    r: int = Field(
        16,
        ge=1,
        le=1024,
        description="Rank. 16: QLoRA found the rank mattered little once every linear "
        "layer is adapted; 16 is a common middle.",
    )
    alpha: float = Field(
        32.0, gt=0, description="Scale numerator; alpha / r = 2 is the common choice."
    )
    dropout: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Dropout on the adapter input. 0.05: QLoRA used 0.05-0.1.",
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Which linear layers get an adapter: 'all-linear' (every linear "
        "layer but the output head, QLoRA's recommendation) or a list of module names such as "
        "['q_proj', 'v_proj'].",
    )
    path: str | None = Field(
        None,
        description="Start from the adapter saved in this folder (peft format) instead of "
        "a fresh one. Default none: a fresh adapter, identical to the base at step 0.",
    )


def lora_config(spec: LoraSpec) -> Any:
    """`LoraSpec` → `peft.LoraConfig` for a causal LM."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )


class ModelSpec(StrictModel):
    """Which model to load and how: a folder or hub name, precision, quantisation, adapter."""

    path: str = Field(
        description="A local folder with a Hugging Face checkpoint (the kit's tiny ones live in "
        "data/models/<name>/; an SFT run's output_dir/final), a folder with a peft adapter (its "
        "base is loaded first), or a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct' where the "
        "machine can reach the hub."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Weight and compute precision. auto: bfloat16 on a CUDA GPU that "
        "supports it, float32 elsewhere (CPU bf16 is slow and lossy for training).",
    )
    quantization: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="none; nf4: 4-bit NormalFloat with double quantisation (QLoRA — "
        "needs `lora:` to train); int8: LLM.int8(). Both need bitsandbytes (`pip install "
        "'kitchen[qlora]'`). Default none: the tiny model is small enough as it is.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="Wrap the model in a LoRA adapter. Default none: the weights themselves "
        "train (right for the tiny model).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: the first CUDA GPU if there is one, else the CPU."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: one extra forward per "
        "step for much less memory. Off by default; turn on for real models on one GPU.",
    )

    @field_validator("path")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("path is empty; give a checkpoint folder or a hub name")
        return v


def resolve_device(device: Literal["auto", "cpu", "cuda"] = "auto") -> torch.device:
    """`auto` → `cuda` when a GPU is present, else `cpu`; `cuda` without a GPU is a KitchenError."""
    if device == "cuda" and not torch.cuda.is_available():
        raise KitchenError("device is 'cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (Intel AMX tiles), where a
    bfloat16 forward pass is faster than a float32 one; elsewhere it is slower. torch exposes
    the test only privately (`torch.cpu._is_amx_tile_supported`); where that is gone, False."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def bf16_is_native(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware, so that bfloat16 arithmetic is faster
    there than float32: a CUDA GPU that supports it, a CPU with AMX (`cpu_has_bf16_matmul`).
    What the `fast` settings (`GRMConfig.dtype`, `TrainConfig.autocast`) ask."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16_matmul()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`ModelSpec.dtype` → a torch dtype (see the module docstring, departure 3)."""
    if dtype == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if use_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _run_adapter(folder: Path) -> Path | None:
    """The policy adapter a training run wrote, when `folder` is a run (`runs/<name>`: its newest
    checkpoint) or one of its checkpoints (`runs/<name>/checkpoints/it-0012`); None otherwise."""
    pointer = folder / "checkpoints" / "latest"
    if pointer.is_file():
        folder = folder / "checkpoints" / pointer.read_text().strip()
    adapter = folder / "adapter"
    return adapter if (adapter / "adapter_config.json").is_file() else None


def find_checkpoint(path: str) -> tuple[str, str]:
    """Classify `path` as ('folder' | 'adapter', local folder) or ('hub', name), else raise.

    A relative path is looked up in the current folder, then in the kit's folder (so
    `data/models/tiny_policy` works from anywhere). A missing path whose first part is a local
    folder (`runs/...`, `data/...`) is a missing checkpoint, not a hub name.
    """
    from kitchen import paths

    given = Path(path).expanduser()
    roots = [Path.cwd(), paths.HOME] if not given.is_absolute() else [Path("/")]
    for p in (root / given for root in roots):
        if p.is_file() and p.name == "latest":  # a run's pointer: the run (`_run_adapter`)
            p = p.parent.parent
        if p.is_dir():
            if (p / "adapter_config.json").is_file():
                return "adapter", str(p)
            if (p / "config.json").is_file():
                return "folder", str(p)
            adapter = _run_adapter(p)
            if adapter is not None:
                return "adapter", str(adapter)
            raise KitchenError(
                f"model path {path}: the folder holds no Hugging Face checkpoint (no config.json "
                "or adapter_config.json); point at the folder that save_pretrained wrote, or at "
                "a training run (runs/<name>) or one of its checkpoints"
            )
        if p.exists():
            raise KitchenError(f"model path {path}: is a file; give the checkpoint's folder")
    first = given.parts[0] if given.parts else ""
    looks_local = path.startswith((".", "/", "~")) or any((r / first).is_dir() for r in roots)
    if _HUB_NAME.match(path) and not looks_local:
        return "hub", path
    raise KitchenError(
        f"model path {path}: no such folder. Train the tiny policy with "
        "`kitchen sft recipes/sft_tiny.yaml` (it writes runs/sft_tiny/final), use a shipped one "
        "in data/models/, or give a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def _hub_error(path: str, err: Exception) -> KitchenError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return KitchenError(
        f"model path {path}: could not load it from the Hugging Face hub ({reason}). This machine "
        f"may have no network or no access to it: download it where you can (`hf download {path} "
        "--local-dir DIR`), copy DIR here, and set path: DIR"
    )


def _bnb_config(quantization: str, compute_dtype: torch.dtype) -> Any:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise KitchenError(
            f"quantization: {quantization} needs bitsandbytes; install it with "
            "`pip install 'kitchen[qlora]'` or set quantization: none"
        ) from None
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def load_model(spec: ModelSpec) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """Load the model and tokenizer `spec` names, ready to train or generate.

    Order matters and is: quantised load (`quantization_config=`, transformers 5) →
    `prepare_model_for_kbit_training` (norms in fp32, input grads on) → LoRA wrapping (a fresh
    adapter or `spec.lora.path`) → `disable_cpu_4bit_repacking` (the CPU trap) — all before the
    first forward. The tokenizer pads on the left (for batched generation) and falls back to the
    eos token for padding when the checkpoint defines no pad token.

    A missing folder, a folder that is not a checkpoint, or a hub name the machine cannot reach
    raises `KitchenError` saying what to do instead.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, where = find_checkpoint(spec.path)
    if kind == "adapter":
        return _load_adapter_folder(spec, Path(where))
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if spec.quantization != "none":
        kwargs["quantization_config"] = _bnb_config(spec.quantization, dtype)
        kwargs["device_map"] = {"": str(device) if device.type == "cpu" else device.index or 0}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as e:
        if kind == "hub":
            raise _hub_error(spec.path, e) from None
        raise KitchenError(f"model path {spec.path}: cannot load the checkpoint: {e}") from None
    if spec.quantization == "none":
        model.to(device)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    if spec.quantization != "none":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=spec.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora is not None:
        if spec.lora.path:
            model = load_adapter(model, spec.lora.path, spec.lora.name)
        else:
            model = add_adapter(model, spec.lora.name, spec.lora)
        if spec.gradient_checkpointing:
            model.enable_input_require_grads()
    disable_cpu_4bit_repacking(model)
    return model, tokenizer


def _load_adapter_folder(spec: ModelSpec, folder: Path) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    try:
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        raise KitchenError(
            f"model path {folder}: adapter_config.json names no base_model_name_or_path; "
            "set path to the base model and lora.path to this folder"
        ) from None
    name = spec.lora.name if spec.lora else "policy"
    base_spec = spec.model_copy(
        update={"path": base, "lora": LoraSpec(name=name, path=str(folder))}
    )
    model, tokenizer = load_model(base_spec)
    if (folder / "tokenizer_config.json").is_file():  # SFT saves the tokenizer with the adapter
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def disable_cpu_4bit_repacking(model: torch.nn.Module) -> int:
    """Keep bitsandbytes from repacking 4-bit weights on CPU; return how many layers were set.

    The trap (the module docstring): `Linear4bit.forward` on a CPU with AVX512-BF16, in eval mode, with an
    input that needs no grad, converts its weight to a packed CPU layout *in place* and for good.
    After that, backward passes through the layer lose the LoRA gradients (or raise). Clearing
    `support_avx512bf16_for_cpu` before the first forward prevents the repacking; a layer that was
    already packed is converted back. Costs some CPU inference speed; GPUs are unaffected.
    """
    try:
        import bitsandbytes as bnb
        from bitsandbytes.nn import modules as bnb_modules
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            state = getattr(m.weight, "quant_state", None)
            if state is not None and getattr(state, "packing_format_for_cpu", False):
                unpack = bnb_modules._convert_weight_packed_for_cpu_inverse
                m.weight.data, m.weight.quant_state = unpack(m.weight.data, state)
            n += 1
    model._kitchen_4bit_checked = True  # token_logprobs skips the scan next time
    return n


# ----------------------------------------------------------------------------------------------
# Adapters on one shared base


def add_adapter(model: torch.nn.Module, name: str, lora: LoraSpec | None = None) -> PeftModel:
    """Add a fresh LoRA adapter called `name`; wrap a plain model in a `PeftModel` first.

    Always use the returned model. The first adapter of a plain model becomes the active one; a
    later one does not (call `use_adapter`). A fresh adapter leaves the outputs unchanged (its B
    matrix starts at zero) until it is trained.
    """
    from peft import PeftModel, get_peft_model

    spec = (lora or LoraSpec(name=name)).model_copy(update={"name": name})
    if isinstance(model, PeftModel):
        if name in model.peft_config:
            raise KitchenError(f"the model already has an adapter named '{name}'")
        model.add_adapter(name, lora_config(spec))
    else:
        model = get_peft_model(model, lora_config(spec), adapter_name=name)
    disable_cpu_4bit_repacking(model)
    return model


def use_adapter(model: PeftModel, name: str, *, trainable: bool = True) -> None:
    """Make `name` the active adapter; with `trainable`, its weights require grad and the other
    adapters' do not (peft's `set_adapter`), so an optimiser over all parameters trains only it."""
    if name not in getattr(model, "peft_config", {}):
        have = ", ".join(getattr(model, "peft_config", {})) or "none"
        raise KitchenError(f"no adapter named '{name}' on this model (adapters: {have})")
    model.set_adapter(name, inference_mode=not trainable)


def adapter_names(model: torch.nn.Module) -> list[str]:
    """Names of the adapters on `model` ([] for a plain model)."""
    return list(getattr(model, "peft_config", {}))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the shared base with every adapter off: the KL reference, with no second copy.

    A plain model (no adapters) is its own base; the context then changes nothing.
    """
    if hasattr(model, "disable_adapter") and adapter_names(model):
        with model.disable_adapter():
            yield model
    else:
        yield model


def save_adapter(model: PeftModel, name: str, folder: str | os.PathLike) -> Path:
    """Save adapter `name` (peft format: adapter_config.json + adapter_model.safetensors) into
    `folder`, replacing what was there as a whole: a crash leaves the old adapter or the new one."""
    if name not in adapter_names(model):
        raise KitchenError(f"no adapter named '{name}' to save (adapters: {adapter_names(model)})")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(tmp, selected_adapters=[name], safe_serialization=True)
        src = tmp if name == "default" else tmp / name  # peft nests non-default names
        swap_folder(src, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def swap_folder(src: Path, dst: Path) -> None:
    """Replace folder `dst` by folder `src` with two renames, so a reader (or a crash) sees the
    old folder or the new one, never a half-written one; the old one is removed afterwards."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_adapter(
    model: torch.nn.Module, folder: str | os.PathLike, name: str, *, trainable: bool = True
) -> PeftModel:
    """Load the adapter saved in `folder` onto `model` as `name`; use the returned model.

    On a plain model the adapter is wrapped in and becomes active; on a `PeftModel` it is added
    beside the others and `use_adapter` selects it.
    """
    from peft import PeftModel

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise KitchenError(
            f"adapter folder {folder}: no adapter_config.json; give a folder that save_adapter "
            "or an SFT LoRA run wrote"
        )
    if isinstance(model, PeftModel):
        if name in model.peft_config:
            raise KitchenError(f"the model already has an adapter named '{name}'")
        model.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
    else:
        model = PeftModel.from_pretrained(
            model, str(folder), adapter_name=name, is_trainable=trainable
        )
    disable_cpu_4bit_repacking(model)
    return model


# ----------------------------------------------------------------------------------------------
# Per-token log-probabilities

LOGIT_BUDGET = 2**26  # float32 logit elements per chunk (256 MB) when chunk_size is not given


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
    positions: torch.Tensor | None = None,
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token and the policy's entropy at each position.

    For row b and position t < T-1, with logits z = model(input_ids)[b, t] over the vocabulary:

        logp[b, t]    = z[input_ids[b, t+1]] - logsumexp(z)          = log π(x_{t+1} | x_≤t)
        entropy[b, t] = logsumexp(z) - Σ_v softmax(z)_v · z_v        = H(π(· | x_≤t))

    Shapes: `input_ids`, `attention_mask` [B, T] (left or right padding) → `logp`, `entropy`
    [B, T-1] float32, aligned with `input_ids[:, 1:]`. Entries whose target token is padding
    (`attention_mask[:, 1:] == 0`) are 0. Callers select action tokens with their own mask.

    Memory: rows run in chunks of `chunk_size` (default: as many as keep one chunk's float32 logits
    under `LOGIT_BUDGET` elements). The log-prob uses gather − logsumexp, so no float32
    log-softmax copy of the logits is built for the backward. The entropy is a metric
    (`policy/entropy`) and carries no gradient unless `entropy_grad=True` (an entropy bonus).
    `logp` carries gradients when grad mode is on.

    `positions` (bool [B, T-1], optional) names the only positions the caller needs (e.g. the
    action tokens of a packed dialogue): the output layer and the softmax then run on those rows
    of the final hidden states alone, and every other entry is 0. In a training update most
    positions are prompt, so this skips most of the vocabulary-sized work. Models that change
    their logits after the output layer (logit soft-capping or scaling) take the full path.

    `tree` (position ids [B, T], boolean attention [B, 1, T, T], True where a token attends)
    replaces the causal order, for sequences that hold branches (`train.unit_tree`); the model's
    attention must take a custom mask (`takes_tree`).
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    if not getattr(model, "_kitchen_4bit_checked", False):
        disable_cpu_4bit_repacking(model)
    B, T = input_ids.shape
    if chunk_size is None:
        vocab = model.get_output_embeddings().weight.shape[0]
        chunk_size = max(1, LOGIT_BUDGET // max(1, T * vocab))
    mask = attention_mask.long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: left padding starts at 0
    attend: torch.Tensor = mask  # what the attention reads: the padding, or the tree's mask
    if tree is not None:
        position_ids, attend = tree[0], _tree_mask(model, tree[1])
    if positions is not None and _plain_logits(model):
        return _selected_logprobs(
            model,
            input_ids,
            attend,
            position_ids,
            positions.bool() & mask[:, 1:].bool(),
            entropy_grad,
        )
    out_logp, out_ent = [], []
    for s in range(0, B, chunk_size):
        ids, am, pos, att = (
            input_ids[s : s + chunk_size],
            mask[s : s + chunk_size],
            position_ids[s : s + chunk_size],
            attend[s : s + chunk_size],
        )
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
        z = logits[:, :-1].float()  # [b, T-1, V]: position t predicts token t+1
        lse = torch.logsumexp(z, dim=-1)  # [b, T-1]
        logp = z.gather(-1, ids[:, 1:, None]).squeeze(-1) - lse  # [b, T-1]
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = lse - torch.einsum("btv,btv->bt", torch.softmax(z, dim=-1), z)  # [b, T-1]
        valid = am[:, 1:].bool()
        out_logp.append(logp.masked_fill(~valid, 0.0))
        out_ent.append(ent.masked_fill(~valid, 0.0))
    return torch.cat(out_logp), torch.cat(out_ent)


def takes_tree(model: torch.nn.Module) -> bool:
    """The model's attention takes a custom 4-D mask (SDPA or eager; not flash attention)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    return impl in ("sdpa", "eager")


def _tree_mask(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean [B, 1, T, T] mask as the model's attention takes it: as it is for SDPA, as an
    additive float mask (0 or the dtype's minimum) for eager attention."""
    if not takes_tree(model):
        raise ValueError(
            "packed branches need an attention that takes a custom mask (sdpa or eager); this "
            f"model uses {model.config._attn_implementation!r}"
        )
    if model.config._attn_implementation == "sdpa":
        return allowed.bool()
    dtype = getattr(model, "dtype", torch.float32)
    dtype = dtype if dtype.is_floating_point else torch.float32  # quantised weights: compute
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed.bool(), torch.finfo(dtype).min
    )


def _plain_logits(model: torch.nn.Module) -> bool:
    """True when logits = output_layer(final hidden state), with nothing applied after it."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(causal, "config", None)
    return (
        hasattr(causal, "get_decoder")
        and causal.get_output_embeddings() is not None
        and not getattr(cfg, "final_logit_softcapping", None)
        and not getattr(cfg, "logit_scale", None)
    )


def _selected_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    positions: torch.Tensor,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` at `positions` only: backbone once, output layer on the selected rows."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal.get_decoder()(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    h = hidden[:, :-1][positions]  # [n, H]: the states that predict the selected tokens
    z = causal.get_output_embeddings()(h).float()  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    lp = z.gather(-1, input_ids[:, 1:][positions][:, None]).squeeze(-1) - lse  # [n]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)  # [n]
    logp = torch.zeros(positions.shape, dtype=lp.dtype, device=lp.device).index_put(
        (positions.nonzero(as_tuple=True)), lp
    )  # [B, T-1]
    entropy = torch.zeros(positions.shape, dtype=ent.dtype, device=ent.device).index_put(
        (positions.nonzero(as_tuple=True)), ent
    )
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# Shipping a checkpoint


def export_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "float16"
) -> Path:
    """Copy the Hugging Face checkpoint in `src` to `dst` with its weights stored in `dtype`.

    The kit's shipped tiny models (`data/models/*`) are stored in float16: half the bytes of
    float32 and, unlike bfloat16, 10 mantissa bits, so the round trip moves a tiny model's weights
    by ~1e-4 relative. `load_model` reads them back in float32 on a CPU (`dtype: auto`), ready to
    train. The tokenizer and a `recipe.yaml` come along; other files already in `dst` (e.g. a
    `PROVENANCE.md`) are kept. The folder is replaced as a whole (`swap_folder`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = Path(src), Path(dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.to(
            {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        ).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if (src / "recipe.yaml").is_file():
            shutil.copy2(src / "recipe.yaml", tmp / "recipe.yaml")
        if dst.is_dir():
            for f in dst.iterdir():
                if (
                    f.is_file()
                    and not (tmp / f.name).exists()
                    and f.suffix in (".md", ".json", ".jsonl")
                ):
                    shutil.copy2(f, tmp / f.name)
        swap_folder(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def replies(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    messages: Iterable[dict[str, Any]],
    *,
    n: int = 1,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """`n` next assistant messages after chat `messages`, generated as one batch: greedy
    (`temperature` 0, so the `n` are the same) or sampled with a fixed `seed` from the whole
    distribution at `temperature` — no top-k or top-p cut, as rollouts sample. For probing what
    a policy does in a given state (notebooks, benchmarks); rollouts batch whole episodes."""
    msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs |= {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=enc["input_ids"].repeat(n, 1),
                attention_mask=enc["attention_mask"].repeat(n, 1),
                **kwargs,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
    finally:
        model.train(was_training)
    start = enc["input_ids"].shape[1]
    return [tokenizer.decode(o[start:], skip_special_tokens=True) for o in out]


def reply(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    messages: Iterable[dict[str, Any]],
    *,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """The model's next assistant message after chat `messages` (`replies` with one)."""
    return replies(
        model,
        tokenizer,
        messages,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )[0]
