"""The generative reward model (GRM): a model that reviews a trajectory clause by clause.

docs/method.md#grm: instead of a scalar score, a generative model reads the user's personal
constitution and the trajectory, writes a critique, then a structured verdict per clause and per
step. That structure is the process reward (`kitchen.review` turns it into numbers), and because
the rules are *input*, one GRM serves every user's constitution without retraining.

A review is a conversation (`kitchen.critique`): the GRM reads the trajectory turn by turn and
writes one line after each agent turn, `t<k> <critique> => <verdicts>`. `GRM.review` plays those
conversations for a batch of trajectories at once on the decoding engine (`kitchen.engine`): each
review is a row that keeps its KV cache from one turn to the next, so a turn costs only its own
tokens, as a policy rollout does. A model the engine cannot serve is reviewed with `generate`
(one turn index at a time, every review in one batch), with the reason logged.

What the pipeline adds around the model:

- **Structure** (`LineGrammar`, `cfg.structured`): line k must start with `t<k> `, so the GRM
  cannot skip, repeat or invent a turn, and it may end a line only where the line is readable
  (whole verdict entries after its last `=>`); what a line says is the GRM's. Works with any
  tokenizer (the vocabulary's strings are matched, not token ids).
- **Budgets** (`cfg.max_new_tokens` per line, `cfg.max_context_tokens` per conversation): a line
  cut by its budget is masked and *flagged* (`t<k>: review budget`), never silently dropped; a
  trajectory whose conversation does not fit is reviewed in windows (`critique.plan_windows`).
- **Flags** (`kitchen.injection.flags`): text in the agent's turns that tries to steer the
  reviewer is flagged by rule, whatever the GRM made of it (docs/method.md#reward-hacking).
- **Inference options** (docs/method.md#grm-calibration): `samples` reviews with a majority vote
  per (turn, clause) at `temperature`; a `cascade` — clauses listed there are decided by the rule
  judge and the GRM's verdicts on them are replaced (or, when every active clause is listed, the
  GRM is not asked at all); `rule_only` clauses are decided by the judge too and left out of the
  GRM's prompt altogether (a clause added after the GRM was trained: T10).

Works with the tiny default and any HF causal LM (LoRA/QLoRA); on one GPU the GRM can be a second
LoRA adapter on the policy's base (`cfg.adapter`).

Departures from the method:
1. Agent messages are tagged with their word count and the menu's facts about the dishes they
   name (`kitchen.critique`): counting and catalogue recall are weak spots of small (and large)
   models, and a length or allergen rule should not hinge on them. A production GRM would get the
   same from retrieval over the product's catalogue: give the reviewer the facts, let it judge.
2. `clause_text="compact"` renders clauses as ids with their parameters (`T3(max_words=12)`), for
   the tiny GRM whose context is short; "full" renders their text, for chat models.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from kitchen.config import StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.critique import (
    conversation,
    overall_of,
    parse_review,
    plan_windows,
    read_line,
    review_turns,
    vote,
)
from kitchen.injection import flags as injection_flags
from kitchen.judge import judge
from kitchen.review import ClauseVerdict, Review
from kitchen.rollout import PromptTokens
from kitchen.world import Menu, Trajectory, load_menu

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kitchen.grm")


def without_clauses(pc: PersonalConstitution, ids: Iterable[str]) -> PersonalConstitution:
    """`pc` without the clauses `ids` (the GRM's `rule_only`): what the GRM is shown, in review
    and in its training data alike."""
    hide = set(ids)
    if not hide & set(pc.ids):
        return pc
    return pc.model_copy(update={"clauses": [c for c in pc.clauses if c.id not in hide]})


def review_dtype(dtype: str) -> str:
    """`GRMConfig.dtype` → the `ModelSpec.dtype` the GRM loads with: `fast` is bfloat16 on a CPU
    that multiplies it in hardware (and on a CUDA GPU, as `auto`), float32 on other CPUs."""
    import torch

    from kitchen.models import bf16_is_native

    if dtype != "fast":
        return dtype
    if torch.cuda.is_available():
        return "auto"  # bfloat16 where the GPU supports it
    return "bfloat16" if bf16_is_native(torch.device("cpu")) else "auto"


class GRMConfig(StrictModel):
    """How the GRM reviews. Defaults suit the shipped tiny GRM on a CPU."""

    model: str = Field("data/models/grm-tiny", description="GRM checkpoint folder or HF name.")
    adapter: str | None = Field(
        None, description="On one GPU: the name of the GRM's LoRA adapter on the policy's base."
    )
    samples: int = Field(
        1,
        ge=1,
        le=16,
        description="Reviews per trajectory; >1 = majority vote per (turn, clause) "
        "(docs/method.md#faq: vote to tame noisy process rewards). Default 1.",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        le=2,
        description="0 = greedy. Voting needs > 0; `kitchen grm calibrate` reports which "
        "temperature (if any) makes a vote beat greedy reviews.",
    )
    cascade: list[str] = Field(
        default_factory=list,
        description="Clause ids the rule judge decides (cheap first, GRM for the rest). Empty "
        "(default): the GRM decides everything, so its reward is the GRM's own.",
    )
    rule_only: list[str] = Field(
        default_factory=lambda: ["T10"],
        description="Clauses the rule judge decides and the GRM is not even shown (its prompt "
        "leaves them out, so a GRM trained before a clause was added reads the constitution it "
        "was trained on). Default: T10, which the shipped tiny GRM predates. Ids the "
        "constitution lacks are ignored.",
    )

    @property
    def ruled(self) -> list[str]:
        """Every clause the rule judge decides: `cascade`, then `rule_only`."""
        return list(dict.fromkeys([*self.cascade, *self.rule_only]))

    clause_text: Literal["compact", "full"] = Field(
        "compact", description="compact: ids with parameters (tiny GRM); full: clause texts."
    )
    max_context_tokens: int = Field(
        2048,
        ge=128,
        description="Budget of one review conversation (prompt, turns and review lines); "
        "never more than the model's context. A dialogue that does not fit is reviewed in "
        "windows (the truncation rule). 2048: the shipped tiny GRM's positions; 12 turns of a "
        "meal take ~1,300.",
    )
    max_new_tokens: int = Field(
        96,
        ge=8,
        description="Budget of one review line. A line the budget cuts is masked and flagged "
        "(`t<k>: review budget`). 96: the longest line in the tiny GRM's data is ~70 tokens.",
    )
    max_window_turns: int = Field(
        12,
        ge=1,
        description="Most turns one conversation reviews; longer dialogues are reviewed in "
        "windows. 12: what the tiny GRM was trained on (a whole short task; a meal in two "
        "windows), which keeps its training sequences short — attention's cost grows with their "
        "square.",
    )
    batch_size: int = Field(
        64, ge=1, description="Reviews decoded together (rows of one engine batch)."
    )
    structured: bool = Field(
        True,
        description="Constrain each review line to the review language (`LineGrammar`): it "
        "starts with its turn's marker `t<k> ` and may end only where it is readable (what a "
        "line says stays the GRM's). A small GRM otherwise skips or repeats turns, or ends a "
        "line unreadably, which masks their verdicts. Off: free generation (parse failures are "
        "then the model's alone).",
    )
    engine: Literal["fast", "generate"] = Field(
        "fast",
        description="fast: kitchen.engine (KV caches kept across the review's turns); "
        "generate: transformers' generate, one turn index at a time. A model the engine cannot "
        "serve uses generate, with the reason logged.",
    )
    seed: int = Field(0, description="Seeds sampled reviews (temperature > 0).")
    dtype: Literal["auto", "fast", "float32", "bfloat16"] = Field(
        "auto",
        description="Precision the GRM reviews in. auto (default): bfloat16 on a CUDA GPU that "
        "supports it, float32 elsewhere (`ModelSpec.dtype`). fast: as auto, and bfloat16 also "
        "on a CPU that multiplies it in hardware (AMX; `models.cpu_has_bf16_matmul`). bfloat16 "
        "on a CPU halves the bytes attention reads for every token written, which is what "
        "bounds a review there: faster with AMX, slower without, and a few lines may differ.",
    )


# --------------------------------------------------------------------------------------------
# Structure of a line


class LineGrammar:
    """The review line's grammar, `t<k> <critique> => <id>± <id>± …`, as allowed next tokens:

    - **marker**: while the line is a proper prefix of `t<k> `, only tokens that keep it one (or
      complete it, without a line break);
    - **body**: any token but a line break (any character `str.splitlines` splits at) and the
      tokenizer's special tokens;
    - **end** (`eos`): only where the line so far is readable (`critique.read_line`): it has an
      `=>` and what follows its last one is whole verdict entries (or none).

    So every line the GRM finishes is read whole, and one it cannot finish is cut by its budget
    and flagged, never silently masked; what a line says (critique, clauses, signs) stays the
    model's, and a critique may even hold an arrow of its own. Works with any tokenizer: the
    vocabulary's strings are matched, not token ids.
    """

    def __init__(self, vocab: Sequence[str], eos: int | None = None, special: Iterable[int] = ()):
        self.vocab = list(vocab)
        barred = {i for i, p in enumerate(self.vocab) if _breaks(p)} | set(special) | {eos}
        self._open = [i for i in range(len(self.vocab)) if i not in barred]
        self._may_end = self._open + ([eos] if eos is not None else [])
        self.by_first: dict[str, list[int]] = {}
        for i in self._open:
            if self.vocab[i]:
                self.by_first.setdefault(self.vocab[i][0], []).append(i)

    def allowed(self, start: str, written: str, whole: bool = True) -> list[int] | None:
        """Token ids allowed after `written` (the line so far), or None (any). `whole=False`
        enforces the marker only."""
        if written.startswith(start):
            if not whole:
                return None
            return self._may_end if read_line(written) is not None else self._open
        if not start.startswith(written):
            return None  # diverged (only without the constraint): free
        rest = start[len(written) :]
        out = [
            i
            for i in self.by_first.get(rest[0], [])
            if rest.startswith(self.vocab[i]) or self.vocab[i].startswith(rest)
        ]
        return out or self._open  # no token spells the marker: the line cannot be read


def _breaks(piece: str) -> bool:
    """Does `piece` hold a line break (any character `str.splitlines` splits at)?"""
    return len(f"x{piece}x".splitlines()) > 1


# --------------------------------------------------------------------------------------------
# The model

# what `GRM.stats` adds up from the engine's work (`kitchen.engine.EngineStats`)
ENGINE_STATS = (
    "prefill_tokens",
    "generated",
    "decode_steps",
    "decode_rows",
    "riders",
    "decode_cols",
    "decode_filled",
)


class GRM:
    """A generative reward model: `review(trajectories, personal constitutions) -> [Review]`."""

    def __init__(
        self, model: Any, tokenizer: Any, cfg: GRMConfig | None = None, menu: Menu | None = None
    ):
        self.model, self.tok = model, tokenizer
        self.cfg = cfg or GRMConfig()
        self.menu = menu or load_menu()
        self.stats = Counter()
        self.tokens = PromptTokens(tokenizer)
        self._grammar: LineGrammar | None = None
        self.last_text: list[list[str]] = []  # the last call's raw lines, for notebooks

    @classmethod
    def load(cls, cfg: GRMConfig | None = None) -> GRM:
        """Load the GRM checkpoint named by `cfg.model` (the shipped tiny GRM by default)."""
        from kitchen import paths
        from kitchen.models import ModelSpec, load_model

        cfg = cfg or GRMConfig()
        path = cfg.model
        if not path.startswith("/") and (paths.HOME / path).exists():
            path = str(paths.HOME / path)
        model, tok = load_model(ModelSpec(path=path, dtype=review_dtype(cfg.dtype)))
        model.eval()
        return cls(model, tok, cfg)

    def context_budget(self) -> int:
        """Tokens one review conversation may take: `cfg.max_context_tokens`, never more than
        the model's context (`max_position_embeddings`)."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        budget = self.cfg.max_context_tokens
        return min(budget, limit) if isinstance(limit, int) else budget

    def _fits(self, traj: Trajectory, pc: PersonalConstitution, budget: int):
        """`fits(first, last, rendering)` for the truncation rule: the window's messages plus a
        full line budget per turn fit `budget`."""

        def fits(first: int, last: int, opts: dict[str, Any]) -> bool:
            users = review_turns(
                traj, pc, first=first, last=last, clause_text=self.cfg.clause_text, **opts
            )
            n = len(self.tokens(conversation(users)))
            return n + (last - first + 1) * (self.cfg.max_new_tokens + 4) <= budget

        return fits

    def review(
        self, trajectories: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
    ) -> list[Review]:
        """One review per trajectory: cascade, windows, the review conversations, parse, vote."""
        return self.review_with_samples(trajectories, pcs)[0]

    def shown(self, pc: PersonalConstitution) -> PersonalConstitution:
        """The personal constitution as the GRM reads it: without the `rule_only` clauses."""
        return without_clauses(pc, self.cfg.rule_only)

    def review_with_samples(
        self, trajectories: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
    ) -> tuple[list[Review], list[list[Review]]]:
        """`(reviews, samples)`: the voted reviews, and per trajectory the `cfg.samples` reviews
        the vote was taken over (to measure what voting gains over one sample)."""
        cfg = self.cfg
        budget = self.context_budget()
        # one conversation per (trajectory, window, sample): its user messages
        convs: dict[tuple[int, int, int], list[str]] = {}
        spans: dict[tuple[int, int, int], tuple[int, int]] = {}
        rules: list[Review | None] = [None] * len(trajectories)
        views = [self.shown(pc) for pc in pcs]  # what the GRM reads of each constitution
        for i, (traj, pc) in enumerate(zip(trajectories, pcs, strict=True)):
            if set(cfg.ruled) & set(pc.ids):
                rules[i] = judge(traj, pc, self.menu)
                if set(pc.ids) <= set(cfg.ruled):
                    continue  # nothing left for the GRM
            windows = plan_windows(
                len(traj.turns), self._fits(traj, views[i], budget), max_turns=cfg.max_window_turns
            )
            for w, (first, last, opts) in enumerate(windows):
                users = review_turns(
                    traj, views[i], first=first, last=last, clause_text=cfg.clause_text, **opts
                )
                for s in range(cfg.samples):
                    convs[(i, w, s)] = users
                    spans[(i, w, s)] = (first, last)
        lines = self._converse(convs, spans)
        self.last_text = []  # per trajectory, per sample: the lines the GRM wrote
        out, all_samples = [], []
        for i, (traj, pc) in enumerate(zip(trajectories, pcs, strict=True)):
            flags = injection_flags(traj)
            samples, texts = [], []
            for s in range(cfg.samples):
                keys = sorted(k for k in convs if k[0] == i and k[2] == s)
                written: list[str | None] = [x for k in keys for x in lines[k]]
                texts.append("\n".join(x or "" for x in written))
                r = parse_review(
                    written,
                    turns=range(len(traj.turns)),
                    clauses=views[i].ids,
                    trajectory=traj.id,
                    personal_version=pc.version,
                )
                cut = [f"t{t}: review budget" for t, x in enumerate(written) if x == ""]
                r.flags = flags + cut
                if rules[i] is not None:
                    r = merge_cascade(r if keys else None, rules[i], cfg.ruled)
                samples.append(r)
            review = vote(samples) if len(samples) > 1 else samples[0]
            review = review.model_copy(
                update={"flags": sorted(set().union(*(x.flags for x in samples)))}
            )
            self.stats["reviews"] += 1
            self.stats["flagged"] += bool(review.flags)
            self.stats["partial"] += review.parsed_fraction < 1
            out.append(review)
            all_samples.append(samples)
            self.last_text.append(texts)
        return out, all_samples

    # -- the conversations --------------------------------------------------------------------

    def _line_grammar(self) -> LineGrammar:
        if self._grammar is None:
            vocab = [self.tok.decode([i]) for i in range(len(self.tok))]
            special = getattr(self.tok, "all_special_ids", ())
            self._grammar = LineGrammar(vocab, eos=self.tok.eos_token_id, special=special)
        return self._grammar

    def _converse(
        self,
        convs: dict[tuple[int, int, int], list[str]],
        spans: dict[tuple[int, int, int], tuple[int, int]],
    ) -> dict[tuple[int, int, int], list[str | None]]:
        """Play every review conversation to its end: per key, the line written after each of
        its turns ("" for a line its budget cut; None where no line was written)."""
        from kitchen.engine import eval_mode, fallback_reason, lora_merged

        if not convs:
            return {}
        lines: dict[Hashable, list[str | None]] = {k: [] for k in convs}
        # eval mode on either path: the GRM often shares the policy's base, which an update has
        # just left training (dropout on; with gradient checkpointing, no cache for generate)
        with _adapter(self.model, self.cfg.adapter), eval_mode(self.model):
            reason = (
                fallback_reason(self.model, "kitchen.grm") if self.cfg.engine == "fast" else "asked"
            )
            if reason is None:
                with lora_merged(self.model):
                    self._converse_fast(convs, spans, lines)
            else:
                self._converse_generate(convs, spans, lines)
        self.stats["lines"] += sum(len(v) for v in lines.values())
        self.stats["cut_lines"] += sum(x == "" for v in lines.values() for x in v)
        return lines

    def _prompt(self, key: Hashable, users: list[str], lines: list[str | None]) -> list[int]:
        return self.tokens(
            conversation(users[: len(lines) + 1], [x or "" for x in lines]), str(key)
        )

    def _seed(self, key: tuple[int, int, int], turn: int) -> int:
        return random.Random(f"grm:{self.cfg.seed}:{key}:{turn}").randrange(2**31)

    def _converse_fast(self, convs, spans, lines) -> None:
        from kitchen.engine import Engine, Request, SamplingParams

        cfg, tok = self.cfg, self.tok
        engine = Engine(self.model, max_rows=cfg.batch_size)
        params = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            temperature=cfg.temperature if cfg.samples > 1 or cfg.temperature > 0 else 0.0,
        )
        grammar = self._line_grammar()
        texts: dict[Hashable, tuple[int, str]] = {}

        def constraint(key: Hashable, gen: Sequence[int]) -> list[int] | None:
            if not cfg.structured:
                return None
            first, _ = spans[key]
            seen, text = texts.get(key, (0, ""))
            if seen > len(gen):
                seen, text = 0, ""
            text += "".join(grammar.vocab[i] if i < len(grammar.vocab) else "" for i in gen[seen:])
            texts[key] = (len(gen), text)
            return grammar.allowed(f"t{first + len(lines[key])} ", text)

        def on_done(key: Hashable, c: Any) -> tuple[list[int], int] | None:
            texts.pop(key, None)
            line = "" if c.truncated else tok.decode(c.tokens, skip_special_tokens=True).strip()
            lines[key].append(line)
            first, last = spans[key]
            if first + len(lines[key]) > last:
                return None
            return self._prompt(key, convs[key], lines[key]), self._seed(key, len(lines[key]))

        requests = [Request(k, self._prompt(k, convs[k], []), self._seed(k, 0)) for k in convs]
        engine.serve(requests, params, on_done, constraint=constraint, tokenizer=tok)
        for name in ENGINE_STATS:
            self.stats[name] += getattr(engine.stats, name)

    def _converse_generate(self, convs, spans, lines) -> None:
        """Without the engine: turn index by turn index, every open conversation in batches."""
        import torch

        cfg, tok, model = self.cfg, self.tok, self.model
        grammar = self._line_grammar()
        sampling = cfg.samples > 1 or cfg.temperature > 0
        while True:
            live = [k for k in convs if spans[k][0] + len(lines[k]) <= spans[k][1]]
            if not live:
                return
            for b in range(0, len(live), cfg.batch_size):
                keys = live[b : b + cfg.batch_size]
                prompts = [self._prompt(k, convs[k], lines[k]) for k in keys]
                width = max(map(len, prompts))
                pad = tok.pad_token_id
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
                attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                starts = [f"t{spans[k][0] + len(lines[k])} " for k in keys]

                def allowed(
                    row: int, input_ids: torch.Tensor, width: int = width, starts=starts
                ) -> list[int]:
                    text = tok.decode(input_ids[width:], skip_special_tokens=True)
                    got = grammar.allowed(starts[row], text) if cfg.structured else None
                    return got if got is not None else list(range(len(grammar.vocab)))

                kwargs: dict[str, Any] = {
                    "max_new_tokens": cfg.max_new_tokens,
                    "pad_token_id": pad,
                    "eos_token_id": tok.eos_token_id,
                    "prefix_allowed_tokens_fn": allowed,
                    "do_sample": sampling,
                }
                if sampling:
                    kwargs |= {"temperature": max(cfg.temperature, 1e-3), "top_p": 1.0, "top_k": 0}
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    torch.manual_seed(self._seed(keys[0], len(lines[keys[0]])))
                    out = model.generate(
                        input_ids=ids.to(model.device),
                        attention_mask=attn.to(model.device),
                        **kwargs,
                    )
                for k, row in zip(keys, out[:, width:].tolist(), strict=True):
                    done = tok.eos_token_id in row
                    row = row[: row.index(tok.eos_token_id)] if done else row
                    lines[k].append(
                        tok.decode(row, skip_special_tokens=True).strip() if done else ""
                    )


def merge_cascade(grm_review: Review | None, rule_review: Review, cascade: Sequence[str]) -> Review:
    """Rule verdicts for the `cascade` clauses, GRM verdicts for the rest; a cascade clause the
    GRM was not shown (`GRMConfig.rule_only`) has rule verdicts only."""
    if grm_review is None:
        return rule_review.model_copy(update={"source": "cascade"})
    take = set(cascade)
    rules = {(v.turn, v.clause): v for v in rule_review.verdicts}
    out = [
        ClauseVerdict(
            turn=v.turn,
            clause=v.clause,
            verdict=rules[(v.turn, v.clause)].verdict,
            reason=rules[(v.turn, v.clause)].reason,
        )
        if v.clause in take and (v.turn, v.clause) in rules
        else v
        for v in grm_review.verdicts
    ]
    shown = set(grm_review.clauses)  # the rule_only clauses are not among them
    out += [v for v in rule_review.verdicts if v.clause in take and v.clause not in shown]
    out.sort(key=lambda v: v.turn)  # stable: each turn's verdicts stay in clause order
    produced = sum(v.verdict is not None for v in out)
    return grm_review.model_copy(
        update={
            "clauses": rule_review.clauses,
            "verdicts": out,
            "source": "cascade",
            "overall": overall_of(out),
            "parsed_fraction": produced / len(out) if out else 1.0,
        }
    )


class _adapter:
    """Run with a named LoRA adapter active (the GRM on the policy's base), then restore."""

    def __init__(self, model: Any, name: str | None):
        self.model, self.name = model, name

    def __enter__(self) -> None:
        if self.name:
            self.prev = getattr(self.model, "active_adapter", None)
            self.model.set_adapter(self.name)

    def __exit__(self, *exc: Any) -> None:
        if self.name and self.prev:
            self.model.set_adapter(self.prev)


def verdict_tensor(reviews: Sequence[Review], clauses: Sequence[str]) -> torch.Tensor:
    """[N, T, C] codes: 1 pass, -1 violate, 0 n/a, NaN masked (for charts and agreement)."""
    import torch

    t_max = max((r.turns for r in reviews), default=0)
    out = torch.full((len(reviews), t_max, len(clauses)), float("nan"))
    index = {c: k for k, c in enumerate(clauses)}
    code = {"pass": 1.0, "violate": -1.0, "n/a": 0.0}
    for n, r in enumerate(reviews):
        for v in r.verdicts:
            if v.clause in index and v.verdict is not None:
                out[n, v.turn, index[v.clause]] = code[v.verdict]
    return out
