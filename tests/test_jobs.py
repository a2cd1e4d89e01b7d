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


def test_synthetic_diners_read_as_new_profiles_and_never_hold_a_heldout_set(concierge):
    """`variants`: a share of training jobs gets a synthetic diner — a pseudonym no training
    profile has, dimensions from the constitution's values, many more allergy sets than the
    eighteen training diners hold, none of the held-out sets no training diner has, and each job
    still feasible. Without `variants` the pool is unchanged; evaluation refuses it."""
    import pytest

    from kitchen.jobs import unseen_allergy_sets

    plain = pair_jobs("train", 80, seed=3, constitution=concierge, long_share=0.5)
    assert plain == pair_jobs(
        "train", 80, seed=3, constitution=concierge, long_share=0.5, variants=0.0
    )
    jobs = pair_jobs("train", 80, seed=3, constitution=concierge, long_share=0.5, variants=0.6)
    train = {pseudonym(p) for p in load_split("train")}
    synthetic = [(pc, d) for _, pc, d in jobs if pc.profile not in train]
    assert 30 <= len(synthetic) <= 66
    unseen = set(unseen_allergy_sets())
    assert frozenset({"gluten", "soy"}) in unseen and frozenset() not in unseen
    menu = load_menu()
    sets = set()
    for task, pc, diner in jobs:
        allergies = frozenset(diner.get("allergies") or [])
        assert allergies not in unseen or pc.profile in train
        assert set(allergies) <= set(concierge.dimensions["allergies"].values)
        assert diner["verbosity"] in concierge.dimensions["verbosity"].values
        assert feasible(menu, task, sorted(allergies), diner.get("diet") == "vegetarian")
        sets.add(allergies)
    base_sets = {frozenset(d.get("allergies") or []) for _, _, d in plain}
    assert len(sets) > len(base_sets) + 5
    with pytest.raises(ValueError, match="training data only"):
        pair_jobs("heldout", 5, seed=3, constitution=concierge, variants=0.5)
