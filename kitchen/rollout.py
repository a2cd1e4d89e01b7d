"""Batched multi-turn rollouts: K samples per (task, profile), played against the concierge world.

Seed 000 (pseudo-code line 5): `trajs = policy.rollout(prompts, num_samples=K)`. Here every
episode of a batch advances one assistant turn at a time: the prompts of all live episodes are
rendered with the model's chat template, generated together (left padding, KV cache inside
`generate`), and each action goes to its own `World`, which executes tools and plays the diner.

Per assistant turn the trajectory records the generated token ids (including the end-of-turn
token, so training also teaches the policy to stop) and their log-probabilities under the policy
at collection — computed once, from the logits `generate` already produced, and reused by the loss
as the "old" log-probs of importance weights. A turn that hits `max_new_tokens` before its stop
token is marked `truncated`: the world still sees its text, but the trainer masks it out.

Departures:
1. Recorded log-probs are those of the policy itself (temperature 1), even when sampling at
   another temperature: the loss needs log π, not the log-prob of the tempered sampler.
2. The prompt re-renders the whole conversation each turn (the KV cache lives inside one
   `generate` call). Keeping caches across turns would save prefill but ties every episode's
   cache to the batch's padding; for dialogues of a few hundred tokens the prefill is cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field

from kitchen.config import StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.world import DEFAULT_MAX_TURNS, Menu, Task, Trajectory, World, load_menu


class RolloutConfig(StrictModel):
    """How the policy samples. Defaults suit the tiny policy on a CPU."""

    k: int = Field(
        8,
        ge=1,
        description="Samples per (task, profile): the task group. GRPO-style "
        "methods need K >= 2; 8 is a common compromise between variance and cost.",
    )
    max_turns: int = Field(DEFAULT_MAX_TURNS, ge=1, description="Assistant turns per episode.")
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


@dataclass
class RolloutStats:
    episodes: int = 0
    turns: int = 0
    tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def prompt_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """What the policy reads: role and content only — its own raw actions, not parsed tool calls."""
    return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(
        prompt_messages(messages), tokenize=False, add_generation_prompt=True
    )


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
) -> tuple[list[Trajectory], RolloutStats]:
    """Play `cfg.k` episodes for each (task, personal constitution, diner values) job.

    Returns the trajectories (job-major: the K samples of job j are `[j*K:(j+1)*K]`) and stats.
    Sampling is seeded (`seed`, the turn and the batch), so a resumed run replays the same
    episodes. `guard(pc)` (e.g. `AxiomGuard`) checks every action before the diner sees it;
    blocked actions are regenerated, a fallback turn is marked `guarded` and never trained on.
    """
    cfg = cfg or RolloutConfig()
    menu = menu or load_menu()
    worlds: list[World] = []
    guards: list[Any] = []
    for j, (task, pc, diner) in enumerate(jobs):
        g = guard(pc) if guard else None
        for k in range(cfg.k):
            w = World(menu, max_turns=cfg.max_turns)
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
            guards.append(g)
    stats = RolloutStats(episodes=len(worlds))
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        for turn in range(cfg.max_turns):
            live = [i for i, w in enumerate(worlds) if not w.traj.done]
            if not live:
                break
            for b in range(0, len(live), cfg.batch_size):
                rows = live[b : b + cfg.batch_size]
                _play_turn(
                    model,
                    tokenizer,
                    [worlds[i] for i in rows],
                    [guards[i] for i in rows],
                    cfg,
                    stats,
                    seed=seed * 7919 + turn * 131 + b,
                )
    finally:
        model.train(was_training)
    stats.seconds = time.perf_counter() - start
    return [w.traj for w in worlds], stats


def _fits(tok: Any, model: Any, batch: list[World], cfg: RolloutConfig) -> list[World]:
    """End (honestly, as 'context') the episodes whose conversation no longer fits the model."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is None:
        return batch
    keep = []
    for w in batch:
        n = len(tok(render_prompt(tok, w.traj.messages), add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > limit:
            w.traj.done, w.traj.end = True, "context"
            w.traj.outcome = w.outcome(w.traj)
        else:
            keep.append(w)
    return keep


def _sample(
    model: Any, tok: Any, batch: list[World], cfg: RolloutConfig, seed: int
) -> list[tuple[list[int], str, list[float], bool]]:
    """One candidate action per episode: (token ids, text, log-probs, truncated)."""
    eos = tok.eos_token_id
    texts = [render_prompt(tok, w.traj.messages) for w in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    prompt_len = enc["input_ids"].shape[1]
    kwargs: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "do_sample": True,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": 0,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": eos,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    if cfg.stop_strings:
        kwargs |= {"stop_strings": cfg.stop_strings, "tokenizer": tok}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(**enc, **kwargs)
    new = out.sequences[:, prompt_len:]  # [B, L]
    logits = torch.stack(out.logits, dim=1).float()  # [B, L, V]: raw, before the temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)  # [B, L]
    result = []
    for row in range(len(batch)):
        ids = new[row].tolist()
        n = ids.index(eos) + 1 if eos in ids else len(ids)
        text = tok.decode(ids[:n], skip_special_tokens=True)
        truncated = eos not in ids[:n]
        if truncated and cfg.stop_strings:  # a stop string ends the turn too
            truncated = not any(text.rstrip().endswith(s) for s in cfg.stop_strings)
        result.append((ids[:n], text, logp[row, :n].tolist(), truncated))
    return result


def _play_turn(
    model: Any,
    tok: Any,
    batch: list[World],
    guards: list[Any],
    cfg: RolloutConfig,
    stats: RolloutStats,
    seed: int,
) -> None:
    keep = set(map(id, _fits(tok, model, batch, cfg)))
    pending = [(w, g) for w, g in zip(batch, guards, strict=True) if id(w) in keep]
    budget = max((g.budget for _, g in pending if g is not None), default=0)
    for attempt in range(budget + 1):
        if not pending:
            break
        cands = _sample(model, tok, [w for w, _ in pending], cfg, seed + 7 * attempt)
        stats.tokens += sum(len(c[0]) for c in cands)
        retry = []
        for (w, g), (ids, text, logp, truncated) in zip(pending, cands, strict=True):
            if g is not None and g.violations(w.traj, text):
                bad = g.violations(w.traj, text)
                last = attempt >= g.budget
                g.log.append(_interception(w, attempt, text, bad, last))
                stats.extra["guard/blocked"] = stats.extra.get("guard/blocked", 0) + 1
                if not last:
                    retry.append((w, g))
                    continue
                w.step(g.fallback, guarded=True)
            else:
                w.step(text, tokens=ids, logprobs=logp, truncated=truncated)
                stats.truncated += truncated
            stats.turns += 1
        pending = retry


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
