"""The axiom guard: red lines enforced at inference, independently of any reward.

The method (docs/method.md#guard): the axiom layer must intercept at inference time as a hard
constraint, not rely on the reward's "soft" pressure, so that red lines have zero exemptions.
`AxiomGuard` sits between a policy and the diner: each candidate action is checked against the
*axiom* clauses of the personal constitution — by the rule judge where a rule exists, by the GRM
otherwise — and a violating action is regenerated (up to `budget` attempts) or, when every attempt
violates, replaced by a safe fallback message. Every interception is logged.

It works on its own around any policy (`guard(messages)` for serving code, with
`policy(messages) -> text`), and inside `kitchen.rollout` / `kitchen.evaluate`, which report
results with and without it.

Departures from the method (docs/method.md#guard):
1. Only axioms are enforced. Theorems are preferences refined per user; blocking on them would
   turn the reward model's job into a filter and hide what the policy actually learned.
2. After `budget` regenerations the guard answers with a fixed, safe fallback message instead of
   ending the conversation: the diner can go on, and the interception is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from kitchen.constitution import PersonalConstitution
from kitchen.judge import has_rule, judge
from kitchen.world import Trajectory, parse_action, trajectory_from_messages

FALLBACK = "Sorry, I can't do that. Let me find you another dish."


class Interception(BaseModel):
    """One blocked candidate action."""

    turn: int
    attempt: int
    action: str
    clauses: list[str]
    reasons: list[str]
    outcome: str = Field(description="'regenerated' or 'fallback'.")


class AxiomGuard:
    """Check candidate actions against the axioms of `pc`; regenerate or fall back.

    `grm` (optional) reviews axioms that have no rule; without it such axioms are not enforced
    (and `unenforced` lists them).
    """

    def __init__(
        self, pc: PersonalConstitution, budget: int = 2, grm: Any = None, fallback: str = FALLBACK
    ):
        self.pc, self.budget, self.grm, self.fallback = pc, budget, grm, fallback
        self.axioms = [c.id for c in pc.clauses if c.kind == "axiom"]
        self.unenforced = [] if grm else [a for a in self.axioms if not has_rule(a)]
        self.log: list[Interception] = []

    def violations(self, traj: Trajectory, action_text: str) -> list[tuple[str, str]]:
        """(clause, reason) of every axiom the action would break, given the episode so far."""
        probe = _with_candidate(traj, action_text)
        turn = len(probe.turns) - 1
        review = judge(probe, self.pc)
        out = [
            (v.clause, v.reason)
            for v in review.verdicts
            if v.turn == turn
            and v.clause in self.axioms
            and has_rule(v.clause)
            and v.verdict == "violate"
        ]
        rest = [a for a in self.axioms if not has_rule(a)]
        if rest and self.grm is not None:
            (r,) = self.grm.review([probe], [self.pc])
            out += [
                (v.clause, v.reason or "GRM: violates")
                for v in r.verdicts
                if v.turn == turn and v.clause in rest and v.verdict == "violate"
            ]
        return out

    def check(self, traj: Trajectory, candidates: Callable[[int], str]) -> str:
        """The first candidate (attempt 0, 1, …, budget) that breaks no axiom, else the fallback.

        `candidates(attempt)` produces the attempt-th candidate action (regenerating).
        """
        turn = len(traj.turns)
        for attempt in range(self.budget + 1):
            text = candidates(attempt)
            bad = self.violations(traj, text)
            if not bad:
                return text
            last = attempt == self.budget
            self.log.append(
                Interception(
                    turn=turn,
                    attempt=attempt,
                    action=text[:500],
                    clauses=[c for c, _ in bad],
                    reasons=[r for _, r in bad],
                    outcome="fallback" if last else "regenerated",
                )
            )
        return self.fallback

    def __call__(
        self, messages: list[dict[str, Any]], policy: Callable[[list[dict[str, Any]]], str]
    ) -> str:
        """Serving: the guarded next assistant message for a conversation."""
        traj = trajectory_from_messages(messages)
        return self.check(traj, lambda attempt: policy(messages))


def _with_candidate(traj: Trajectory, action_text: str) -> Trajectory:
    """A copy of `traj` with the candidate appended as its next assistant turn (no reply yet)."""
    from kitchen.world import TurnInfo

    action = parse_action(action_text)
    messages = list(traj.messages) + [{"role": "assistant", "content": action.text}]
    turns = list(traj.turns) + [
        TurnInfo(
            turn=len(traj.turns),
            message=len(messages) - 1,
            action=action,
            exact_key="",
            abstract_key="",
        )
    ]
    return traj.model_copy(update={"messages": messages, "turns": turns})
