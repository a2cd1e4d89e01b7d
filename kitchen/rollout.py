"""Batched multi-turn rollouts: K samples per (task, profile), played against the concierge world.

The method's loop (docs/method.md#mapo) starts with `trajs = policy.rollout(prompts, K)`: here
every episode advances one assistant turn at a time — its prompt is rendered with the model's
chat template, sampled together with the other episodes', and each action goes to its own
`World`, which executes tools and plays the diner.

Two decoding paths, one behaviour (`RolloutConfig.engine`):

- **fast** (default) — `kitchen.engine`: every episode is a row of one batch for the whole
  rollout. Its KV cache stays across turns, so a turn prefills only what is new (the tool or
  diner message and the generation prompt); a turn that ends goes to the world (and the guard)
  at once and the episode's next turn is queued, without waiting for the batch's longest turn;
  episodes that end leave the batch, and queued ones (beyond `batch_size`) take their places.
  Each turn samples from its own random stream, seeded by the rollout seed, the episode's place
  in the call (job and sample), the turn and the guard attempt: an episode plays the same
  whether it shares its batch with 31 others or runs alone. A LoRA adapter is merged into its base while the rollout runs, where
  that is exact (`kitchen.engine.lora_merged`).
- **generate** — transformers' `generate` on the live episodes, re-packed into batches and
  re-reading the whole conversation every turn. It is also what a model the engine cannot serve
  (`kitchen.engine.unsupported`) falls back to, with the reason logged once and kept in
  `RolloutStats.fallback`.

Per assistant turn the trajectory records the generated token ids (including the end-of-turn
token, so training also teaches the policy to stop) and their log-probabilities under the policy
at collection, reused by the loss as the "old" log-probs of importance weights. A turn that hits
`max_new_tokens` before its stop token is marked `truncated`: the world still sees its text, but
the trainer masks it out. `RolloutStats` counts tokens, turns and prefill work
(`prefill_per_token`: tokens read before sampling per token generated).

Departures:
1. Recorded log-probs are those of the policy itself (temperature 1), even when sampling at
   another temperature: the loss needs log π, not the log-prob of the tempered sampler
   (docs/method.md#policy-update).
2. The two paths draw different random numbers: with the same seed they play different (equally
   distributed) episodes. Greedy decoding, the log-probs and the stopping rules are the same.
3. A stop string ends a turn at the token that completes it; `generate` pads the rows it stops
   early, and those pads are cut off here so they never reach the trajectory. A turn is
   truncated only when it ran out of tokens with neither the end-of-turn token nor a stop
   string.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from kitchen.config import StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.world import (
    DEFAULT_MAX_TURNS,
    LONG_MAX_TURNS,
    Blocked,
    Menu,
    Task,
    Trajectory,
    World,
    load_menu,
)

Candidate = tuple[list[int], str, list[float], bool]  # token ids, text, log-probs, truncated


class RolloutConfig(StrictModel):
    """How the policy samples. Defaults suit the tiny policy on a CPU."""

    k: int = Field(
        8,
        ge=1,
        description="Samples per (task, profile): the task group. GRPO-style "
        "methods need K >= 2; 8 is a common compromise between variance and cost.",
    )
    max_turns: int = Field(
        DEFAULT_MAX_TURNS,
        ge=1,
        description="Assistant turns per episode of a single-dish task (10: the ideal agent "
        "needs 3–6).",
    )
    long_max_turns: int = Field(
        LONG_MAX_TURNS,
        ge=1,
        description="Assistant turns per episode of a meal (a long task of several courses). "
        "24: the ideal agent needs 12–20.",
    )
    max_new_tokens: int = Field(
        48,
        ge=1,
        description="Token budget of one assistant turn. The "
        "longest scripted message is ~40 tokens for the tiny tokenizer.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature. 1.0 samples the "
        "policy itself, which on-policy REINFORCE assumes.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 = off.")
    stop_strings: list[str] = Field(
        default_factory=list,
        description="Extra stop strings besides the model's end-of-turn token.",
    )
    batch_size: int = Field(64, ge=1, description="Episodes generated together.")
    engine: Literal["fast", "generate"] = Field(
        "fast",
        description="fast: kitchen.engine — KV caches kept across turns, so a turn prefills only "
        "the new messages (several times faster on the tiny policy; see "
        "benchmarks/bench_rollout.py). generate: transformers' generate, re-reading the whole "
        "dialogue every turn. A model the fast engine cannot serve uses generate, with the "
        "reason logged. Default fast.",
    )


@dataclass
class RolloutStats:
    episodes: int = 0
    turns: int = 0
    tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0  # tokens read before sampling, padding included
    engine: str = ""  # the path that ran: fast or generate
    fallback: str = ""  # why the fast engine was not used, when it was asked for
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def prefill_per_token(self) -> float:
        """Prefill tokens read per generated token: what re-reading the dialogue costs."""
        return self.prefill_tokens / self.tokens if self.tokens else 0.0


def prompt_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """What the policy reads: role and content only — its own raw actions, not parsed tool calls."""
    return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(
        prompt_messages(messages), tokenize=False, add_generation_prompt=True
    )


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The token ids of `render_prompt` (what the policy reads before its next action)."""
    return tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]


class PromptTokens:
    """`prompt_ids`, tokenizing only what is new: a rendered prompt is cut at the tokenizer's
    added tokens (`<|im_start|>`, `<|im_end|>`, ...) and every piece between them is tokenized
    once and remembered, since a dialogue's later prompts repeat its earlier pieces.

    That is how a fast tokenizer works anyway — added tokens are matched first and the text
    between them is normalised and split piece by piece — so the ids are the same, as long as
    the added tokens match plainly (no lstrip, rstrip, single-word or normalised ones; otherwise
    this class tokenizes whole prompts). It also checks: the first prompt of every episode is
    tokenized both ways, and any difference switches the piecewise path off. Byte-level BPE is
    slow (~0.4 ms for a 300-token prompt here); a rollout tokenizes ~200 prompts.
    """

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.pieces: dict[str, list[int]] = {}
        self.checked: set[str] = set()
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        added = self.backend.get_added_tokens_decoder() if self.backend is not None else {}
        plain = all(
            not (a.lstrip or a.rstrip or a.single_word or a.normalized) for a in added.values()
        )
        self.added = {a.content: i for i, a in added.items()}
        names = sorted(self.added, key=len, reverse=True)  # leftmost-longest, as the tokenizer
        self.split = (
            re.compile("(" + "|".join(map(re.escape, names)) + ")") if plain and names else None
        )

    def __call__(self, messages: Sequence[dict[str, Any]], episode: str = "") -> list[int]:
        text = render_prompt(self.tok, messages)
        if self.split is None:
            return self.tok(text, add_special_tokens=False)["input_ids"]
        ids: list[int] = []
        for piece in self.split.split(text):
            if piece in self.added:
                ids.append(self.added[piece])
            elif piece:
                if piece not in self.pieces:
                    self.pieces[piece] = self.backend.encode(piece, add_special_tokens=False).ids
                ids += self.pieces[piece]
        if episode not in self.checked:
            self.checked.add(episode)
            whole = self.tok(text, add_special_tokens=False)["input_ids"]
            if whole != ids:
                self.split = None
                return whole
        return ids


def episode_seed(seed: int, episode: str, turn: int, attempt: int) -> int:
    """The random stream of one episode's turn on the fast path, from the rollout's seed, the
    episode's place in the call (`job:sample`, as the world's own seed) and the turn and guard
    attempt: a hash, not Python's `hash` (which changes between processes), so a resumed run
    replays the same episodes, and two loops that play the same jobs with the same seed (the
    kit's and TRL's) play the same episodes."""
    h = hashlib.blake2b(f"{seed}:{episode}:{turn}:{attempt}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def rollout(
    model: Any,
    tokenizer: Any,
    jobs: Sequence[tuple[Task, PersonalConstitution, dict[str, Any] | None]],
    cfg: RolloutConfig | None = None,
    *,
    seed: int = 0,
    menu: Menu | None = None,
    group_prefix: str = "",
    guard: Callable[[PersonalConstitution], Any] | None = None,
    guarded: int | None = None,
    progress: str | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """Play `cfg.k` episodes for each (task, personal constitution, diner values) job.

    Returns the trajectories (job-major: the K samples of job j are `[j*K:(j+1)*K]`) and stats.
    Sampling is seeded (`seed`; on the fast path also each episode's job and sample index, the
    turn and the guard attempt), so a resumed run replays the same episodes. `guard(pc)` (e.g. `AxiomGuard`) checks
    every action before the diner sees it; blocked actions are regenerated, a fallback turn is
    marked `guarded` and never trained on. `guarded` plays only the first that many of each
    job's K samples behind the guard and the rest without (None: all of them). `progress` (a
    description) shows a bar of finished episodes.
    """
    from tqdm.auto import tqdm

    from kitchen.engine import eval_mode, fallback_reason, lora_merged

    cfg = cfg or RolloutConfig()
    menu = menu or load_menu()
    worlds: list[World] = []
    guards: list[Any] = []
    names: list[str] = []  # each episode's place in the call: job, sample (seeds the fast path)
    for j, (task, pc, diner) in enumerate(jobs):
        g = guard(pc) if guard else None
        for k in range(cfg.k):
            w = World(menu, max_turns=cfg.long_max_turns if task.courses else cfg.max_turns)
            w.reset(
                task,
                pc.dimensions,
                profile=pc.profile,
                personal_version=pc.version,
                seed=seed * 1_000_003 + j * 1009 + k,
                diner=diner,
                episode=f"{group_prefix}{task.id}:{pc.profile}:{k}",
            )
            worlds.append(w)
            guards.append(g if guarded is None or k < guarded else None)
            names.append(f"{j}:{k}")
    stats = RolloutStats(episodes=len(worlds), engine=cfg.engine)
    if cfg.engine == "fast":
        reason = fallback_reason(model, "kitchen.rollout")
        if reason:
            stats.engine, stats.fallback = "generate", reason
    start = time.perf_counter()
    bar = tqdm(total=len(worlds), desc=progress, unit="episode", disable=progress is None)

    def finished() -> None:  # the bar follows the episodes that have ended
        bar.update(sum(w.traj.done for w in worlds) - bar.n)

    try:
        with eval_mode(model):
            if stats.engine == "fast":
                with lora_merged(model) as merged:
                    stats.extra["engine/lora_merged"] = merged
                    _play_fast(model, tokenizer, worlds, guards, names, cfg, stats, seed, finished)
            else:
                _play_generate(model, tokenizer, worlds, guards, cfg, stats, seed, finished)
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - start
    return [w.traj for w in worlds], stats


def _play_fast(model, tok, worlds, guards, names, cfg, stats, seed, finished) -> None:
    """The fast path: every episode is a row of one engine batch for the whole rollout; a turn
    that ends goes to its world (and guard) at once, and the episode's next turn is queued."""
    from kitchen.engine import Engine, Request, SamplingParams

    engine = Engine(model, max_rows=cfg.batch_size)
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stop_strings=tuple(cfg.stop_strings),
    )
    prompts: dict[int, list[int]] = {}
    attempts: dict[int, int] = {}
    tokens = PromptTokens(tok)

    def next_turn(i: int, attempt: int = 0) -> tuple[list[int], int] | None:
        w = worlds[i]
        if w.traj.done:
            return None
        if attempt == 0:
            prompts[i] = tokens(w.traj.messages, w.traj.id)
            if not _fits(model, [w], [prompts[i]], cfg)[0]:
                return None
        attempts[i] = attempt
        return prompts[i], episode_seed(seed, names[i], len(w.traj.turns), attempt)

    def on_done(i: int, c: Any) -> tuple[list[int], int] | None:
        text = tok.decode(c.tokens, skip_special_tokens=True)
        stats.tokens += len(c.tokens)
        taken = _take(
            worlds[i], guards[i], attempts[i], c.tokens, text, c.logprobs, c.truncated, stats
        )
        nxt = next_turn(i) if taken else next_turn(i, attempts[i] + 1)
        if nxt is None:
            finished()
        return nxt

    requests = []
    for i in range(len(worlds)):
        first = next_turn(i)
        if first is not None:
            requests.append(Request(i, *first))
    engine.serve(requests, params, on_done, tokenizer=tok)
    finished()
    stats.prefill_tokens += engine.stats.prefill_tokens
    stats.extra |= {
        "engine/prefill_real": engine.stats.prefill_real,
        "engine/decode_steps": engine.stats.decode_steps,
        "engine/decode_rows": engine.stats.decode_rows,
        "engine/riders": engine.stats.riders,
        "engine/prefill_forwards": engine.stats.prefill_forwards,
    }


def _play_generate(model, tok, worlds, guards, cfg, stats, seed, finished) -> None:
    """The generate path: the live episodes re-packed into batches every turn."""
    for turn in range(max(cfg.max_turns, cfg.long_max_turns)):
        live = [i for i, w in enumerate(worlds) if not w.traj.done]
        if not live:
            break
        for b in range(0, len(live), cfg.batch_size):
            rows = live[b : b + cfg.batch_size]
            sampler = _generate_sampler(model, tok, cfg, seed * 7919 + turn * 131 + b)
            _play_turn(model, tok, worlds, guards, rows, cfg, stats, sampler)
        finished()


# A sampler: (episode indices, their prompt ids, guard attempt, stats) -> one candidate each
Sampler = Callable[[list[int], list[list[int]], int, RolloutStats], list[Candidate]]


def _generate_sampler(model: Any, tok: Any, cfg: RolloutConfig, seed: int) -> Sampler:
    def sample(idx, prompts, attempt, stats):
        return _sample_generate(model, tok, prompts, cfg, seed + 7 * attempt, stats)

    return sample


def _sample_generate(
    model: Any,
    tok: Any,
    prompts: list[list[int]],
    cfg: RolloutConfig,
    seed: int,
    stats: RolloutStats,
) -> list[Candidate]:
    """One candidate per prompt from transformers' `generate` (left padding, one shared seed)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
    kwargs: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "do_sample": True,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": 0,
        "pad_token_id": pad,
        "eos_token_id": eos,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    if cfg.stop_strings:
        kwargs |= {"stop_strings": cfg.stop_strings, "tokenizer": tok}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=attn, **kwargs)
    stats.prefill_tokens += ids.numel()
    new = out.sequences[:, width:]  # [B, L]
    logits = torch.stack(out.logits, dim=1).float()  # [B, L, V]: raw, before the temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)  # [B, L]
    result = []
    for row in range(len(prompts)):
        ids_row = new[row].tolist()
        n = ids_row.index(eos) + 1 if eos in ids_row else len(ids_row)
        truncated = eos not in ids_row[:n]
        if truncated and cfg.stop_strings:  # a stop string ends the turn too: cut the padding
            n = _stop_end(tok, ids_row[:n], cfg.stop_strings) or n
        text = tok.decode(ids_row[:n], skip_special_tokens=True)
        if truncated and cfg.stop_strings:
            truncated = not any(s in text for s in cfg.stop_strings)
        result.append((ids_row[:n], text, logp[row, :n].tolist(), truncated))
    return result


def _stop_end(tok: Any, ids: list[int], stops: Sequence[str]) -> int | None:
    """Length of the shortest prefix of `ids` whose text contains a stop string, if any."""
    for n in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:n]) for s in stops):
            return n
    return None


def _fits(model: Any, worlds: list[World], prompts: list[list[int]], cfg: RolloutConfig) -> list:
    """End (honestly, as 'context') the episodes whose conversation no longer fits the model;
    return the flags of those that still fit."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    fits = []
    for w, p in zip(worlds, prompts, strict=True):
        ok = limit is None or len(p) + cfg.max_new_tokens <= limit
        if not ok:
            w.traj.done, w.traj.end = True, "context"
            w.traj.outcome = w.outcome(w.traj)
        fits.append(ok)
    return fits


def _play_turn(
    model: Any,
    tok: Any,
    worlds: list[World],
    guards: list[Any],
    rows: list[int],
    cfg: RolloutConfig,
    stats: RolloutStats,
    sample: Sampler,
) -> None:
    """One assistant turn for episodes `rows` (the generate path): sample, check, step."""
    prompts = {i: prompt_ids(tok, worlds[i].traj.messages) for i in rows}
    fits = _fits(model, [worlds[i] for i in rows], [prompts[i] for i in rows], cfg)
    pending = [i for i, ok in zip(rows, fits, strict=True) if ok]
    budget = max((guards[i].budget for i in pending if guards[i] is not None), default=0)
    for attempt in range(budget + 1):
        if not pending:
            break
        cands = sample(pending, [prompts[i] for i in pending], attempt, stats)
        stats.tokens += sum(len(c[0]) for c in cands)
        pending = [
            i
            for i, (ids, text, logp, truncated) in zip(pending, cands, strict=True)
            if not _take(worlds[i], guards[i], attempt, ids, text, logp, truncated, stats)
        ]


def _take(
    w: World,
    g: Any,
    attempt: int,
    ids: list[int],
    text: str,
    logp: list[float],
    truncated: bool,
    stats: RolloutStats,
) -> bool:
    """Hand a candidate action to its world, unless the guard blocks it; False = regenerate.

    A blocked candidate is logged and kept on the trajectory (`Trajectory.blocked`); at the
    guard's last attempt its fallback message is played instead (marked `guarded`, never
    trained on)."""
    bad = g.violations(w.traj, text) if g is not None else []
    if bad:
        last = attempt >= g.budget
        g.log.append(_interception(w, attempt, text, bad, last))
        if ids:  # the policy's own tokens: an exact-state negative a trainer may learn from
            w.traj.blocked.append(
                Blocked(
                    turn=len(w.traj.turns),
                    attempt=attempt,
                    tokens=list(ids),
                    logprobs=list(logp),
                    truncated=truncated,
                    clauses=[c for c, _ in bad],
                )
            )
        stats.extra["guard/blocked"] = stats.extra.get("guard/blocked", 0) + 1
        if not last:
            return False
        w.step(g.fallback, guarded=True)
    else:
        w.step(text, tokens=ids, logprobs=logp, truncated=truncated)
        stats.truncated += truncated
    stats.turns += 1
    return True


def _interception(w: World, attempt: int, text: str, bad: list[tuple[str, str]], last: bool):
    from kitchen.guard import Interception

    return Interception(
        turn=len(w.traj.turns),
        attempt=attempt,
        action=text[:500],
        clauses=[c for c, _ in bad],
        reasons=[r for _, r in bad],
        outcome="fallback" if last else "regenerated",
    )
