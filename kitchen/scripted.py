"""Scripted concierge agents: the synthetic dialogues behind the cold start and the GRM data.

docs/method.md#cold-start: RL starts from an SFT model that already uses tools and carries a
multi-turn conversation, trained on synthesised agentic dialogues. Here a rule-based agent plays
the concierge world — single dishes and multi-course meals — and its dialogues become the SFT data.

The agent is competent but imperfect on purpose, and *partly* personal. Per episode (or per
course of a meal, with `style_draw: course`) it is **attentive** with probability
`follow_profile_style`: it then writes in the diner's verbosity
(brief: a few words, within T3's limit; detailed: a description of at least T6's `min_words`,
kept within a hurried diner's patience) and, for a hurried diner, never opens a course with small
talk (T4). Otherwise it picks a style at random and opens with small talk at the `small_talk`
rate whatever the pace. The other quirks are drawn independently of the profile: it sometimes
skips the allergen check, orders without consent, does not ask when the request names no
cuisine, ignores a vegetarian diet, and in a meal names two courses in one message or offers a
course nobody asked for.

Rates of the generic SFT agent (`SFT_QUIRKS`) and why:
- `follow_profile_style` = 0.55 with `small_talk` = 0.4: with a random style matching by chance
  a third of the time, the diner's verbosity is matched in 0.55 + 0.45/3 = 70% of episodes, and
  a hurried diner meets small talk first in 0.45 × 0.4 = 18% of episodes against 40% for a
  relaxed one. The profile visibly shapes the data, so a cold-start policy can learn to
  condition on it (before, it could not: the quirks ignored the profile), yet about 30% of the
  episodes still get it wrong, which leaves RL something to do (docs/method.md#personalisation):
  in the data about 85% of brief diners' messages keep T3's limit, 70% of detailed diners'
  recommendations reach T6's minimum and 87% of hurried diners' openings pass T4 — short of the
  95% / +20 points / 90% the RL policy is asked for. (At 0.6 and 0.3 the data already passed T4
  for 92% of hurried diners' turns: too little room.) The measured per-clause pass rates, short
  and long tasks apart, are in `data/sft/stats.json`.
- The per-decision quirks (`skip_allergen_check` 0.15, `no_consent` 0.1, …) are drawn per
  course: a meal gets its mistakes spread over its courses — a skipped check on the dessert
  after three good courses — which is the credit-assignment problem of a long episode
  (docs/method.md#credit-assignment), not one flag for the whole dialogue.
- It never breaks A2–A4 on purpose (no personal question, no unreturned dish, no rejected dish
  ordered), never picks an allergen dish, and never orders beyond the request (T8): a cold start
  should not teach red lines. An unchecked recommendation can still hit an allergen (A1) — the
  mistake T1 exists to prevent.
- `unsafe_check_first` is 0 here (the GRM's review data plays this agent too): about one check
  in six of an allergic diner finds an allergen. The shipped SFT data sets it to 1 (`kitchen
  world sft-data`'s default `--unsafe-checks 1`): every such course opens with one, which the
  agent passes over — data for a policy that has to learn what an unsafe check means
  (docs/method.md#cold-start). That data also plays half its training dialogues for synthetic
  diners (`--variants 0.5`), so allergy lists vary: `SHIPPED_SFT_QUIRKS` and `SHIPPED_VARIANTS`,
  the defaults of `write_sft_data` and of the command.

The same agent with higher quirk rates (`GRM_QUIRKS`) and deliberate breaches — asking for a phone
number, naming a dish no tool returned, ordering a rejected dish, picking an allergen dish,
ordering a second dish of a course — produces trajectories that break every clause of the
concierge constitution, on short tasks and late in meals alike; the judge labels them for GRM
training. `IDEAL_QUIRKS` is the agent the constitution asks for.

Departures from the method:
1. The method synthesises cold-start dialogues with an automated (LLM-driven) framework; here a
   rule-based agent writes them, so the data is exact, cheap and reproducible on a CPU.
2. Personalisation in the data is partial by design (rates above): a fully personal teacher would
   leave RL nothing to learn about personalisation, a fully generic one would give the policy no
   way to start.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any, Literal

from pydantic import Field

from kitchen.config import KitchenError, StrictModel
from kitchen.world import (
    COURSES,
    IMPATIENT_WORDS,
    REJECT_RE,
    Dish,
    Menu,
    Task,
    Trajectory,
    World,
    load_menu,
    word_count,
)

Verbosity = Literal["brief", "normal", "detailed"]


class Quirks(StrictModel):
    """Probabilities of each behaviour: per episode, or per course where marked (a short task has
    one course). Defaults: the generic SFT agent."""

    skip_allergen_check: float = Field(
        0.15, ge=0, le=1, description="Per course: recommend unchecked (T1)."
    )
    no_consent: float = Field(
        0.1, ge=0, le=1, description="Per course: order without recommending (T2)."
    )
    confirm_in_recommendation: float = Field(
        0.6, ge=0, le=1, description="Per course: ask 'Order it?' in the recommendation itself."
    )
    small_talk: float = Field(
        0.4, ge=0, le=1, description="Open with a greeting, and per later course a remark (T4)."
    )
    no_ask_when_ambiguous: float = Field(0.35, ge=0, le=1, description="Guess a cuisine (T5).")
    ignore_diet: float = Field(0.3, ge=0, le=1, description="Ignore a vegetarian diet (T7).")
    follow_profile_style: float = Field(
        0.55,
        ge=0,
        le=1,
        description="Attentive episodes: the diner's verbosity, and no small talk for a hurried "
        "diner; otherwise a random style (see the module docstring for the rate).",
    )
    style_draw: Literal["episode", "course"] = Field(
        "episode",
        description="When `follow_profile_style` is drawn: once per episode (the style then "
        "holds throughout, so a policy can learn to copy its own earlier messages), or again at "
        "every course of a meal (only the profile predicts the next course's style).",
    )
    bundle_courses: float = Field(
        0.1, ge=0, le=1, description="Per course of a meal: name the next course too (T9)."
    )
    upsell: float = Field(
        0.1, ge=0, le=1, description="Per meal: offer a course not asked for (T9)."
    )
    ask_pii: float = Field(0.0, ge=0, le=1, description="Ask for a phone number (A2).")
    unreturned_dish: float = Field(
        0.0, ge=0, le=1, description="Per course: name a dish before searching (A3)."
    )
    order_rejected: float = Field(
        0.0, ge=0, le=1, description="Per course: order a rejected dish (A4)."
    )
    allergen_pick: float = Field(
        0.0, ge=0, le=1, description="Per course: pick an allergen dish (A1)."
    )
    unsafe_check_first: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Per course of an allergic diner, when the agent checks: check a dish "
        "holding one of the diner's allergens first (the check finds it, the agent moves on), "
        "so the data shows what an unsafe check leads to more often. Breaks no clause.",
    )
    extra_order: float = Field(
        0.0, ge=0, le=1, description="Per course of a meal: order a second dish (T8)."
    )


SFT_QUIRKS = Quirks()
#: The shipped SFT data (`data/sft`): the SFT agents with every allergic diner's course opening
#: with an unsafe check (the GRM's review data plays `SFT_QUIRKS` itself, so that stays 0), and
#: half the training dialogues played for synthetic diners. `write_sft_data` and `kitchen world
#: sft-data` write it by default.
SHIPPED_SFT_QUIRKS = SFT_QUIRKS.model_copy(update={"unsafe_check_first": 1.0})
SHIPPED_VARIANTS = 0.5
#: For GRM training data: every clause is broken often enough to learn what a violation looks like.
GRM_QUIRKS = Quirks(
    skip_allergen_check=0.4,
    no_consent=0.25,
    small_talk=0.4,
    no_ask_when_ambiguous=0.5,
    ignore_diet=0.6,
    follow_profile_style=0.0,
    bundle_courses=0.2,
    upsell=0.3,
    ask_pii=0.25,
    unreturned_dish=0.25,
    order_rejected=0.3,
    allergen_pick=0.4,
    extra_order=0.25,
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
    bundle_courses=0,
    upsell=0,
)

GREETINGS = [
    "Hello! Happy to help you today.",
    "Hi there, let me help you find a meal.",
    "Good evening! I'm glad to help you order.",
]
TRANSITIONS = [
    "Great choice! Now the {course}.",
    "Lovely. Let's find your {course} next.",
    "Done. On to the {course}.",
]
CUISINE_Q = {
    "brief": ["Which cuisine?", "Which cuisine do you want?"],
    "normal": ["Which cuisine would you like today?", "What kind of food would you like?"],
    "detailed": [
        "Happy to help. Before I search the menu, which cuisine would you like "
        "today? We have seven to choose from."
    ],
}
PII_QUESTIONS = [
    "Could you give me your phone number for the order?",
    "What is your full name and address, please?",
]
_WANTED = re.compile(r"I wanted (\w+)\.")


def recommendation(
    dish: Dish,
    style: Verbosity,
    *,
    checked: bool,
    confirm: bool,
    words: tuple[int, int] | None = None,
) -> str:
    """A recommendation message in one of three lengths (the T3/T6 contrast).

    `words = (least, most)`: a detailed message is chosen among a full and a compact form to
    have at least `least` and at most `most` words where one does (a hurried diner who wants
    details: T6's minimum, within the diner's patience)."""
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
    full = (
        f"I recommend {dish.name}.{what} It costs {dish.price:g} dollars and arrives in "
        f"{dish.minutes} minutes.{veg}{ask}"
    )
    if words is None:
        return full
    has = f" With {', '.join(dish.ingredients)}." if checked else ""
    compact = f"{dish.name}.{has} {dish.price:g} dollars, {dish.minutes} minutes.{veg}{ask}"
    least, most = words
    for text in (full, compact):
        if least <= word_count(text) <= most:
            return text
    return compact if word_count(full) > most else full


class ScriptedAgent:
    """Plays one episode in a `World` through text actions only."""

    def __init__(self, quirks: Quirks = SFT_QUIRKS, seed: int = 0):
        self.q = quirks
        self.rng = random.Random(f"agent:{seed}")

    def _p(self, p: float) -> bool:
        return self.rng.random() < p

    def play(
        self,
        world: World,
        task: Task,
        dimensions: dict[str, Any],
        *,
        limits: dict[str, int] | None = None,
        **reset_kw: Any,
    ) -> Trajectory:
        """One episode of `task` for a diner of `dimensions`. `limits` (`max_words`,
        `min_words`: the personal T3/T6 parameters) let an attentive agent hit them exactly;
        without, it assumes the constitution's defaults."""
        world.reset(task, dimensions, **reset_kw)
        _Episode(self, world, task, dimensions, limits or {}).run()
        return world.traj


class _Episode:
    """The state of one scripted episode: what the agent has learnt so far and decided once."""

    def __init__(
        self,
        agent: ScriptedAgent,
        world: World,
        task: Task,
        dims: dict[str, Any],
        limits: dict[str, int],
    ):
        self.agent, self.world, self.task, self.menu = agent, world, task, world.menu
        q, p, rng = agent.q, agent._p, agent.rng
        self.q, self.p, self.rng = q, p, rng
        self.dims, self.least = dims, limits.get("min_words", 12)
        self.most = min(
            limits.get("max_words", 60), IMPATIENT_WORDS if dims.get("pace") == "hurried" else 60
        )
        self.choose_style()
        self.allergies = list(dims.get("allergies") or [])
        self.vegetarian = dims.get("diet") == "vegetarian" and not p(q.ignore_diet)
        self.courses: list[str | None] = list(task.courses) or [None]
        self.pii_at = rng.randrange(len(self.courses)) if p(q.ask_pii) else -1
        asked = set(task.courses)
        spare = [c for c in COURSES if c not in asked]
        self.upsell = (
            rng.choice(spare) if task.courses and spare and p(q.upsell) else None
        )  # a course nobody asked for, offered once
        self.upsell_at = rng.randrange(len(self.courses)) if self.upsell else -1
        self.cuisine = task.cuisine
        self.done = False
        self.tried: set[str] = set()
        self.pending: Dish | None = None  # the next course's dish, named with this one (T9)
        self.pending_checked = False
        self.allergen_pick = False
        self.unsafe_first = False

    def choose_style(self) -> None:
        """Attentive (the diner's verbosity, no small talk for a hurried diner) or a random
        style: once per episode, or again at every course with `style_draw: course`."""
        attentive = self.p(self.q.follow_profile_style)
        self.style: Verbosity = (
            self.dims.get("verbosity", "normal")
            if attentive
            else self.rng.choice(["brief", "normal", "detailed"])
        )
        self.chatty = not (attentive and self.dims.get("pace") == "hurried")  # small talk at all
        self.words = (self.least, self.most) if attentive and self.style == "detailed" else None

    # -- acting -------------------------------------------------------------------------------

    def act(self, text: str) -> str:
        obs, self.done = self.world.step(text)
        if obs.startswith("Shorter, please.") and self.style == "detailed":
            # the diner is in a hurry after all (its profile may not say so): keep it short
            self.words = (self.least, IMPATIENT_WORDS)
        return obs

    def say_small_talk(self, course: str | None, first: bool) -> None:
        if not self.chatty or not self.p(self.q.small_talk) or self.done:
            return
        if first:
            self.act(self.rng.choice(GREETINGS))
        else:
            self.act(self.rng.choice(TRANSITIONS).format(course=course))

    def candidates(self, course: str | None) -> list[Dish]:
        """Dishes of the search the agent picks from: in budget, in time, diet-aware, untried."""
        t = self.task
        out = [
            d
            for d in self.menu.search(self.cuisine, course)
            if d.name not in self.tried
            and (t.max_price is None or d.price <= t.max_price)
            and (t.max_minutes is None or d.minutes <= t.max_minutes)
            and (d.vegetarian or not self.vegetarian)
        ]
        self.rng.shuffle(out)
        if self.allergen_pick or self.unsafe_first:
            out.sort(key=lambda d: not set(d.allergens) & set(self.allergies))
        return out

    def search(self, course: str | None) -> None:
        self.act(f"@search {self.cuisine}" + (f" {course}" if course else ""))

    def unsafe(self, dish: Dish) -> bool:
        return bool(set(dish.allergens) & set(self.allergies))

    # -- one episode --------------------------------------------------------------------------

    def run(self) -> None:
        q, p, rng = self.q, self.p, self.rng
        self.say_small_talk(None, first=True)
        if self.pii_at == 0 and not self.done:
            self.act(rng.choice(PII_QUESTIONS))
        if self.cuisine is None and not self.done:
            if p(q.no_ask_when_ambiguous):
                self.cuisine = rng.choice(self.menu.cuisines)
            else:
                reply = self.act(rng.choice(CUISINE_Q[self.style]))
                self.cuisine = next(
                    (c for c in self.menu.cuisines if c in reply.lower()), None
                ) or rng.choice(self.menu.cuisines)
        for i, course in enumerate(self.courses):
            if self.done:
                break
            if i:
                if q.style_draw == "course":
                    self.choose_style()
                self.say_small_talk(course, first=False)
                if self.pii_at == i and not self.done:
                    self.act(rng.choice(PII_QUESTIONS))
            if self.upsell_at == i and not self.done:
                self.offer_unasked(self.upsell)
            nxt = self.courses[i + 1] if i + 1 < len(self.courses) else None
            if not self.done and not self.play_course(course, nxt):
                break
        while not self.done:  # a course could not be ordered: the turn budget runs out
            self.act("Sorry, I could not find a dish for you.")

    def offer_unasked(self, course: str) -> None:
        """Upsell: search, check and recommend a course the diner did not ask for (T9); with
        `extra_order`, order it whatever the diner said (T8)."""
        self.search(course)
        options = [d for d in self.candidates(course) if not self.unsafe(d)]
        if self.done or not options:
            return
        dish = options[0]
        self.act(f"@allergens {dish.name}")
        if self.done:
            return
        self.act(recommendation(dish, self.style, checked=True, confirm=True, words=self.words))
        if not self.done and self.p(self.q.extra_order):
            self.act(f"@order {dish.name}")

    def play_course(self, course: str | None, nxt: str | None) -> bool:
        """Search, check, recommend, get consent and order one course (a short task: its dish).
        True when it ordered a dish."""
        q, p, rng = self.q, self.p, self.rng
        self.check_first = not p(q.skip_allergen_check)
        self.consent = not p(q.no_consent)
        self.confirm = p(q.confirm_in_recommendation)
        self.order_rejected = p(q.order_rejected)
        self.allergen_pick = p(q.allergen_pick) and bool(self.allergies)
        # drawn only where asked for: the default data's random stream stays as it was
        self.unsafe_first = (
            q.unsafe_check_first > 0
            and self.check_first
            and bool(self.allergies)
            and p(q.unsafe_check_first)
        )
        self.bundle = nxt if nxt is not None and p(q.bundle_courses) else None
        if p(q.unreturned_dish):  # a dish named before any search of this course
            pool = [d for d in self.menu.dishes if d.course == (course or "main")]
            self.act(recommendation(rng.choice(pool), self.style, checked=False, confirm=False))
        pending, self.pending = self.pending, None
        switches = 0
        while not self.done:
            if pending is not None:  # searched (and maybe checked) with the previous course
                options = [pending] + [d for d in self.candidates(course) if d != pending]
                checked = {pending.name} if self.pending_checked else set()
                pending = None
            else:
                self.search(course)
                if self.done:
                    return False
                options, checked = self.candidates(course), set()
            result = "exhausted"
            for dish in options:
                result = self.offer(dish, course, dish.name in checked)
                if result != "next":
                    break
            if result == "ordered":
                return True
            if result == "switch":
                continue  # search again, in the cuisine the diner asked for
            if result == "done":
                return False
            # nothing left in this cuisine: another one if the diner never named one
            others = [c for c in self.menu.cuisines if c != self.cuisine]
            if self.task.cuisine is None and switches < 2:
                self.cuisine = rng.choice(others)
                switches += 1
                continue
            if not self.done:
                self.act("Sorry, nothing on the menu fits your request.")
            return False
        return False

    def offer(self, dish: Dish, course: str | None, checked: bool) -> str:
        """Check, recommend, confirm and order one dish: "ordered", "next" (try another),
        "switch" (the diner wants another cuisine) or "done" (the episode ended)."""
        self.tried.add(dish.name)
        if self.check_first and not checked:
            self.act(f"@allergens {dish.name}")
            if self.done:
                return "done"
            if self.unsafe(dish) and not self.allergen_pick:
                return "next"
            checked = True
        self.allergen_pick = self.unsafe_first = False
        if not self.consent:
            self.order(dish, course)
            return "ordered"
        text = recommendation(
            dish, self.style, checked=checked, confirm=self.confirm, words=self.words
        )
        if self.bundle and self.preview(self.bundle):
            text += f" And {self.pending.name} for the {self.bundle}."
        self.bundle = None
        if self.done:
            return "done"
        reply = self.act(text)
        if self.done:
            return "done"
        if REJECT_RE.match(reply):  # the agent reads the diner's refusal
            if self.order_rejected:
                self.order(dish, course)
                return "ordered"
            wanted = _WANTED.search(reply)
            if wanted and wanted.group(1).lower() != self.cuisine:
                self.cuisine, self.pending = wanted.group(1).lower(), None
                return "switch"
            return "next"
        if not self.confirm:
            ask = (
                f"Order {dish.name}?"
                if self.style == "brief"
                else f"Shall I order {dish.name} for you?"
            )
            self.act(ask)
            if self.done:
                return "done"
        self.order(dish, course)
        return "ordered"

    def preview(self, course: str) -> bool:
        """Search (and check) the next course's dish now, to name it in this message (T9)."""
        self.search(course)
        options = self.candidates(course)
        if self.done or not options:
            return False
        dish = options[0]
        if self.check_first:
            self.act(f"@allergens {dish.name}")
            if self.done or self.unsafe(dish):
                return False
        self.pending, self.pending_checked = dish, self.check_first
        return True

    def order(self, dish: Dish, course: str | None) -> None:
        self.act(f"@order {dish.name}")
        if self.done or course is None or not self.p(self.q.extra_order):
            return
        others = [d for d in self.candidates(course) if d.name != dish.name]
        if others:  # a second dish of the same course (T8)
            self.act(f"@order {others[0].name}")


def episodes(
    n: int,
    split: Literal["train", "heldout"] = "train",
    seed: int = 0,
    quirks: Quirks = SFT_QUIRKS,
    constitution: Any = None,
    max_turns: int | None = None,
    long_share: float = 0.0,
    variants: float = 0.0,
) -> list[tuple[Trajectory, Any]]:
    """`n` scripted episodes on `split` tasks and profiles: [(trajectory, personal constitution)].

    Each task is paired with a profile of the same split for which it is feasible (an
    impossible request would only teach the agent to apologise). `long_share` of the tasks are
    meals, played with a budget of `LONG_MAX_TURNS` (short ones: `DEFAULT_MAX_TURNS`), unless
    `max_turns` sets one for both. `variants` of the diners are synthetic variants of training
    profiles (`kitchen.jobs.pair_jobs`).
    """
    from kitchen import paths
    from kitchen.constitution import load_constitution
    from kitchen.jobs import pair_jobs
    from kitchen.world import DEFAULT_MAX_TURNS, LONG_MAX_TURNS

    c = constitution or load_constitution(paths.DEFAULT_CONSTITUTION)
    jobs = pair_jobs(
        split, n, seed, c, key=f"pairs:{split}", long_share=long_share, variants=variants
    )
    worlds = {
        "short": World(max_turns=max_turns or DEFAULT_MAX_TURNS),
        "long": World(max_turns=max_turns or LONG_MAX_TURNS),
    }
    out = []
    for i, (task, pc, diner) in enumerate(jobs):
        params = {p.id: p.params for p in pc.clauses}
        limits = {
            "max_words": params.get("T3", {}).get("max_words", 60),
            "min_words": params.get("T6", {}).get("min_words", 12),
        }
        agent = ScriptedAgent(quirks, seed=hash((seed, i)) & 0xFFFFFFFF)
        traj = agent.play(
            worlds[task.kind],
            task,
            pc.dimensions,
            limits=limits,
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


RENAME_TRIES = 1_000  # draws of an invented name before `renamed_row` gives up


def renamed_row(
    row: dict[str, Any],
    rng: random.Random,
    menu: Menu | None = None,
    names: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`row` (a `chat_row`) with every menu dish it names renamed, the same way in every message:
    the search results, the allergen checks' replies, the recommendations, the orders and the
    diner's answers. Each new name is two or three capitalised words of the menu's own names drawn
    at random (`Mango Satay Soup`), never a real dish and never one already used in the dialogue.
    An invented name may say another course or an allergen (`Caprese Milk` for a soda): only the
    search result and the check say what a dish is.

    Why (docs/method.md#cold-start): a small policy trained on one menu learns its names as
    phrases and writes one from memory — the first word chosen, the rest recalled — where it
    should copy the dish the search or the check in front of it named. In a renamed dialogue
    memory cannot help: the only way to the next word of a name is the context. `names`, when
    given, receives each renamed dish's menu name and its new one.
    """
    menu = menu or load_menu()
    words = sorted({w for d in menu.dishes for w in d.name.split() if w[:1].isupper()})
    text = "\n".join(m["content"] or "" for m in row["messages"])
    new: dict[str, str] = {}
    for dish in menu.mentioned(text):
        for _ in range(RENAME_TRIES):
            fake = " ".join(rng.sample(words, min(len(words), rng.choice((2, 2, 3)))))
            if fake not in new.values() and not menu.mentioned(fake):
                break
        else:
            raise KitchenError(
                f"no new name for {dish.name!r} in {RENAME_TRIES} draws: the menu's names hold "
                f"too few words ({len(words)}) to invent names that are not dishes already"
            )
        new[dish.name] = fake
    if names is not None:
        names.update(new)
    return {
        "messages": [
            {
                "role": m["role"],
                "content": menu.rename(m["content"], new) if m["content"] else m["content"],
            }
            for m in row["messages"]
        ]
    }


def check_drill(traj: Trajectory, pc: Any) -> dict[str, Any] | None:
    """An allergic diner's dialogue cut after the assistant turn that follows its last allergen
    check — recommend the checked dish or move on, the decision the check's reply informs — as an
    SFT example; None when the diner has no allergies or no turn follows a check."""
    if not pc.dimensions.get("allergies"):
        return None
    checks = [
        i
        for i, ti in enumerate(traj.turns)
        if ti.action.kind == "tool" and ti.action.tool == "allergens"
    ]
    if not checks or checks[-1] + 1 >= len(traj.turns):
        return None
    after = traj.turns[checks[-1] + 1]
    return {"messages": chat_row(traj)["messages"][: after.message + 1]}


DRILL_SEARCH = 1_000  # episodes played without a single drill before `check_drills` gives up


def check_drills(
    n: int, seed: int = 0, quirks: Quirks = SHIPPED_SFT_QUIRKS, variants: float = SHIPPED_VARIANTS
) -> list[dict[str, Any]]:
    """`n` check drills (`check_drill`) from single-dish episodes on training tasks and diners,
    played from a seed stream of their own, so they add decisions the training dialogues do not
    hold. In a whole dialogue the token after a check is one in a few hundred; drills are short."""
    drills: list[dict[str, Any]] = []
    played = 0
    for round_ in itertools.count():
        size = max(2 * n, 50)
        eps = episodes(
            size, split="train", seed=seed * 1_000 + 7 + round_, quirks=quirks, variants=variants
        )
        played += size
        drills += [d for d in (check_drill(t, pc) for t, pc in eps) if d is not None]
        if len(drills) >= n:
            return drills[:n]
        if not drills and played >= DRILL_SEARCH:
            raise KitchenError(
                f"no check drills in {played} scripted episodes: no allergic diner's dialogue "
                "has a turn after an allergen check (agents that never check, or no allergic "
                "diners)"
            )
    raise AssertionError("unreachable")


def data_stats(eps: list[tuple[Trajectory, Any]]) -> dict[str, Any]:
    """What a set of scripted episodes holds: success, turns, and per-clause pass rates — all
    of them and by profile group for the personal clauses (T3 for brief diners, T6 for detailed
    ones, T4 for hurried ones) — so the data's room for RL is on record."""
    from kitchen.evaluate import policy_report
    from kitchen.judge import judge

    if not eps:
        return {"dialogues": 0}
    trajs, pcs = [t for t, _ in eps], [pc for _, pc in eps]
    reviews = [judge(t, pc) for t, pc in eps]
    report = policy_report(trajs, pcs, reviews)
    turns = sorted(len(t.turns) for t in trajs)

    def group_pass(clause: str, key: str, value: str) -> float | None:
        vs = [
            v.verdict == "pass"
            for r, pc in zip(reviews, pcs, strict=True)
            if pc.dimensions.get(key) == value
            for v in r.verdicts
            if v.clause == clause and v.verdict in ("pass", "violate")
        ]
        return round(sum(vs) / len(vs), 4) if vs else None

    return {
        "dialogues": len(eps),
        "success": round(report.success, 4),
        "assistant_turns": round(sum(turns) / len(turns), 3),
        "assistant_turns_p10_p50_p90_max": [
            turns[len(turns) // 10],
            turns[len(turns) // 2],
            turns[min(len(turns) - 1, len(turns) * 9 // 10)],
            turns[-1],
        ],
        "compliance": round(report.compliance, 4),
        "clause_pass": {c: round(x, 4) for c, x in report.clause_pass.items()},
        "clause_n": report.clause_n,
        "personal": {
            "T3_pass/brief": group_pass("T3", "verbosity", "brief"),
            "T6_pass/detailed": group_pass("T6", "verbosity", "detailed"),
            "T4_pass/hurried": group_pass("T4", "pace", "hurried"),
        },
        "personalisation": {k: round(x, 3) for k, x in report.personalisation.items()},
    }


def write_sft_data(
    out_dir: str,
    n_train: int = 4000,
    n_eval: int = 200,
    seed: int = 0,
    quirks: Quirks = SHIPPED_SFT_QUIRKS,
    long_share: float = 0.5,
    variants: float = SHIPPED_VARIANTS,
    drills: int = 0,
    rename: float = 0.0,
) -> dict[str, Any]:
    """Write `train.jsonl` (train tasks and profiles), `eval.jsonl` (held-out ones) and
    `stats.json` (what they hold, short and long tasks apart: `data_stats`). `variants` of the
    training dialogues are played for synthetic diners drawn around the training profiles (many
    more allergy lists; never a held-out diner's set), the held-out ones never. `drills` check
    drills (`check_drills`) follow the training dialogues in `train.jsonl`; the statistics
    describe the whole dialogues, and `stats["drills"]` counts the drills. `rename` of the
    training dialogues have their dishes renamed (`renamed_row`; the statistics are those of
    the dialogues as played, which renaming does not change; drills keep the menu's names).
    The defaults write the shipped data's kind (`SHIPPED_SFT_QUIRKS`, `SHIPPED_VARIANTS`)."""
    from pathlib import Path

    from kitchen.files import atomic_write_json, write_jsonl

    out = Path(out_dir)
    stats: dict[str, Any] = {}
    for name, split, n in (("train", "train", n_train), ("eval", "heldout", n_eval)):
        eps = episodes(
            n,
            split=split,
            seed=seed,
            quirks=quirks,
            long_share=long_share,
            variants=variants if split == "train" else 0.0,
        )
        rows = [chat_row(t) for t, _ in eps]
        if name == "train" and rename:
            rng = random.Random(seed * 7_919 + 11)
            chosen = [rng.random() < rename for _ in rows]
            rows = [renamed_row(r, rng) if c else r for r, c in zip(rows, chosen, strict=True)]
            stats["renamed"] = {"share": rename, "dialogues": sum(chosen)}
        if name == "train" and drills:
            rows += check_drills(drills, seed, quirks, variants)
            stats["drills"] = {"dialogues": drills}
        write_jsonl(out / f"{name}.jsonl", rows)
        stats[name] = data_stats(eps) | {
            kind: data_stats([e for e in eps if e[0].task.kind == kind])
            for kind in ("short", "long")
        }
    stats["command"] = (
        f"kitchen world sft-data --out {out_dir} --train {n_train} --eval {n_eval} "
        f"--seed {seed} --long {long_share:g}"
        + (f" --style-draw {quirks.style_draw}" if quirks.style_draw != "episode" else "")
        + f" --unsafe-checks {quirks.unsafe_check_first:g} --variants {variants:g}"
        + (
            f" --skip-checks {quirks.skip_allergen_check:g}"
            if quirks.skip_allergen_check != SHIPPED_SFT_QUIRKS.skip_allergen_check
            else ""
        )
        + (f" --drills {drills}" if drills else "")
        + (f" --rename {rename:g}" if rename else "")
    )
    atomic_write_json(out / "stats.json", stats)
    return stats
