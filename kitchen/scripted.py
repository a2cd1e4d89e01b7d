"""Scripted concierge agents: the synthetic dialogues behind the cold start and the GRM data.

Seed 001 (§4, module 1) starts RL from an SFT model that already uses tools and carries a
multi-turn conversation, trained on synthesised agentic dialogues. Here a rule-based agent plays
the concierge world and its dialogues become the SFT data.

The agent is competent but, on purpose, not personal: its *quirks* are drawn per episode at random
and independently of the diner's profile, so a model imitating it learns the marginal behaviour —
sometimes it skips the allergen check, writes too much for a brief diner or too little for a
detailed one, opens with small talk for a hurried diner, does not ask when the request names no
cuisine, orders without consent, ignores a vegetarian diet. Conditioning on the profile is what RL
must add.

The same agent with higher quirk rates (and a few deliberate red-line breaches: asking for a phone
number, naming a dish no tool returned, ordering a rejected dish) produces trajectories that break
every clause of the concierge constitution; the judge labels them for GRM training.

Departures from the seeds:
1. Seed 001 synthesises the cold-start dialogues with an automated (LLM-driven) framework; here a
   rule-based agent writes them, so the data is exact, cheap and reproducible on a CPU.
2. The quirks are deliberately independent of the profile (a generic policy), which makes the
   personalisation gap that RL must close visible and measurable.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from kitchen.config import StrictModel
from kitchen.world import Dish, Task, Trajectory, World, mismatch

Verbosity = Literal["brief", "normal", "detailed"]


class Quirks(StrictModel):
    """Probabilities, per episode, of each behaviour. Defaults: the generic SFT agent."""

    skip_allergen_check: float = Field(0.15, ge=0, le=1, description="Recommend unchecked (T1).")
    no_consent: float = Field(0.1, ge=0, le=1, description="Order without recommending (T2).")
    confirm_in_recommendation: float = Field(
        0.6, ge=0, le=1, description="Ask 'Order it?' in the recommendation itself."
    )
    small_talk: float = Field(0.3, ge=0, le=1, description="Open with a greeting (T4).")
    no_ask_when_ambiguous: float = Field(0.35, ge=0, le=1, description="Guess a cuisine (T5).")
    ignore_diet: float = Field(0.3, ge=0, le=1, description="Ignore a vegetarian diet (T7).")
    follow_profile_style: float = Field(
        0.0, ge=0, le=1, description="Match the diner's verbosity; 0 = pick a style at random."
    )
    ask_pii: float = Field(0.0, ge=0, le=1, description="Ask for a phone number (A2).")
    unreturned_dish: float = Field(
        0.0, ge=0, le=1, description="Name a dish before searching (A3)."
    )
    order_rejected: float = Field(0.0, ge=0, le=1, description="Order a rejected dish (A4).")
    allergen_pick: float = Field(0.0, ge=0, le=1, description="Pick an allergen dish (A1).")


SFT_QUIRKS = Quirks()
#: For GRM training data: every clause is broken often enough to learn what a violation looks like.
GRM_QUIRKS = Quirks(
    skip_allergen_check=0.4,
    no_consent=0.25,
    small_talk=0.4,
    no_ask_when_ambiguous=0.5,
    ignore_diet=0.5,
    ask_pii=0.15,
    unreturned_dish=0.15,
    order_rejected=0.15,
    allergen_pick=0.2,
)
#: The agent the constitution asks for (a reference for evaluation and tests).
IDEAL_QUIRKS = Quirks(
    skip_allergen_check=0,
    no_consent=0,
    confirm_in_recommendation=1,
    small_talk=0,
    no_ask_when_ambiguous=0,
    ignore_diet=0,
    follow_profile_style=1,
)

GREETINGS = [
    "Hello! Happy to help you today.",
    "Hi there, let me help you find a meal.",
    "Good evening! I'm glad to help you order.",
]
CUISINE_Q = {
    "brief": ["Which cuisine?", "Which cuisine do you want?"],
    "normal": ["Which cuisine would you like today?", "What kind of food would you like?"],
    "detailed": [
        "Happy to help. Before I search the menu, which cuisine would you like "
        "today? We have seven to choose from."
    ],
}


def recommendation(dish: Dish, style: Verbosity, *, checked: bool, confirm: bool) -> str:
    """A recommendation message in one of three lengths (the T3/T6 contrast)."""
    ask = " Order it?" if style == "brief" else " Shall I order it?"
    ask = ask if confirm else ""
    if style == "brief":
        return f"{dish.name}: {dish.price:g}$, {dish.minutes} min.{ask}"
    if style == "normal":
        return (
            f"I recommend {dish.name}, {dish.price:g} dollars, ready in {dish.minutes} "
            f"minutes.{ask}"
        )
    veg = " It is vegetarian." if dish.vegetarian else ""
    what = f" It has {', '.join(dish.ingredients)}." if checked else " It is a popular choice."
    return (
        f"I recommend {dish.name}.{what} It costs {dish.price:g} dollars and arrives in "
        f"{dish.minutes} minutes.{veg}{ask}"
    )


class ScriptedAgent:
    """Plays one episode in a `World` through text actions only."""

    def __init__(self, quirks: Quirks = SFT_QUIRKS, seed: int = 0):
        self.q = quirks
        self.rng = random.Random(f"agent:{seed}")

    def _p(self, p: float) -> bool:
        return self.rng.random() < p

    def play(
        self, world: World, task: Task, dimensions: dict[str, Any], **reset_kw: Any
    ) -> Trajectory:
        world.reset(task, dimensions, **reset_kw)
        rng, q, menu = self.rng, self.q, world.menu
        style: Verbosity = (
            dimensions.get("verbosity", "normal")
            if self._p(q.follow_profile_style)
            else rng.choice(["brief", "normal", "detailed"])
        )
        allergies = list(dimensions.get("allergies") or [])
        vegetarian = dimensions.get("diet") == "vegetarian" and not self._p(q.ignore_diet)
        check = not self._p(q.skip_allergen_check)
        consent = not self._p(q.no_consent)
        confirm_in_rec = self._p(q.confirm_in_recommendation)
        quirky = {
            "pii": self._p(q.ask_pii),
            "unreturned": self._p(q.unreturned_dish),
            "order_rejected": self._p(q.order_rejected),
            "allergen": self._p(q.allergen_pick) and bool(allergies),
        }
        done = False

        def act(text: str) -> str:
            nonlocal done
            obs, done = world.step(text)
            return obs

        if self._p(q.small_talk):
            act(rng.choice(GREETINGS))
        if quirky["pii"] and not done:
            act(
                rng.choice(
                    [
                        "Could you give me your phone number for the order?",
                        "What is your full name and address, please?",
                    ]
                )
            )
        if quirky["unreturned"] and not done:
            act(recommendation(rng.choice(menu.dishes), style, checked=False, confirm=False))
        cuisine = task.cuisine
        if cuisine is None and not done:
            if self._p(q.no_ask_when_ambiguous):
                cuisine = rng.choice(menu.cuisines)
            else:
                reply = act(rng.choice(CUISINE_Q[style]))
                cuisine = next(
                    (c for c in menu.cuisines if c in reply.lower()), None
                ) or rng.choice(menu.cuisines)
        tried: set[str] = set()
        rejected: list[str] = []
        while not done:
            act(f"@search {cuisine}")
            if done:
                break
            candidates = [
                d
                for d in menu.dishes
                if d.cuisine == cuisine
                and d.name not in tried
                and not mismatch(
                    d,
                    Task(id="", request="", max_price=task.max_price, max_minutes=task.max_minutes),
                    vegetarian=vegetarian,
                )
            ]
            if quirky["allergen"]:
                candidates.sort(key=lambda d: not set(d.allergens) & set(allergies))
            else:
                rng.shuffle(candidates)
            ordered = False
            for dish in candidates:
                if done:
                    break
                tried.add(dish.name)
                if check:
                    act(f"@allergens {dish.name}")
                    if done:
                        break
                    if set(dish.allergens) & set(allergies) and not quirky["allergen"]:
                        continue
                quirky["allergen"] = False
                if not consent:
                    act(f"@order {dish.name}")
                    ordered = True
                    break
                act(recommendation(dish, style, checked=check, confirm=confirm_in_rec))
                if done:
                    break
                if dish.name in world.view.rejected:  # the agent reads the diner's refusal
                    rejected.append(dish.name)
                    if quirky["order_rejected"]:
                        act(f"@order {dish.name}")
                        ordered = True
                        break
                    continue
                if not confirm_in_rec:
                    ask = (
                        f"Order {dish.name}?"
                        if style == "brief"
                        else f"Shall I order {dish.name} for you?"
                    )
                    act(ask)
                    if done:
                        break
                act(f"@order {dish.name}")
                ordered = True
                break
            if ordered or done:
                break
            # nothing left in this cuisine: another one if the diner never named one
            others = [c for c in menu.cuisines if c != cuisine]
            if task.cuisine is None and others:
                cuisine = rng.choice(others)
            else:
                act("Sorry, nothing on the menu fits your request.")
                while not done:
                    act("Sorry, I could not find a dish for you.")
        return world.traj


def episodes(
    n: int,
    split: Literal["train", "heldout"] = "train",
    seed: int = 0,
    quirks: Quirks = SFT_QUIRKS,
    constitution: Any = None,
    max_turns: int | None = None,
) -> list[tuple[Trajectory, Any]]:
    """`n` scripted episodes on `split` tasks and profiles: [(trajectory, personal constitution)].

    Each task is paired with a profile of the same split for which some dish fits (an
    impossible request would only teach the agent to apologise).
    """
    from kitchen import paths
    from kitchen.constitution import PersonalizationCache, load_constitution
    from kitchen.profile import load_profiles, redact
    from kitchen.world import DEFAULT_MAX_TURNS, fitting, generate_tasks, load_split

    c = constitution or load_constitution(paths.DEFAULT_CONSTITUTION)
    ids = set(load_split(split))
    profiles = [p for p in load_profiles(paths.PROFILES) if p.id in ids]
    cache = PersonalizationCache()
    world = World(max_turns=max_turns or DEFAULT_MAX_TURNS)
    rng = random.Random(f"pairs:{split}:{seed}")
    out = []
    for i, task in enumerate(generate_tasks(n * 3, seed=seed, split=split)):
        if len(out) == n:
            break
        profile = rng.choice(profiles)
        pc = cache.get(c, profile)
        real = {k: v.value for k, v in redact(profile).dimensions.items()}
        diner = pc.dimensions | {k: v for k, v in real.items() if k in pc.dimensions}
        if not fitting(
            world.menu, task, diner.get("allergies") or [], diner.get("diet") == "vegetarian"
        ):
            continue
        agent = ScriptedAgent(quirks, seed=hash((seed, i)) & 0xFFFFFFFF)
        traj = agent.play(
            world,
            task,
            pc.dimensions,
            profile=pc.profile,
            personal_version=pc.version,
            seed=seed * 100_003 + i,
            episode=f"{split}-{seed}-{i:05d}",
            diner=diner,
        )
        out.append((traj, pc))
    return out


def chat_row(traj: Trajectory) -> dict[str, Any]:
    """A trajectory as an SFT example: `{"messages": [{"role", "content"}...]}` (tool ids dropped)."""
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in traj.messages]}


def write_sft_data(
    out_dir: str, n_train: int = 3000, n_eval: int = 200, seed: int = 0, quirks: Quirks = SFT_QUIRKS
) -> dict[str, Any]:
    """Write `train.jsonl` (train tasks and profiles) and `eval.jsonl` (held-out ones)."""
    from pathlib import Path

    from kitchen.files import atomic_write_json, write_jsonl

    out = Path(out_dir)
    stats = {}
    for name, split, n in (("train", "train", n_train), ("eval", "heldout", n_eval)):
        eps = episodes(n, split=split, seed=seed, quirks=quirks)
        write_jsonl(out / f"{name}.jsonl", (chat_row(t) for t, _ in eps))
        stats[name] = {
            "dialogues": len(eps),
            "success": sum(t.outcome.success for t, _ in eps) / max(len(eps), 1),
            "assistant_turns": sum(len(t.turns) for t, _ in eps) / max(len(eps), 1),
        }
    stats["command"] = (
        f"kitchen world sft-data --out {out_dir} --train {n_train} --eval {n_eval} --seed {seed}"
    )
    atomic_write_json(out / "stats.json", stats)
    return stats
