"""A review of a trajectory, clause by clause, and the rewards it implies.

The method asks the reward model for structured output organised by clause — which clauses were
kept, which broken, why — rather than one score, because that structure *is* the process reward:
every step and every clause gets its own verdict (docs/method.md#grm). Into numbers
(docs/method.md#rewards):

- **local reward** of assistant turn t (equation, with s = +1 for pass, −1 for violate, and
  A_t the clauses that apply at t — n/a and masked verdicts excluded):

      r_t = Σ_{c∈A_t} w_c · s_{t,c} / Σ_{c∈A_t} w_c        (mode "mean", the default)
      r_t = Σ_{c∈A_t} w_c · s_{t,c}                        (mode "sum")
      r_t = −Σ_{c∈A_t, s_{t,c} = −1} w_c / Σ_{c∈C} w_c    (mode "violations")

  with w_c the clause weight from the personal constitution (axioms weigh more) and C all of its
  clauses. A turn where no clause applies gets r_t = 0 in "sum" and "violations" modes and is
  *masked* in "mean" mode (no signal, not a 0). "violations" scores a turn by what it broke
  alone, against a denominator that does not depend on the turn: a turn that breaks nothing —
  a search as much as a flawless recommendation — gets 0, the best (departure 5); a turn with a
  verdict the reviewer failed to give is masked there (it may hide a violation).
  With red lines as a *veto* (`red_lines="veto"`), a turn that violates any axiom gets the
  lowest local reward whatever else it kept:

      r_t = −1  (modes "mean" and "violations"; −Σ_c w_c in "sum")   if s_{t,a} = −1 for some
                                                                       axiom a ∈ A_t

  A weighted mean lets a turn buy an axiom violation back with the clauses it kept: on 90
  held-out judge-reviewed dialogues, turns that recommended or ordered an allergen dish (A1
  violated) scored +0.20 on average and up to +0.66, against +0.85 for A1-safe ones. The veto
  makes a red line cost more than any turn can earn (departure 4).
- **global reward**: the world's outcome (success ∈ {0, 1}), optionally blended with the review's
  overall verdict: R = (1 − λ)·success + λ·[overall == pass].

Both the independent rule judge (`kitchen.judge`) and the generative reward model
(`kitchen.grm`) produce a `Review`, so rewards, metrics and charts treat them alike and
`contributions` traces every reward back to the clauses that produced it.

Departures from the method (docs/method.md):
1. "mean" is the default: in "sum" mode a turn where more clauses apply (a recommendation) is
   rewarded or punished more than a turn where few do (a search), whatever the agent did. Group
   normalisation later removes scale, not this bias.
2. A verdict the reward model failed to produce is `None` (masked), never counted as a pass or a
   violation: a parse failure must not look like behaviour.
3. Flags (`Review.flags`: text that tried to steer the reviewer, found by
   `kitchen.injection.flags`, not by the GRM; or a review that ran out of its budget) are
   rewarded by rule, never by the verdicts next to them. `flagged="trajectory"` (the default of
   the training loop): every turn of a flagged trajectory gets the lowest local reward,
   r_t = −1 (mode "mean"; −Σw in "sum"), and its global reward is that of a failure,
   R = 0 — the lowest reward a trajectory can get, so an attempt can never raise a trajectory's
   reward above the same dialogue without it, whatever the GRM made of the other turns. A GRM
   can be steered on turns it did not flag — a harmless-looking attack can flip violations
   elsewhere to passes — so punishing only the flagged turn (`flagged="turn"`) still lets an
   attack pay; `"keep"` trusts the verdicts (for measuring the GRM itself).
4. The veto is an option (`RewardConfig.red_lines`), not the method's text, which weighs axioms
   more but does not say how much. At the main job's budget it did not lower axiom violations
   (docs/method.md#rewards, measured with the rule judge as reviewer), so the default and the
   recipes keep the weighted mean.
5. "violations" is the kit's answer to the two biases above. A weighted mean over the clauses
   that *apply* rewards doing little: a message with few clauses is judged on easy ones. Measured
   on MAPO's held-out episodes (`benchmarks/bench_personal.py`): an opening line to a hurried
   diner breaks T4 (no small talk) in 69% of cases yet scores +0.76 on average, as much as a
   recommendation, since privacy (A2, weight 3) and T10 pass beside it; and the search it could
   have been instead has no clause, so it never enters the state group to be compared with it.
   A sum rewards doing much. Counting only what a turn breaks, over a fixed denominator, does
   neither, and puts every turn — tool calls too — into its state group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from kitchen.constitution import PersonalConstitution

Verdict = Literal["pass", "violate", "n/a"]
SCORE = {"pass": 1.0, "violate": -1.0}


class ClauseVerdict(BaseModel):
    """One verdict: assistant turn × clause."""

    turn: int
    clause: str
    verdict: Verdict | None = Field(description="None: the reviewer gave none (masked).")
    reason: str = ""


class Review(BaseModel):
    """Verdicts for every (assistant turn, clause) of a trajectory under one personal constitution."""

    trajectory: str
    personal_version: str
    source: Literal["judge", "grm", "cascade", "human"] = "judge"
    turns: int = Field(description="Number of assistant turns reviewed.")
    clauses: list[str] = Field(description="The clause ids reviewed (the active ones).")
    verdicts: list[ClauseVerdict]
    overall: Literal["pass", "violate"] | None = None
    flags: list[str] = Field(
        default_factory=list, description="Suspicious content found (e.g. injected verdicts)."
    )
    parsed_fraction: float = Field(1.0, description="Share of verdicts that were produced.")

    def get(self, turn: int, clause: str) -> ClauseVerdict | None:
        for v in self.verdicts:
            if v.turn == turn and v.clause == clause:
                return v
        return None

    def table(self) -> dict[tuple[int, str], Verdict | None]:
        return {(v.turn, v.clause): v.verdict for v in self.verdicts}

    def violations(self) -> list[ClauseVerdict]:
        return [v for v in self.verdicts if v.verdict == "violate"]


def overall_from(verdicts: Iterable[ClauseVerdict]) -> Literal["pass", "violate"]:
    """The trajectory passes when no clause is violated at any turn."""
    return "violate" if any(v.verdict == "violate" for v in verdicts) else "pass"


Flagged = Literal["keep", "turn", "trajectory"]
RedLines = Literal["weigh", "veto"]


LocalMode = Literal["mean", "sum", "violations"]


def turn_rewards(
    review: Review,
    pc: PersonalConstitution,
    mode: LocalMode = "mean",
    flagged: Flagged = "keep",
    red_lines: RedLines = "weigh",
) -> tuple[list[float], list[bool], list[dict[str, float]]]:
    """Local reward per assistant turn (see the module docstring for the equation).

    Returns `(rewards[T], valid[T], contributions[T])`; `contributions[t]` maps each clause id to
    its signed weighted share of `rewards[t]`, so every reward traces back to its clauses.
    `valid[t]` is False when no verdict applies at t ("mean" mode) — train on it with a mask.
    With `flagged="turn"`, a turn named in `review.flags` scores as if it broke every clause;
    with `flagged="trajectory"`, every turn of a flagged review does (departure 3). Their
    contributions then read `{"flagged": r_t}`. With `red_lines="veto"`, a turn that violates an
    axiom scores the lowest reward; its contributions share r_t among the axioms it broke.
    """
    weights = {c.id: c.weight for c in pc.clauses}
    axioms = {c.id for c in pc.clauses if c.kind == "axiom"}
    broken: list[list[str]] = [[] for _ in range(review.turns)]
    num = [0.0] * review.turns
    den = [0.0] * review.turns
    contrib: list[dict[str, float]] = [{} for _ in range(review.turns)]
    masked = set()  # turns with a verdict the reviewer failed to give
    for v in review.verdicts:
        if v.verdict is None and 0 <= v.turn < review.turns:
            masked.add(v.turn)
        if v.verdict not in SCORE or v.clause not in weights or not 0 <= v.turn < review.turns:
            continue
        w = weights[v.clause]
        num[v.turn] += w * SCORE[v.verdict]
        den[v.turn] += w
        contrib[v.turn][v.clause] = w * SCORE[v.verdict]
        if red_lines == "veto" and v.verdict == "violate" and v.clause in axioms:
            broken[v.turn].append(v.clause)
    rewards, valid = [], []
    total = sum(weights.values())
    for t in range(review.turns):
        if mode == "violations":
            lost = {c: x for c, x in contrib[t].items() if x < 0}
            contrib[t] = {c: x / total for c, x in lost.items()}
            rewards.append(sum(lost.values()) / total)
            valid.append(t not in masked)  # a missing verdict may hide a violation
        elif mode == "sum":
            rewards.append(num[t])
            valid.append(True)
        elif den[t] > 0:
            rewards.append(num[t] / den[t])
            valid.append(True)
            contrib[t] = {c: x / den[t] for c, x in contrib[t].items()}
        else:
            rewards.append(0.0)
            valid.append(False)
    worst = worst_reward(pc, mode)
    for t, ids in enumerate(broken):
        if ids:
            rewards[t], valid[t] = worst, True
            contrib[t] = {c: worst / len(ids) for c in ids}
    for t in _flagged_hit(review, flagged):
        rewards[t], valid[t], contrib[t] = worst, True, {"flagged": worst}
    return rewards, valid, contrib


def _flagged_hit(review: Review, flagged: Flagged) -> set[int]:
    """The turns `flagged` scores as if they broke every clause."""
    if flagged == "trajectory" and review.flags:
        return set(range(review.turns))
    if flagged == "turn":
        return {t for t in flagged_turns(review) if 0 <= t < review.turns}
    return set()


def clause_scores(
    review: Review,
    pc: PersonalConstitution,
    flagged: Flagged = "keep",
    red_lines: RedLines = "weigh",
) -> list[dict[str, float]]:
    """Each assistant turn's verdict per clause, as numbers: `[T]` maps of clause id → +1 (pass)
    or −1 (violate); a clause without a verdict at t is absent. A turn `turn_rewards` scores as
    the worst (an axiom broken under `red_lines="veto"`, a flagged turn) reads −1 on every clause
    of `pc`. What `mapo.clause_advantages` normalises clause by clause."""
    axioms = {c.id for c in pc.clauses if c.kind == "axiom"}
    known = {c.id for c in pc.clauses}
    out: list[dict[str, float]] = [{} for _ in range(review.turns)]
    worst = set()
    for v in review.verdicts:
        if v.verdict not in SCORE or v.clause not in known or not 0 <= v.turn < review.turns:
            continue
        out[v.turn][v.clause] = SCORE[v.verdict]
        if red_lines == "veto" and v.verdict == "violate" and v.clause in axioms:
            worst.add(v.turn)
    for t in worst | _flagged_hit(review, flagged):
        out[t] = dict.fromkeys(known, -1.0)
    return out


def worst_reward(pc: PersonalConstitution, mode: LocalMode = "mean") -> float:
    """The lowest local reward a turn can get: every clause broken (−1 in "mean" and
    "violations" modes, minus the sum of the clause weights in "sum" mode)."""
    return -float(sum(c.weight for c in pc.clauses)) if mode == "sum" else -1.0


def flagged_turns(review: Review) -> set[int]:
    """Turns named by the review's injection flags (`"t3: fake verdicts"` → 3)."""
    out = set()
    for flag in review.flags:
        head = flag.split(":", 1)[0].strip()
        if head.startswith("t") and head[1:].isdigit():
            out.add(int(head[1:]))
    return out


def global_reward(
    success: int | float,
    review: Review | None = None,
    blend: float = 0.0,
    flagged: Flagged = "keep",
) -> float:
    """R = (1 − λ)·success + λ·[overall verdict is pass]; λ = `blend` in [0, 1]. `success` is
    the world's outcome: 0 or 1, or the share of the request fulfilled (`reward.outcome:
    progress`). With `flagged="trajectory"`, a flagged review's trajectory gets R = 0
    (departure 3)."""
    if not 0.0 <= blend <= 1.0:
        raise ValueError(f"blend must be in [0, 1], got {blend}")
    if not math.isfinite(float(success)):
        raise ValueError(f"success must be finite, got {success}")
    if flagged == "trajectory" and review is not None and review.flags:
        return 0.0
    if blend == 0.0 or review is None or review.overall is None:
        return float(success)
    return (1 - blend) * float(success) + blend * float(review.overall == "pass")


def clause_pass_rates(reviews: Iterable[Review]) -> dict[str, float]:
    """Per clause: passes / (passes + violations) over all reviews (n/a and masked excluded)."""
    passes: dict[str, int] = {}
    total: dict[str, int] = {}
    for r in reviews:
        for v in r.verdicts:
            if v.verdict in SCORE:
                total[v.clause] = total.get(v.clause, 0) + 1
                passes[v.clause] = passes.get(v.clause, 0) + (v.verdict == "pass")
    return {c: passes[c] / total[c] for c in sorted(total)}


def trajectory_reward(
    review: Review,
    pc: PersonalConstitution,
    success: int | float,
    *,
    mode: LocalMode = "mean",
    flagged: Flagged = "keep",
    blend: float = 0.0,
) -> float:
    """One number per trajectory, for comparing two reviews of (nearly) the same dialogue:
    the mean local reward over the turns with a signal plus the global reward,
    `mean_{t valid} r_t + R`. (Training never uses it: MAPO normalises the two apart.)"""
    local, valid, _ = turn_rewards(review, pc, mode, flagged)
    kept = [r for r, v in zip(local, valid, strict=True) if v]
    mean = sum(kept) / len(kept) if kept else 0.0
    return mean + global_reward(success, review, blend, flagged)
