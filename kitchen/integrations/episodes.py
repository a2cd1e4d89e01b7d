"""What TRL and verl see of a concierge episode: jobs, first prompts, and an episode as a token row.

The kit's own loop (`kitchen.train`) trains on *step samples*: one row per assistant turn, its
prompt re-rendered from the conversation so far. TRL's `GRPOTrainer` and verl's agent loops
instead train on one row per *episode*: the first prompt, then a "completion" that holds every
assistant turn with the environment's replies in between, and a mask that is 1 on the policy's
own tokens (TRL's `env_mask` / `tool_mask`, verl's `response_mask`). `episode_tokens` builds
that row from a `Trajectory`:

    prompt     = chat template of (system, diner request) + "<|im_start|>assistant\\n"
    completion = a_0  g_1  a_1  g_2 ... a_{T-1}  [tail]
        a_t  the tokens the policy sampled at turn t (mask 1; 0 when replaced by the axiom
             guard, which the kit never trains on, or truncated unless `truncated` says to train
             on truncated turns — `RewardConfig.truncated = "worst"`)
        g_t  the template text between the end of action t−1 and the start of action t: its
             `<|im_end|>`, the tool result or diner reply, and the next assistant header (mask 0)
        tail the text after the last action (verl only: the world's last reply, so that verl's
             outcome slot — the last response token — is never an action token)

Every action keeps the ids the policy sampled, so the row's log-probabilities are those of the
rollout.

Departures from the kit's own loop:
1. Where the world normalised an action's text (it strips surrounding whitespace) the rendered
   conversation and the sampled ids differ, and later turns of the row see the sampled ids rather
   than the re-rendered text the policy saw at collection; `drift` counts those turns (a few per
   cent for the tiny policy). The kit's own loop packs a trajectory into one sequence only when
   the two agree exactly, and otherwise scores each turn on its own re-rendered prompt.
2. One row per episode weighs episodes, not turns, in the sequence-level loss aggregations (see
   `kitchen.integrations.trl`); the default token-mean is the same in both.

`job_pool` is the task pool of `kitchen cook` (the same tasks, profiles and diners for a given
recipe), so a recipe means the same work in every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kitchen import paths
from kitchen.config import KitchenError
from kitchen.constitution import PersonalizationCache, load_constitution
from kitchen.jobs import Job
from kitchen.models import IM_END
from kitchen.rollout import render_prompt
from kitchen.world import Trajectory
from kitchen.world import system_prompt as world_system_prompt


def _home(path: str) -> str:
    from pathlib import Path

    p = Path(path)
    if not p.is_absolute() and not p.exists() and (paths.HOME / p).exists():
        return str(paths.HOME / p)
    return path


def job_pool(
    constitution: str,
    n: int,
    seed: int,
    *,
    cache: PersonalizationCache | None = None,
) -> list[Job]:
    """`n` (task, personal constitution, diner values) jobs: the pool `kitchen cook` trains on
    (`kitchen.jobs.pair_jobs` with the same key and seed as `kitchen.train.Run`)."""
    from kitchen.jobs import pair_jobs

    return pair_jobs("train", n, seed, load_constitution(_home(constitution)), cache=cache)


def first_messages(job: Job) -> list[dict[str, str]]:
    """The conversation before the agent's first turn: (system, diner request), as `World.reset`
    writes it. TRL's dataset `prompt` column and verl's `raw_prompt` hold exactly these."""
    task, pc, _ = job
    return [
        {"role": "system", "content": world_system_prompt(pc.dimensions)},
        {"role": "user", "content": task.request},
    ]


@dataclass
class EpisodeTokens:
    """One episode as one token row (see the module docstring). Lengths: P prompt, C completion."""

    prompt_ids: list[int]  # [P]
    completion_ids: list[int]  # [C]
    logprobs: list[float]  # [C] log-probs at collection on policy tokens, 0.0 elsewhere
    mask: list[int]  # [C] 1 on trainable policy tokens
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # turn → [start, end) in C
    drift: int = 0  # turns whose later context differs from what the policy saw


def episode_tokens(
    tok: Any, traj: Trajectory, *, tail: bool = False, truncated: bool = False
) -> EpisodeTokens:
    """The episode `traj` as one (prompt, completion) token row with a policy-token mask.

    `spans[t]` is where turn t's action lies in the completion (also for masked turns).
    With `tail`, the text after the last action (its `<|im_end|>` and the world's last reply)
    ends the completion. Raises `KitchenError` if the chat template does not render the
    conversation as prefix + action + reply (it always does for the kit's ChatML template).
    """
    eos = tok.eos_token_id
    if not traj.turns:
        text = render_prompt(tok, traj.messages)
        return EpisodeTokens(tok(text, add_special_tokens=False)["input_ids"], [], [], [])
    seen = render_prompt(tok, traj.prompt_messages(0))
    out = EpisodeTokens(tok(seen, add_special_tokens=False)["input_ids"], [], [], [])
    for k, ti in enumerate(traj.turns):
        content = traj.messages[ti.message].get("content") or ""
        if ti.tokens:
            ids, lps = list(ti.tokens), list(ti.logprobs or [0.0] * len(ti.tokens))
            trainable = ti.trainable(truncated)
            closed = ids[-1] == eos  # the action carries its own <|im_end|>
            body = tok.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
            out.drift += body != content and k + 1 < len(traj.turns)
        else:  # a guarded fallback (or a turn without tokens): the world's text, never trained
            ids = tok(content + IM_END, add_special_tokens=False)["input_ids"]
            lps, trainable, closed = [0.0] * len(ids), False, True
        start = len(out.completion_ids)
        out.completion_ids += ids
        out.logprobs += lps if trainable else [0.0] * len(ids)
        out.mask += [int(trainable)] * len(ids)
        out.spans[ti.turn] = (start, start + len(ids))
        # the glue: from the end of this action to the start of the next one (or the end)
        head = seen + content + (IM_END if closed else "")
        if k + 1 < len(traj.turns):
            nxt = render_prompt(tok, traj.prompt_messages(k + 1))
        elif tail:
            nxt = tok.apply_chat_template(
                [{"role": m["role"], "content": m.get("content") or ""} for m in traj.messages],
                tokenize=False,
            )
        else:
            break
        if not nxt.startswith(head):
            raise KitchenError(
                f"{traj.id} turn {ti.turn}: the chat template does not render the next prompt "
                "as this prompt + the action + the reply; the episode cannot be one token row"
            )
        glue = tok(nxt[len(head) :], add_special_tokens=False)["input_ids"]
        out.completion_ids += glue
        out.logprobs += [0.0] * len(glue)
        out.mask += [0] * len(glue)
        seen = nxt
    return out
