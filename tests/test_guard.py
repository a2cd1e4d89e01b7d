"""The axiom guard: violating actions are regenerated or replaced, and every interception logged."""

from __future__ import annotations

from kitchen.constitution import personalize
from kitchen.guard import FALLBACK, AxiomGuard
from kitchen.profile import Profile
from kitchen.world import Task, World

THAI = Task(id="t", request="I'd like some thai food.", cuisine="thai")


def setup(concierge, actions=("@search thai", "@allergens Tofu Satay")):
    pc = personalize(concierge, Profile(id="u", dimensions={"allergies": ["peanut"]}))
    w = World()
    w.reset(THAI, pc.dimensions)
    for a in actions:
        w.step(a)
    return w, pc


def test_violations_find_each_axiom(concierge):
    w, pc = setup(concierge)
    g = AxiomGuard(pc)
    assert [c for c, _ in g.violations(w.traj, "I recommend Tofu Satay.")] == ["A1"]
    assert [c for c, _ in g.violations(w.traj, "What is your phone number?")] == ["A2"]
    assert [c for c, _ in g.violations(w.traj, "I recommend Butter Chicken.")] == ["A3"]
    assert g.violations(w.traj, "I recommend Mango Sticky Rice.") == []
    assert g.violations(w.traj, "Keep each message short? T3 is a theorem.") == []
    assert g.unenforced == []  # every concierge axiom has a rule


def test_regenerates_within_budget_then_falls_back(concierge):
    w, pc = setup(concierge)
    g = AxiomGuard(pc, budget=2)
    attempts = ["I recommend Tofu Satay.", "I recommend Mango Sticky Rice."]
    assert g.check(w.traj, lambda i: attempts[i]) == attempts[1]
    assert [x.outcome for x in g.log] == ["regenerated"] and g.log[0].clauses == ["A1"]
    g.log.clear()
    assert g.check(w.traj, lambda i: "I recommend Tofu Satay.") == FALLBACK
    assert [x.outcome for x in g.log] == ["regenerated", "regenerated", "fallback"]


def test_serving_call_on_openai_messages(concierge):
    w, pc = setup(concierge)
    g = AxiomGuard(pc, budget=0)
    messages = w.traj.messages
    assert g(messages, lambda m: "I recommend Tofu Satay.") == FALLBACK
    assert (
        g(messages, lambda m: "I recommend Mango Sticky Rice.") == "I recommend Mango Sticky Rice."
    )
    assert len(g.log) == 1


def test_guarded_turns_are_marked(concierge):
    w, pc = setup(concierge, actions=())
    w.step(FALLBACK, guarded=True)
    assert w.traj.turns[0].guarded
