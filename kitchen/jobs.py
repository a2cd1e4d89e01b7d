"""Jobs: the (task, diner) pairs a run plays, and what the simulated diner really holds.

A *job* is `(task, personal constitution, diner values)`: the request, the constitution
personalised for the diner (what the policy is shown and the judge checks against), and the
values the simulated diner really holds — the redacted profile's own values, low-confidence ones
included (a diner unsure of their verbosity on paper still has one). Training pairs training
tasks with training profiles, evaluation held-out with held-out; a pair for which no dish on the
menu fits the diner is skipped, since an impossible request would teach only apologies.

`kitchen.train` (the task pool), `kitchen.evaluate` (the held-out set) and the TRL and verl
integrations draw their jobs here, so the same seed gives the same jobs everywhere. This is the
loop's first step in docs/method.md#policy-update: tasks sampled along the profile
distribution.

Departures from the method (docs/method.md):
1. Pairs no menu dish can satisfy are skipped rather than played: the method samples freely, but
   here an impossible request would only teach the policy to apologise.
2. Profiles are drawn uniformly from their split (or in turn, for evaluation), not weighted by how
   often such users come: the shipped profiles are a designed spread, not a population sample.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from kitchen import paths
from kitchen.constitution import Constitution, PersonalConstitution, PersonalizationCache
from kitchen.profile import Profile, redact, variant
from kitchen.world import Task, feasible, generate_tasks, load_menu, load_split

Job = tuple[Task, PersonalConstitution, dict[str, Any]]


def diner_values(pc: PersonalConstitution, profile: Profile) -> dict[str, Any]:
    """The dimension values the simulated diner holds: the profile's own where it has them."""
    real = {k: v.value for k, v in redact(profile).dimensions.items()}
    return pc.dimensions | {k: v for k, v in real.items() if k in pc.dimensions}


def pair_jobs(
    split: Literal["train", "heldout"],
    n: int,
    seed: int,
    constitution: Constitution,
    *,
    cache: PersonalizationCache | None = None,
    order: Literal["random", "rotate"] = "random",
    key: str = "pool",
    long_share: float = 0.0,
    variants: float = 0.0,
) -> list[Job]:
    """`n` feasible jobs of one split, deterministic in (`key`, `seed`).

    `order="random"` draws a profile per task (a training pool); `"rotate"` takes the split's
    profiles in turn, so every held-out diner is evaluated about equally often. `long_share` of
    the tasks drawn are meals (`kitchen.world.generate_tasks`); a meal is feasible for a diner
    when every course it asks for has a dish that fits. `variants` (training only) is the share
    of jobs whose diner is a synthetic variant of the drawn profile (`kitchen.profile.variant`:
    dimensions redrawn, never a held-out diner's allergy set): more diners than the split holds,
    for data whose reader must learn to read a profile rather than remember eighteen.
    """
    from kitchen.profile import load_profiles

    cache = cache or PersonalizationCache()
    menu = load_menu()
    ids = set(load_split(split))
    profiles = [p for p in load_profiles(paths.PROFILES) if p.id in ids]
    if variants and split != "train":
        raise ValueError("variants: synthetic diners are for training data only")
    avoid = unseen_allergy_sets() if variants else []
    rng = random.Random(f"{key}:{seed}")
    jobs: list[Job] = []
    for task in generate_tasks(n * 4, seed=seed, split=split, long_share=long_share):
        if len(jobs) == n:
            break
        p = rng.choice(profiles) if order == "random" else profiles[len(jobs) % len(profiles)]
        if variants and rng.random() < variants:
            p = variant(p, constitution, rng, avoid)
        pc = cache.get(constitution, p)
        diner = diner_values(pc, p)
        if feasible(menu, task, diner.get("allergies") or [], diner.get("diet") == "vegetarian"):
            jobs.append((task, pc, diner))
    return jobs


def unseen_allergy_sets() -> list[frozenset[str]]:
    """The held-out diners' allergy sets that no training diner holds: synthetic training diners
    (`pair_jobs(variants=...)`) never get one, so evaluation still meets them first."""
    from kitchen.profile import split_profiles

    def sets(split: str) -> set[frozenset[str]]:
        out = set()
        for p in split_profiles(split):
            a = p.dimensions.get("allergies")
            out.add(frozenset(a.value if a is not None else []))
        return out

    return sorted(sets("heldout") - sets("train"), key=sorted)
