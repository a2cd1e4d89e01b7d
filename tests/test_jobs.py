"""Jobs: (task, diner) pairs for training and evaluation, short tasks and meals alike."""

from __future__ import annotations

from kitchen.evaluate import EvalConfig, eval_jobs
from kitchen.jobs import pair_jobs
from kitchen.profile import pseudonym
from kitchen.world import Task, feasible, load_menu, load_split


def test_pair_jobs_mix_meals_and_every_job_is_feasible(concierge):
    """A pool with meals: deterministic, of the right split, and every job has a dish that fits
    each course it asks for, for the diner it was paired with."""
    jobs = pair_jobs("train", 60, seed=2, constitution=concierge, long_share=0.5)
    again = pair_jobs("train", 60, seed=2, constitution=concierge, long_share=0.5)
    assert len(jobs) == 60 and [(t, pc.profile) for t, pc, _ in jobs] == [
        (t, pc.profile) for t, pc, _ in again
    ]
    assert 15 <= sum(t.kind == "long" for t, _, _ in jobs) <= 45
    menu, train = load_menu(), {pseudonym(p) for p in load_split("train")}
    for task, pc, diner in jobs:
        assert task.id.startswith("train") and pc.profile in train
        assert feasible(menu, task, diner.get("allergies") or [], diner.get("diet") == "vegetarian")
    short = pair_jobs("train", 20, seed=2, constitution=concierge)
    assert all(t.kind == "short" for t, _, _ in short)


def test_a_meal_no_dish_can_serve_is_not_feasible():
    """The skip rule for meals: one course without a fitting dish makes the whole meal
    impossible. Every Italian main holds gluten or dairy, so for a diner allergic to both the
    drinks still fit but the meal does not."""
    menu = load_menu()
    meal = Task(id="m", request="", cuisine="italian", courses=["main", "drink"], max_price=15)
    assert feasible(menu, meal) and feasible(menu, meal, allergies=["gluten"])
    drinks_only = meal.model_copy(update={"courses": ["drink"]})
    assert feasible(menu, drinks_only, allergies=["gluten", "dairy"])
    assert not feasible(menu, meal, allergies=["gluten", "dairy"])
    assert not feasible(menu, meal.model_copy(update={"max_price": 2.5}))


def test_heldout_eval_jobs_with_meals(concierge):
    cfg = EvalConfig(tasks=24, long_share=0.5)
    jobs = eval_jobs(cfg, concierge)
    assert len(jobs) == 24 and eval_jobs(cfg, concierge) == jobs
    held = {pseudonym(p) for p in load_split("heldout")}
    assert all(t.id.startswith("heldout") and pc.profile in held for t, pc, _ in jobs)
    assert any(t.kind == "long" for t, _, _ in jobs) and any(t.kind == "short" for t, _, _ in jobs)
    assert all(t.kind == "short" for t, _, _ in eval_jobs(EvalConfig(tasks=6), concierge))
