"""Supervised fine-tuning (the cold start): teach a policy the concierge dialogues before RL.

`kitchen sft RECIPE` reads a declarative YAML recipe (`SFTRecipe`) and trains with TRL's
`SFTTrainer` on chat data — JSONL rows of `{"messages": [{"role": ..., "content": ...}, ...]}` —
with **assistant-only loss**: only the assistant's tokens (its content and its `<|im_end|>`) are
predicted; system, user and tool tokens are context. That is what a policy must learn (what to say
and when to stop), not what the diner or the tools say.

Two starting points:

- `model.tiny`: build everything here. A tokenizer is trained on the training dialogues (rendered
  in ChatML, `kitchen.models.render_chat`), then a random-initialised Qwen2 of `TinyModelConfig`
  is trained in full. With `copy_warmup:` the fresh model first learns to copy random token
  runs (`kitchen.copying`): a model this small trained on the dialogues alone recalls dish names
  from the menu instead of copying them from the dialogue. This is how the shipped tiny policy
  is made.
- `model.base`: any Hugging Face causal LM (`ModelSpec`), usually with `lora:` (bf16 LoRA) and
  `quantization: nf4` (QLoRA) on one GPU.

What a run writes into `output_dir` (relative paths go under the runs folder, `runs/` or
`$KITCHEN_RUNS`):

    recipe.yaml        the resolved recipe (absolute paths, every default filled in)
    checkpoint-N/      HF checkpoints every `save_every` steps (safetensors, optimiser, RNG state),
                       the last `keep_checkpoints` kept; `resume=True` continues from the newest
    final/             the model (or the LoRA adapter) + tokenizer + recipe.yaml, in HF format:
                       `load_model(ModelSpec(path=".../final"))` loads it
    log.jsonl          the trainer's log: train loss, learning rate, eval loss per step
    copy_warmup/       with `copy_warmup:`, the warmed model SFT starts from, its log and what it
                       was made with; reused by a later run of the same recipe in this folder

The progress bar, the learning-rate schedule (linear warmup then cosine/linear decay), periodic
evaluation on the held-out JSONL (also once before the first step, so the report shows where the
loss started), checkpointing and resumption are the `transformers.Trainer` machinery TRL builds on.

Departures and choices:
1. Only `role` and `content` of each message are kept: the tiny chat template renders `content`
   (which always holds the raw action text) and ignores `tool_calls`, and mixed nested
   `tool_calls` would not fit one Arrow schema. Real models' own templates see the same text.
2. With a quantised base on CPU, TRL's cast of the LoRA weights to bf16 (the QLoRA paper's
   recommendation for GPUs) is undone: CPU bf16 is slow, and bf16 weights round small Adam updates
   away. On GPU TRL's choice stands.
3. A fresh run refuses an `output_dir` that already holds checkpoints, and a resumed run refuses a
   changed `model` section: either would silently mix two runs.
4. `lr: null` picks the learning rate by what is trained: 3e-3 for a tiny model from scratch (a
   2M-parameter model tolerates a large step), 2e-4 for LoRA (the QLoRA paper), 2e-5 for full
   fine-tuning of a pretrained model.
5. Assistant-only loss needs `{% generation %}` markers. The tiny template has them; for a base
   model without them TRL swaps in a marked copy of the templates it knows (Qwen, Llama, Gemma,
   …) and refuses others, which becomes a `KitchenError` saying what to give instead. We chose
   this over a fallback to full-sequence loss, which would silently train on the diner's turns.
6. A run that cannot learn stops with an error instead of training on nothing: `max_length` so
   short that every dialogue's assistant tokens are cut (TRL drops such rows), an `output_dir`
   that is a file or a shared folder (runs/ itself, the kit's, home), a "tiny" model of more
   than `MAX_TINY_PARAMETERS`, and a loss that turns NaN or infinite (before final/ is
   written, so nothing garbage is saved as a model).
7. `decision_weight` weighs the first token of each turn that follows an allergen check — the
   decision to recommend the dish or check another — above the rest (`weighted_token_loss`).
   In plain assistant-only loss that one token is under 3% of a dialogue's trained tokens, and
   the tiny policy did not fit it even on its training dialogues, while the same model trained
   on that decision alone learnt it (`benchmarks/bench_read_check.py`). The logged training
   loss is then the weighted one (larger than a plain run's); the held-out loss is never
   weighted, so it compares across runs. TRL has no per-token weight, so training at a weight
   above 1 computes its own loss (TRL's token-accuracy and entropy metrics are not logged then).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from kitchen import paths
from kitchen.config import KitchenError, Located, Problem, StrictModel, read_yaml, validate_doc
from kitchen.copying import CopyWarmup, warm_up
from kitchen.engine import token_logprobs_of
from kitchen.files import atomic_write_json, atomic_write_text, jsonl_rows, write_jsonl
from kitchen.models import (
    ROLES,
    ModelSpec,
    TinyModelConfig,
    adapter_names,
    build_tiny_model,
    find_checkpoint,
    load_model,
    render_chat,
    resolve_device,
    save_adapter,
    swap_folder,
    token_logprobs,
    train_tokenizer,
)

# ----------------------------------------------------------------------------------------------
# The recipe


class TokenizerSettings(StrictModel):
    """How the tiny model's tokenizer is trained (byte-level BPE on the training dialogues)."""

    vocab_size: int = Field(
        2048,
        ge=512,
        le=65536,
        description="Vocabulary size. 2048: the concierge world's words "
        "and action syntax fit with room to spare; a larger vocabulary mostly grows the embedding.",
    )
    min_frequency: int = Field(
        2, ge=1, description="A merge must occur this often to be learnt. 2 skips one-off strings."
    )


MAX_TINY_PARAMETERS = 100_000_000


class ModelSource(StrictModel):
    """Where the model comes from: `tiny` (built here) or `base` (a Hugging Face checkpoint)."""

    tiny: TinyModelConfig | None = Field(
        None,
        description="Build a tokenizer and a random-initialised Qwen2 of this shape and "
        "train it in full (the cold start).",
    )
    tokenizer: TokenizerSettings | None = Field(
        None, description="Tokenizer training settings for `tiny` (defaults if omitted)."
    )
    base: ModelSpec | None = Field(
        None,
        description="Fine-tune this Hugging Face causal LM: LoRA with `lora:`, QLoRA with "
        "`quantization: nf4` too, full fine-tuning with neither.",
    )
    device: Literal["auto", "cpu", "cuda"] | None = Field(
        None,
        description="Where a tiny model trains (default auto: GPU if present). A base "
        "model uses base.device instead.",
    )
    copy_warmup: CopyWarmup | None = Field(
        None,
        description="Before SFT, train the `tiny:` model to copy random token runs "
        "(kitchen.copying), so that it copies dish names from the dialogue instead of "
        "recalling the menu. Off by default; the shipped cold start uses it.",
    )
    add_tokens: list[str] = Field(
        default_factory=list,
        description="Strings a `base:` model should write as one token each from now on (e.g. "
        "the GRM's clause ids ` A1`, two tokens each in the tiny GRM's vocabulary): added to "
        "its tokenizer, the embedding grown, each new row starting as the mean of the rows of "
        "the pieces the string was cut into. Full fine-tuning only (a LoRA would leave the new "
        "rows untrained). Default none.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.tiny is None) == (self.base is None):
            raise ValueError(
                "give exactly one of `tiny:` (build a model here) or `base:` (a "
                "Hugging Face checkpoint)"
            )
        if self.base is not None and self.tokenizer is not None:
            raise ValueError("`tokenizer:` applies to `tiny:` only; a base model brings its own")
        if self.base is not None and self.device is not None:
            raise ValueError("`device:` applies to `tiny:` only; set base.device instead")
        if self.base is not None and self.copy_warmup is not None:
            raise ValueError(
                "`copy_warmup:` applies to `tiny:` only (a model trained from scratch); a "
                "pretrained base already copies"
            )
        if self.add_tokens and (self.base is None or self.base.lora is not None):
            raise ValueError(
                "`add_tokens:` needs a `base:` model trained in full (no `lora:`): the new "
                "embedding rows must train"
            )
        if self.base is not None and self.base.quantization != "none" and self.base.lora is None:
            raise ValueError("a quantised base cannot be trained in full; add base.lora (QLoRA)")
        if self.tiny is not None:
            vocab = (self.tokenizer or TokenizerSettings()).vocab_size
            n = self.tiny.parameter_count(vocab)
            if n > MAX_TINY_PARAMETERS:
                raise ValueError(
                    f"model.tiny has {n:,} parameters, more than the {MAX_TINY_PARAMETERS:,} a "
                    "model built and trained from scratch here can use; shrink it, or fine-tune "
                    "a pretrained one with `base:`"
                )
        return self


class SFTData(StrictModel):
    """Chat data: JSONL files, one `{"messages": [...]}` dialogue per line."""

    train: str = Field(
        description="Training dialogues. Relative paths are looked up in the "
        "current folder, then in the kit's folder."
    )
    eval: str | None = Field(
        None,
        description="Held-out dialogues for periodic evaluation. "
        "Default none: no evaluation (not recommended).",
    )
    max_train: int | None = Field(
        None,
        ge=1,
        description="Use only the first N training dialogues (quick runs). Default: all.",
    )
    max_eval: int | None = Field(
        256,
        ge=1,
        description="Evaluate on the first N held-out "
        "dialogues. 256 keeps an evaluation to seconds on CPU.",
    )


class SFTRecipe(StrictModel):
    """A supervised fine-tuning run, end to end. `kitchen sft RECIPE` runs one."""

    output_dir: str = Field(
        min_length=1,
        description="Where checkpoints, final/ and the log go. Relative "
        "paths are under the runs folder (runs/, or $KITCHEN_RUNS). A folder of the run's own: "
        "not a file, the runs folder itself, the kit's folder or home.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="Seeds model init, data order and dropout: same seed, same run.",
    )
    model: ModelSource = Field(
        description="What is trained: `tiny:` builds a tokenizer and a small Qwen2 here and "
        "trains it from scratch (the shipped tiny policy's cold start); `base:` fine-tunes a "
        "Hugging Face checkpoint (LoRA, QLoRA or in full). No default: say which."
    )
    data: SFTData = Field(
        description="The chat dialogues: `train` (required) and `eval` JSONL files of "
        '`{"messages": [...]}` rows, as `kitchen world sft-data` writes them to data/sft/.'
    )
    epochs: float = Field(
        3.0,
        gt=0,
        le=1000,
        description="Passes over the training data. 3: a starting point for the tiny "
        "policy; watch the held-out loss and tune.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Stop after this many optimiser steps "
        "(overrides epochs). Default: run all epochs.",
    )
    batch_size: int = Field(16, ge=1, le=1024, description="Dialogues per device step.")
    grad_accum: int = Field(
        1,
        ge=1,
        le=1024,
        description="Steps accumulated per optimiser step "
        "(effective batch = batch_size × grad_accum).",
    )
    lr: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Peak learning rate. Default null: "
        "3e-3 tiny from scratch, 2e-4 LoRA, 2e-5 full fine-tuning.",
    )
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine (default; smooth end), linear, constant."
    )
    warmup: float = Field(
        0.05,
        ge=0,
        description="Linear warmup: a fraction of all steps if "
        "below 1, else a number of steps. 5% keeps Adam's early steps small.",
    )
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    decision_weight: float = Field(
        1.0,
        ge=1,
        le=1000,
        description="Loss weight of a decision token: the first token of each assistant turn "
        "that follows a turn opening with `decision_after` (by default the turn after an "
        "allergen check: recommend the dish, or check another). 1 (default): plain "
        "assistant-only loss. Every other token keeps weight 1, the loss stays a sum over the "
        "batch's assistant tokens divided by their number, and the held-out loss is never "
        "weighted.",
    )
    decision_after: str = Field(
        "@allergens",
        min_length=1,
        description="The action whose following turn is a decision (see `decision_weight`).",
    )
    max_length: int = Field(
        1024,
        ge=16,
        description="Dialogues are cut to this many tokens "
        "(keeping the start). Concierge dialogues run ~300.",
    )
    group_by_length: bool = Field(
        False,
        description="Batch dialogues of similar length together (still shuffled in groups): "
        "about half the padding, so about twice the speed on CPU for dialogues of mixed length. "
        "Off by default: batches are then less random.",
    )
    eval_every: int = Field(100, ge=1, description="Evaluate every N optimiser steps.")
    save_every: int = Field(200, ge=1, description="Checkpoint every N optimiser steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    log_every: int = Field(10, ge=1, description="Log loss and learning rate every N steps.")

    _source: Located | None = PrivateAttr(None)  # the YAML it was read from (`load_recipe`)

    @field_validator("max_length")
    @classmethod
    def _fits(cls, v: int, info: ValidationInfo) -> int:
        model = info.data.get("model")  # validated before: it is declared first
        tiny = model.tiny if model is not None else None
        if tiny is not None and v > tiny.max_positions:
            raise ValueError(
                f"max_length {v} exceeds model.tiny.max_positions "
                f"{tiny.max_positions}; lower one or raise the other"
            )
        return v

    def problem(self, loc: tuple, message: str) -> Problem:
        """A problem at `loc` of this recipe: file and line when it was read from a file."""
        return (self._source or Located(None, "recipe")).problem(loc, message)

    def learning_rate(self) -> float:
        """The peak learning rate, `lr` or its default for what is trained (departure 4)."""
        if self.lr is not None:
            return self.lr
        if self.model.tiny is not None:
            return 3e-3
        return 2e-4 if self.model.base.lora is not None else 2e-5


SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def schema() -> dict[str, Any]:
    """JSON schema of SFT recipes (for editor completion of recipes/*.yaml)."""
    s = SFTRecipe.model_json_schema(by_alias=True)
    s["title"] = "kitchen sft recipe"
    return s


# ----------------------------------------------------------------------------------------------
# Paths and data


def _find_input(path: str) -> Path | None:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.is_file() else None
    for root in (Path.cwd(), paths.HOME):
        if (root / p).is_file():
            return (root / p).resolve()
    return None


def resolve_paths(recipe: SFTRecipe, doc: Located | None = None) -> SFTRecipe:
    """Absolute data paths and base model folder (checked to exist) and output_dir; with the
    parsed YAML `doc`, problems name the recipe's line."""
    problems, update = [], {}
    for key in ("train", "eval"):
        given = getattr(recipe.data, key)
        if given is None:
            continue
        found = _find_input(given)
        if found is None:
            msg = (
                f"no such file: {given} (looked in {Path.cwd()} and {paths.HOME}); the "
                "concierge world writes data/sft/*.jsonl, or give another JSONL file"
            )
            problems.append(
                doc.problem(("data", key), msg)
                if doc
                else Problem("recipe", None, f"data.{key}", msg)
            )
        update[key] = str(found)
    model = recipe.model
    if model.base is not None:
        try:
            kind, where = find_checkpoint(model.base.path)
        except KitchenError as e:
            loc = ("model", "base", "path")
            problems += [doc.problem(loc, p.message) if doc else p for p in e.problems]
        else:
            if kind != "hub":  # a local folder, made absolute like the data paths
                base = model.base.model_copy(update={"path": where})
                model = model.model_copy(update={"base": base})
    out = Path(recipe.output_dir).expanduser()
    out = (out if out.is_absolute() else paths.RUNS / out).resolve()
    shared = {paths.RUNS.resolve(), Path.home().resolve(), *paths.HOME.resolve().parents}
    msg = None
    if out.is_file():
        msg = f"{out} is a file"
    elif out in shared or out == paths.HOME.resolve():
        msg = f"{out} is a shared folder (the runs folder, the kit's, home or above)"
    if msg:
        msg += "; give the run a folder of its own, e.g. output_dir: my_run"
        problems.append(
            doc.problem(("output_dir",), msg) if doc else recipe.problem(("output_dir",), msg)
        )
    if problems:
        raise KitchenError(problems)
    data = recipe.data.model_copy(update=update)
    return recipe.model_copy(
        update={"data": data, "model": model, "output_dir": str(out.resolve())}
    )


def load_recipe(path: str | os.PathLike) -> SFTRecipe:
    """Read and validate a recipe; every problem is `PATH:LINE: field: what to fix`."""
    doc = read_yaml(path)
    recipe = validate_doc(SFTRecipe, doc)
    recipe._source = doc
    return resolve_paths(recipe, doc)


def read_dialogues(path: str | os.PathLike, limit: int | None = None) -> list[list[dict]]:
    """Dialogues from a JSONL file, each a list of `{"role", "content"}` messages.

    Every line must hold `{"messages": [...]}` with known roles, string contents and at least one
    assistant message (else nothing would be learnt from it); problems name the file and line.
    Other keys of a row and of a message (`tool_calls`, metadata) are dropped (departure 1).
    """
    path = Path(path)
    out: list[list[dict]] = []
    problems: list[Problem] = []
    for n, row in jsonl_rows(path, problems):
        if limit is not None and len(out) >= limit:
            break
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            problems.append(
                Problem(
                    str(path),
                    n,
                    "messages",
                    'expected {"messages": [{"role": ..., "content": ...}]}',
                )
            )
            continue
        bad = next(
            (
                i
                for i, m in enumerate(msgs)
                if not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ),
            None,
        )
        if bad is not None:
            problems.append(
                Problem(
                    str(path),
                    n,
                    f"messages[{bad}]",
                    f"needs a role in {', '.join(ROLES)} and string content",
                )
            )
            continue
        if not any(m["role"] == "assistant" for m in msgs):
            problems.append(Problem(str(path), n, "messages", "no assistant message to learn"))
            continue
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
        if len(problems) >= 20:
            break
    if problems:
        raise KitchenError(problems)
    if not out:
        raise KitchenError([Problem(str(path), None, "file", "no dialogues in the file")])
    return out


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class SFTResult:
    """What a run produced: where, and the numbers to report."""

    output_dir: Path
    final_dir: Path
    log: list[dict] = field(default_factory=list)  # the trainer's log_history rows

    @property
    def eval_losses(self) -> list[float]:
        """Held-out loss at each evaluation, the first one before any training step."""
        return [r["eval_loss"] for r in self.log if "eval_loss" in r]


def _recipe_yaml(recipe: SFTRecipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _check_output_dir(recipe: SFTRecipe, out: Path, resume: bool) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    if resume and last is None:
        raise KitchenError(f"{out}: no checkpoint to resume from; run without --resume")
    if not resume and last is not None:
        raise KitchenError(
            f"{out}: already holds a run ({Path(last).name}); resume it with "
            "--resume, or choose another output_dir"
        )
    if resume and (out / "recipe.yaml").is_file():
        saved = yaml.safe_load((out / "recipe.yaml").read_text()).get("model")
        if saved != recipe.model.model_dump(mode="json"):
            raise KitchenError(
                f"{out}: the recipe's `model` section differs from the run being "
                "resumed; restore it or start a new output_dir"
            )
    return last


def add_tokens(model: Any, tokenizer: Any, strings: Sequence[str]) -> int:
    """Make each of `strings` one token of `tokenizer` (`tokenizers.AddedToken`, matched as
    written, before the BPE) and grow `model`'s embedding (and an untied output head) to match;
    a new row starts as the mean of the rows of the pieces the string was cut into, so the
    model's first reading of it is close to its reading of the pieces. Strings that already are
    one token are skipped. Returns how many tokens were added. Deterministic: a resumed run
    rebuilds the same model before loading its checkpoint."""
    from tokenizers import AddedToken

    new = []
    for text in dict.fromkeys(strings):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > 1:
            new.append((text, ids))
    if not new:
        return 0
    added = tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t, _ in new])
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    rows = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not rows[0]:
        rows.append(head.weight)
    with torch.no_grad():
        for text, ids in new:
            for w in rows:
                w[tokenizer.convert_tokens_to_ids(text)] = w[ids].mean(0)
    return added


IGNORE = -100  # the label of a token that is context, not trained (the transformers convention)
PLAIN_BATCH = {"input_ids", "attention_mask", "labels"}  # what the kit's collated batches hold


def decision_mask(labels: torch.Tensor, after: Sequence[int]) -> torch.Tensor:
    """True at the first trained token of each assistant turn whose previous assistant turn opens
    with the token ids `after` (e.g. the turn after `@allergens DISH`: the decision it informs).

    `labels` is a `[batch, length]` tensor of token ids with `IGNORE` on context. Assistant turns
    are the maximal runs of trained labels: the context between two turns (the tool's reply, the
    next header) is never trained, so each run is one turn.
    """
    trained = labels != IGNORE
    starts = trained.clone()
    starts[:, 1:] &= ~trained[:, :-1]
    mask = torch.zeros_like(trained)
    after = list(after)
    for row in range(labels.shape[0]):
        turns = starts[row].nonzero().flatten().tolist()
        for prev, cur in itertools.pairwise(turns):
            if labels[row, prev : prev + len(after)].tolist() == after:
                mask[row, cur] = True
    return mask


def weighted_token_loss(
    logp: torch.Tensor,
    trained: torch.Tensor,
    weights: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The assistant-only loss with a weight per token:

        L = Σ_t w_t · −log π(y_t | y_<t) / N

    over the trained positions t, N their number — or `num_tokens`, the count over every
    micro-batch of a gradient-accumulation step. All weights 1: the plain loss. `logp`, `trained`
    and `weights` are `[batch, length − 1]`, aligned with the targets `labels[:, 1:]`: `logp` as
    `kitchen.models.token_logprobs` returns it, `trained` where those labels are not `IGNORE`.
    """
    n = trained.sum() if num_tokens is None else num_tokens
    return -(weights * logp * trained).sum() / torch.as_tensor(n).clamp(min=1)


def _decision_weighted(trainer_cls: type) -> type:
    """`trainer_cls` (TRL's `SFTTrainer`) whose training loss weighs decision tokens
    (`SFTRecipe.decision_weight`); evaluation, and training at weight 1, are TRL's own."""

    class DecisionWeightedSFTTrainer(trainer_cls):
        decision_ids: list[int] = []
        decision_weight: float = 1.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not model.training or self.decision_weight == 1:
                return super().compute_loss(
                    model,
                    inputs,
                    return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                )
            labels = inputs["labels"]
            trained = labels[:, 1:] != IGNORE
            if self.accelerator.unwrap_model(model) is model and set(inputs) == PLAIN_BATCH:
                # the output layer runs on the trained positions only (most tokens are context)
                ids, attention = inputs["input_ids"], inputs["attention_mask"]
                logp, _ = token_logprobs(model, ids, attention, positions=trained)
            else:  # a wrapped model (DataParallel, DDP) or extra inputs: through its forward
                rest = {k: v for k, v in inputs.items() if k != "labels"}
                logits = model(**rest, use_cache=False).logits[:, :-1]
                target = labels[:, 1:].clamp(min=0)  # context positions: any id, weighed 0
                logp = token_logprobs_of(logits.flatten(0, 1), target.flatten()).view_as(target)
            mask = decision_mask(labels, self.decision_ids)[:, 1:]
            weights = 1 + (self.decision_weight - 1) * mask.to(logp.dtype)
            loss = weighted_token_loss(logp, trained, weights, num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # as TRL does: DDP averages
            return (loss, None) if return_outputs else loss

    return DecisionWeightedSFTTrainer


def build_trainer(recipe: SFTRecipe, *, resume: bool = False) -> tuple[Any, str | None]:
    """Everything but the training: data, tokenizer, model and a TRL `SFTTrainer`.

    Returns `(trainer, checkpoint)`, where `checkpoint` is the folder to resume from (or None).
    `recipe` must have resolved paths (`load_recipe` / `resolve_paths`). Exposed so tests and
    notebooks can inspect the collated batches before training. With `model.copy_warmup` a
    fresh run's warm-up happens here (`copy_warmed`: minutes, unless `output_dir` already holds
    it), since SFT must start from the warmed weights.
    """
    try:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        raise KitchenError(
            f"kitchen sft needs TRL ({e}); install it with `pip install 'kitchen[trl]'`"
        ) from None
    from transformers import AutoTokenizer, set_seed

    out = Path(recipe.output_dir)
    checkpoint = _check_output_dir(recipe, out, resume)
    train = read_dialogues(recipe.data.train, recipe.data.max_train)
    held = read_dialogues(recipe.data.eval, recipe.data.max_eval) if recipe.data.eval else None
    set_seed(recipe.seed)

    src = recipe.model
    if src.tiny is not None:
        device = resolve_device(src.device or "auto")
        if checkpoint is not None:  # the tokenizer the checkpoint was trained with
            tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        else:
            settings = src.tokenizer or TokenizerSettings()
            tokenizer = train_tokenizer(
                (render_chat(m) for m in train),
                settings.vocab_size,
                min_frequency=settings.min_frequency,
                model_max_length=src.tiny.max_positions,
            )
        model = build_tiny_model(tokenizer, src.tiny, seed=recipe.seed).to(device)
        if src.copy_warmup is not None and checkpoint is None:  # a checkpoint has its weights
            model, tokenizer = copy_warmed(recipe, out, model, tokenizer)
        quantized, checkpointing = False, False
    else:
        model, tokenizer = load_model(src.base)
        add_tokens(model, tokenizer, src.add_tokens)
        device = next(model.parameters()).device
        quantized = src.base.quantization != "none"
        checkpointing = src.base.gradient_checkpointing

    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    has_eval = held is not None
    args = SFTConfig(
        output_dir=str(out),
        seed=recipe.seed,
        data_seed=recipe.seed,
        num_train_epochs=recipe.epochs,
        max_steps=recipe.max_steps or -1,
        per_device_train_batch_size=recipe.batch_size,
        per_device_eval_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.grad_accum,
        learning_rate=recipe.learning_rate(),
        lr_scheduler_type=SCHEDULERS[recipe.schedule],
        warmup_steps=recipe.warmup,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm,
        max_length=recipe.max_length,
        assistant_only_loss=True,
        packing=False,
        logging_steps=recipe.log_every,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=recipe.eval_every if has_eval else None,
        eval_on_start=has_eval and checkpoint is None,  # a resumed run has that number
        save_strategy="steps",
        save_steps=recipe.save_every,
        save_total_limit=recipe.keep_checkpoints,
        use_cpu=device.type == "cpu",
        bf16=bf16,
        **_checkpointing_args(SFTConfig, checkpointing),
        **_sampling_args(SFTConfig, recipe.group_by_length),
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    if recipe.decision_weight != 1 and not any(
        m["role"] == "assistant" and m["content"].startswith(recipe.decision_after)
        for dialogue in train
        for m in dialogue
    ):
        raise KitchenError(
            [
                recipe.problem(
                    ("decision_after",),
                    f"no assistant turn of {recipe.data.train} opens with "
                    f"{recipe.decision_after!r}, so decision_weight {recipe.decision_weight:g} "
                    "would weigh nothing; name an action the dialogues hold, or drop the weight",
                )
            ]
        )
    try:
        trainer = _decision_weighted(SFTTrainer)(
            model=model,
            args=args,
            train_dataset=Dataset.from_list([{"messages": m} for m in train]),
            eval_dataset=Dataset.from_list([{"messages": m} for m in held]) if has_eval else None,
            processing_class=tokenizer,
        )
        for name, data in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset)):
            if data is not None and len(data) == 0:  # TRL drops rows with no assistant token
                raise KitchenError(
                    [
                        recipe.problem(
                            ("max_length",),
                            f"{recipe.max_length} tokens cut every assistant turn of the {name} "
                            "dialogues (each starts later than that), so there is nothing to "
                            "learn; raise it (concierge dialogues run ~300 tokens)",
                        )
                    ]
                )
        trainer.decision_weight = recipe.decision_weight
        trainer.decision_ids = tokenizer.encode(recipe.decision_after, add_special_tokens=False)
    except ValueError as e:
        if "chat template" not in str(e):
            raise
        raise KitchenError(  # departure 5
            f"model.base.path {src.base.path}: its chat template cannot mark assistant turns for "
            f"assistant-only loss ({e}). Give a checkpoint whose template wraps each assistant "
            "turn in {% generation %}...{% endgeneration %} (kitchen.models.CHAT_TEMPLATE does)"
        ) from None
    if quantized and device.type == "cpu":  # departure 2: keep LoRA weights in float32 on CPU
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return trainer, checkpoint


def copy_warmed(recipe: SFTRecipe, out: Path, model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """`(model, tokenizer)` after `recipe.model.copy_warmup` (kitchen.copying): read from
    `out/copy_warmup/` when a finished warm-up of the same shape, settings, seed and vocabulary
    is there, else trained from `model` and saved there (with its `log.jsonl` and the
    `warmup.json` that says what it was made with) before SFT starts."""
    src = recipe.model
    folder = out / "copy_warmup"
    made_with = {
        "seed": recipe.seed,
        "tiny": src.tiny.model_dump(mode="json"),
        "copy_warmup": src.copy_warmup.model_dump(mode="json"),
    }
    device = next(model.parameters()).device
    if (folder / "warmup.json").is_file():
        saved = json.loads((folder / "warmup.json").read_text())
        if saved.get("made_with") == made_with:
            warmed, warmed_tok = load_model(
                ModelSpec(path=str(folder), device=device.type, dtype="float32")
            )
            if warmed_tok.get_vocab() == tokenizer.get_vocab():
                print(f"copy warm-up: {folder} (copy loss {saved['copy_loss']:.3f}), reused")
                return warmed, tokenizer
        print(f"copy warm-up: {folder} was made for another recipe or data; warming up anew")
    try:
        log = warm_up(model, tokenizer, src.copy_warmup, seed=recipe.seed)
    except FloatingPointError as e:
        raise KitchenError(
            [recipe.problem(("model", "copy_warmup", "lr"), f"{e}: the warm-up diverged; lower lr")]
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".copy_warmup.", dir=out))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        write_jsonl(tmp / "log.jsonl", log)
        atomic_write_json(
            tmp / "warmup.json", {"made_with": made_with, "copy_loss": log[-1]["copy_loss"]}
        )
        swap_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"copy warm-up: copy loss {log[0]['copy_loss']:.3f} -> {log[-1]['copy_loss']:.3f}")
    return model, tokenizer


def _checkpointing_args(config_cls: type, on: bool) -> dict[str, Any]:
    # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing (the old name
    # warns); TRL's default is on, which would slow the tiny model for no memory gain.
    names = {f.name for f in dataclasses.fields(config_cls)}
    key = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {key: on, f"{key}_kwargs": {"use_reentrant": False} if on else None}


def _sampling_args(config_cls: type, grouped: bool) -> dict[str, Any]:
    # transformers 5.2x replaced group_by_length with train_sampling_strategy
    names = {f.name for f in dataclasses.fields(config_cls)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length" if grouped else "random"}
    return {"group_by_length": grouped}


def _log_callback(fn: Callable[[dict[str, Any]], None]) -> Any:
    """A transformers `TrainerCallback` that forwards every logged row (with its step) to `fn`."""
    from transformers import TrainerCallback

    class LogCallback(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
            if logs:
                fn(dict(logs) | {"step": state.global_step})

    return LogCallback()


def run_sft(
    recipe: SFTRecipe,
    *,
    resume: bool = False,
    on_log: Callable[[dict[str, Any]], None] | None = None,
) -> SFTResult:
    """Train as `recipe` says and save `final/`; see the module docstring for what is written.

    `on_log(row)` is called with every row the trainer logs (train loss and learning rate every
    `log_every` steps, eval loss every `eval_every`), `step` included: a notebook draws its live
    loss chart from it.
    """
    recipe = resolve_paths(recipe)
    out = Path(recipe.output_dir)
    trainer, checkpoint = build_trainer(recipe, resume=resume)
    if on_log is not None:
        trainer.add_callback(_log_callback(on_log))
    out.mkdir(parents=True, exist_ok=True)
    text = _recipe_yaml(recipe)
    atomic_write_text(out / "recipe.yaml", text)
    trainer.train(resume_from_checkpoint=checkpoint)
    bad = next(
        (
            (k, r)
            for r in trainer.state.log_history
            for k in ("loss", "eval_loss")
            if isinstance(r.get(k), float) and not math.isfinite(r[k])
        ),
        None,
    )
    if bad is not None:  # departure 6: a diverged model is not saved as final/
        write_jsonl(out / "log.jsonl", list(trainer.state.log_history))
        key, row = bad
        raise KitchenError(
            [
                recipe.problem(
                    ("lr",),
                    f"training diverged: {key} {row[key]} at step {row.get('step')} (see "
                    f"{out / 'log.jsonl'}); lower lr (it was {recipe.learning_rate():g})",
                )
            ]
        )

    final = out / "final"
    tmp = Path(tempfile.mkdtemp(prefix=".final.", dir=out))
    try:
        names = adapter_names(trainer.model)
        if names:  # only the adapter, flat in final/ (peft nests non-default names in a subfolder)
            save_adapter(trainer.model, trainer.model.active_adapter, tmp)
        else:
            trainer.save_model(str(tmp))
        trainer.processing_class.save_pretrained(str(tmp))
        atomic_write_text(tmp / "recipe.yaml", text)
        swap_folder(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log = list(trainer.state.log_history)
    write_jsonl(out / "log.jsonl", log)
    return SFTResult(output_dir=out, final_dir=final, log=log)


def sft_main(recipe_path: str | os.PathLike, *, resume: bool = False) -> int:
    """`kitchen sft RECIPE [--resume]`: run the recipe, print where the model went; exit code.

    Recipe mistakes raise `KitchenError` (located `PATH:LINE: field: message`) for the CLI.
    """
    recipe = load_recipe(recipe_path)
    result = run_sft(recipe, resume=resume)
    losses = result.eval_losses
    if len(losses) >= 2:
        print(f"eval loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"final model: {result.final_dir}")
    print(f"log: {result.output_dir / 'log.jsonl'}")
    return 0
