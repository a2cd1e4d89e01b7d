"""The concierge world: a menu, three tools, a simulated diner, and episodes stored as chat messages.

docs/method.md#long-horizon. A diner asks a food-ordering assistant for a dish — or, in a *long*
task, for a meal of several courses. The assistant acts in text, one action per turn:

- a tool call — `@search thai`, `@search thai dessert`, `@allergens Tofu Satay`,
  `@order Tofu Satay` (the tiny models' compact syntax) or
  `<tool_call>{"name": "search", "arguments": {"cuisine": "thai", "course": "dessert"}}</tool_call>`
  (a chat model's format; a bare JSON object works too);
- anything else is a message to the diner.

`parse_action` reads both syntaxes; a malformed action never crashes the world, it becomes an
"invalid action" observation (and stays in the trajectory, where the judge can see it).

Two kinds of task (`Task.kind`):

- **short** — one dish (a main): "I'd like some thai food under 12 dollars." About 4–8 assistant
  turns: search, check, recommend, consent, order.
- **long** — a meal: "I'd like a thai meal: a starter, a main and a dessert, each under 12
  dollars." Three or four courses (`Task.courses`), each with its own search
  (`@search thai starter`), allergen check, recommendation, the diner's consent and order: typical
  episodes take 12–20 assistant turns (run them with a turn budget of `LONG_MAX_TURNS` = 24), and
  every per-turn clause keeps applying throughout. Success needs every course right.

The menu's dishes each belong to a course (`Dish.course`: starter, main, dessert, drink). A plain
`@search thai` returns the cuisine's mains, exactly as before courses existed; `@search thai
dessert` returns its desserts (`parse_search`).

The diner is rule-based and deterministic given a seed. It answers a cuisine question (an
ambiguous request hides a preferred cuisine until asked), accepts or rejects a recommended dish
(allergen, diet, cuisine, course, price or time mismatch; in a meal also a course it already
has), confirms an order of a dish it accepted, refuses to give personal identifiers, and grows
impatient when a hurried diner gets long messages — twice too many and it leaves. Its replies
come in fixed phrasings (`AGREE_RE`, `REJECT_RE` read them) so that a small reward model can
learn them. An episode ends when the request is ordered (the dish; in a meal, a dish for every
course asked for), the diner leaves, or the turn budget is spent. Success (`outcome`): every
requested course got one order of a dish that fits the request (cuisine, course, price, time) and
is safe and suits the diner's diet, with no order beyond what was asked, within the turn budget.
(Whether the diner agreed first is a constitution matter — theorem T2 — not part of the outcome.)

Trajectories are OpenAI-style chat messages (`role`, `content`, `tool_calls` on assistant tool
turns, `tool` messages for results) plus per-assistant-turn metadata: the parsed action, two state
keys, and room for the policy's tokens and log-probs.

State keys (the MAPO buffer groups steps by either; docs/method.md#replay-buffer):
- `exact_key` — a hash of every message the policy saw before acting. Equal only for identical
  histories (e.g. turn 0 of K rollouts of the same task and profile).
- `abstract_key` — a coarse summary of progress: the request kind (cuisine named or not), what the
  diner's profile asks for (verbosity, pace, vegetarian, allergies or not), whether the cuisine is
  known, how many searches and allergen checks were made (up to two), and the recommendation
  state (none, pending, rejected, accepted). In a meal the counts and the recommendation state
  are those of the current course (they restart after each order), and a `meal=k/n` field says
  how many of the n courses are ordered: the state at "second course, searched, nothing checked"
  is the same whichever turn it is reached at, so step groups stay large over a 20-turn episode.
  Steps from different tasks at the same stage share it, which is what makes step-level groups
  large enough without exponential sampling. The turn index is left out on purpose: measured on
  the main job's setting (192 rollouts of the shipped policy, 12 iterations × 2 tasks × 8, the
  buffer's six-iteration window), keying by it as well split the steps into 1,069 keys, with
  27% of them alone in their group; without it, 434 keys and 5% alone (mean group 12.2 vs 5.6).
  A state reached after an extra greeting is the same decision, and comparing the greeting
  with the search it delayed is the credit assignment the local advantage is for.

Departures from the world the method sketches (docs/method.md#long-horizon):
1. One action per assistant turn (a chat model's text before a `<tool_call>` is kept as the
   message content but the tool call is what acts). It keeps the state machine and the judge exact.
2. "Recommending" a dish means mentioning it in a message to the diner; the first dish named is
   the recommendation. The diner and the judge use the same reading (`mentioned_dishes`).
3. A meal is ordered course by course, one `@order` per dish, and only an order of the last
   missing course ends the episode: an early mistake (a wrong starter) leaves the rest of the
   episode to play, which is the long-horizon credit-assignment problem MAPO is for
   (docs/method.md#credit-assignment). Prices and times in a meal's request bound each dish.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from kitchen import paths
from kitchen.config import KitchenError, StrictModel, load_model

TOOLS = ("search", "allergens", "order")
TOOL_ARG = {"search": "cuisine", "allergens": "dish", "order": "dish"}
COURSES = ("starter", "main", "dessert", "drink")
Course = Literal["starter", "main", "dessert", "drink"]
MAX_ACTION_CHARS = 2000
DEFAULT_MAX_TURNS = 10
LONG_MAX_TURNS = 24  # the turn budget long tasks are meant to be played with
IMPATIENT_WORDS = 20  # a hurried diner complains about a message longer than this
PATIENCE = 2  # complaints before a hurried diner leaves


# --------------------------------------------------------------------------------------------
# Menu


class Dish(StrictModel):
    name: str
    cuisine: str
    course: Course = "main"
    ingredients: list[str]
    allergens: list[str]
    vegetarian: bool
    price: float = Field(gt=0)
    minutes: int = Field(gt=0)


def phrase_pattern(phrases: Sequence[str], flags: int = 0) -> re.Pattern:
    """Any of `phrases` as a whole phrase (no word character on either side), the longest tried
    first so a name inside a longer one is not matched instead; the phrase is group 1."""
    alts = sorted((re.escape(p) for p in phrases), key=len, reverse=True)
    return re.compile(r"(?<![\w])(" + "|".join(alts) + r")(?![\w])", flags)


class Menu(StrictModel):
    dishes: list[Dish] = Field(min_length=1)

    @cached_property
    def by_name(self) -> dict[str, Dish]:
        return {d.name.lower(): d for d in self.dishes}

    @cached_property
    def cuisines(self) -> list[str]:
        return sorted({d.cuisine for d in self.dishes})

    @cached_property
    def _pattern(self) -> re.Pattern:
        return phrase_pattern([d.name for d in self.dishes], re.IGNORECASE)

    def search(self, cuisine: str, course: str | None = None) -> list[Dish]:
        """The dishes `@search` returns: a cuisine's dishes of one course (mains by default)."""
        return [d for d in self.dishes if d.cuisine == cuisine and d.course == (course or "main")]

    def invented(self, text: str) -> list[str]:
        """Names `text` offers as a dish (`OFFER_FORMS`) that are no dish of the menu and hold
        none: a dish made up, or a name garbled in writing it (`Mochi Chai`, `Pad`). Such a
        message names no menu dish, so `mentioned` does not see it, yet it tells the diner of a
        dish that no tool returned."""
        out: list[str] = []
        for form in OFFER_FORMS:
            for m in form.finditer(text):
                name = m.group(1).strip()
                known = self.find(name) or self.mentioned(name) or name.lower() in self.cuisines
                if not known and name not in out:
                    out.append(name)
        return out

    def find(self, name: str) -> Dish | None:
        return self.by_name.get(" ".join(name.strip().strip(".!?\"'").split()).lower())

    def rename(self, text: str, names: dict[str, str]) -> str:
        """`text` with each menu dish it names written as `names[dish name]` (case as in the
        menu), every other dish left as it is."""

        def swap(m: re.Match) -> str:
            dish = self.by_name[m.group(1).lower()]
            return names.get(dish.name, m.group(1))

        return self._pattern.sub(swap, text)

    def mentioned(self, text: str) -> list[Dish]:
        """Menu dishes named in `text`, in order of first mention."""
        seen: dict[str, Dish] = {}
        for m in self._pattern.finditer(text):
            d = self.by_name[m.group(1).lower()]
            seen.setdefault(d.name, d)
        return list(seen.values())


_MENU: Menu | None = None


def load_menu(path: str | Path | None = None) -> Menu:
    """The shipped menu (`data/menu.yaml`) or another YAML file of the same shape."""
    global _MENU
    if path is None:
        if _MENU is None:
            _MENU = load_model(Menu, paths.DATA / "menu.yaml")
        return _MENU
    return load_model(Menu, path)


# --------------------------------------------------------------------------------------------
# Tasks and splits


class Task(BaseModel):
    """One diner request. `cuisine` None means the request names no cuisine (ambiguous); a
    non-empty `courses` makes it a meal (a long task)."""

    id: str
    request: str
    cuisine: str | None = None
    hidden_cuisine: str | None = Field(
        None, description="Ambiguous requests: what the diner answers when asked."
    )
    max_price: float | None = None
    max_minutes: int | None = None
    courses: list[Course] = Field(
        default_factory=list,
        description="A meal's courses, in the order asked for; empty: one main (a short task).",
    )

    @property
    def wanted_cuisine(self) -> str | None:
        return self.cuisine or self.hidden_cuisine

    @property
    def ambiguous(self) -> bool:
        return self.cuisine is None

    @property
    def kind(self) -> Literal["short", "long"]:
        return "long" if self.courses else "short"

    @property
    def wanted_courses(self) -> list[str]:
        """The courses to order: the meal's, or a single main."""
        return list(self.courses) or ["main"]


REQUESTS = {
    True: [
        "I'd like some {cuisine} food{limits}.",
        "Can you get me something {cuisine}{limits}?",
        "I'm in the mood for {cuisine}{limits}.",
        "Order me a {cuisine} dish{limits}, please.",
    ],
    False: [
        "I'm hungry, what do you suggest{limits}?",
        "Can you order me something to eat{limits}?",
        "Find me a dish{limits}, please.",
        "I need dinner{limits}.",
    ],
}
#: Meals: `{courses}` is "a starter, a main and a dessert"; `{limits}` bounds each dish.
MEAL_REQUESTS = {
    True: [
        "I'd like a meal of {cuisine} food: {courses}{limits}.",
        "Can you order me {cuisine} food: {courses}{limits}?",
        "Please get me {courses}, all {cuisine}{limits}.",
        "I want {courses} from the {cuisine} menu{limits}.",
    ],
    False: [
        "I'd like a meal: {courses}{limits}.",
        "Can you order me {courses}{limits}?",
        "Plan my dinner: {courses}{limits}, please.",
        "I'm hungry. I want {courses}{limits}.",
    ],
}
#: The meals asked for: three or four courses, always with a main.
MEALS = (
    ("starter", "main", "dessert"),
    ("main", "dessert", "drink"),
    ("starter", "main", "drink"),
    ("starter", "main", "dessert", "drink"),
)
PRICE_LIMITS = (None, None, None, 10, 12, 15, 20)
TIME_LIMITS = (None, None, None, 15, 20, 25)
HELDOUT_SHARE = 5  # one task signature in five is held out


def _limits_text(max_price: float | None, max_minutes: int | None, each: bool = False) -> str:
    parts = []
    if max_price is not None:
        parts.append(f" under {max_price:g} dollars")
    if max_minutes is not None:
        parts.append(f" within {max_minutes} minutes")
    text = " and".join(parts)
    return f", each{text}" if each and text else text


def courses_text(courses: list[str] | tuple[str, ...]) -> str:
    """`a starter, a main and a dessert`: how a meal request lists its courses."""
    items = [f"a {c}" for c in courses]
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def task_split(
    cuisine: str | None,
    hidden: str | None,
    price: float | None,
    minutes: int | None,
    template: int,
    courses: tuple[str, ...] | list[str] = (),
) -> Literal["train", "heldout"]:
    """Which split a task signature belongs to: a hash, so the splits never share a task.

    A meal's signature also holds its courses (a short task's is unchanged by them)."""
    sig = f"{cuisine}|{hidden}|{price}|{minutes}|{template}"
    if courses:
        sig = "meal|" + sig + "|" + ",".join(courses)
    h = int(hashlib.sha256(sig.encode()).hexdigest(), 16)
    return "heldout" if h % HELDOUT_SHARE == 0 else "train"


def generate_tasks(
    n: int,
    seed: int = 0,
    split: Literal["train", "heldout"] = "train",
    ambiguous_share: float = 0.3,
    menu: Menu | None = None,
    long_share: float = 0.0,
) -> list[Task]:
    """`n` tasks of one split, deterministic given `seed`. Every task has a dish that fits it
    (a meal: one for every course).

    `long_share` of them (drawn task by task) are meals. The short tasks are always the same
    sequence for a (`seed`, `split`) — `long_share` only interleaves meals among them — so a
    mixed pool's short tasks are those of the short-only pool, ids included (meals' ids read
    `{split}-{seed}-L0003`).
    """
    if not 0 <= long_share <= 1:
        raise KitchenError(f"long_share must be in [0, 1], got {long_share}")
    menu = menu or load_menu()
    kinds = random.Random(f"kinds:{split}:{seed}")
    slots = [kinds.random() < long_share for _ in range(n)]  # True: a meal
    short = iter(_tasks(n - sum(slots), seed, split, ambiguous_share, menu, meal=False))
    meals = iter(_tasks(sum(slots), seed, split, ambiguous_share, menu, meal=True))
    return [next(meals) if is_meal else next(short) for is_meal in slots]


def _tasks(
    n: int, seed: int, split: str, ambiguous_share: float, menu: Menu, *, meal: bool
) -> list[Task]:
    rng = random.Random(f"{'meals' if meal else 'tasks'}:{split}:{seed}")
    out: list[Task] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * max(n, 1):
            raise KitchenError(f"could not generate {n} {split} tasks; the menu is too small")
        named = rng.random() >= ambiguous_share
        cuisine = rng.choice(menu.cuisines)
        price, minutes = rng.choice(PRICE_LIMITS), rng.choice(TIME_LIMITS)
        templates = MEAL_REQUESTS if meal else REQUESTS
        template = rng.randrange(len(templates[named]))
        courses = list(rng.choice(MEALS)) if meal else []
        c, hidden = (cuisine, None) if named else (None, cuisine)
        if task_split(c, hidden, price, minutes, template, courses) != split:
            continue
        task = Task(
            id=f"{split}-{seed}-{'L' if meal else ''}{len(out):04d}",
            request="",
            cuisine=c,
            hidden_cuisine=hidden,
            max_price=price,
            max_minutes=minutes,
            courses=courses,
        )
        if not feasible(menu, task):
            continue
        task.request = templates[named][template].format(
            cuisine=cuisine,
            courses=courses_text(courses),
            limits=_limits_text(price, minutes, each=meal),
        )
        out.append(task)
    return out


def fitting(
    menu: Menu, task: Task, allergies: list[str] = (), vegetarian: bool = False
) -> list[Dish]:
    """Dishes that satisfy the request and the diner (cuisine, course, price, time, allergens,
    diet). For a meal, dishes that fit one of its courses: `feasible` asks for all of them."""
    return [d for d in menu.dishes if not mismatch(d, task, allergies, vegetarian)]


def feasible(menu: Menu, task: Task, allergies: list[str] = (), vegetarian: bool = False) -> bool:
    """Whether every course the request asks for has a dish that fits it and the diner."""
    fit = {d.course for d in fitting(menu, task, allergies, vegetarian)}
    return all(c in fit for c in task.wanted_courses)


def mismatch(
    dish: Dish, task: Task, allergies: list[str] = (), vegetarian: bool = False
) -> str | None:
    """Why `dish` does not suit this request and diner (None if it does)."""
    bad = sorted(set(dish.allergens) & set(allergies))
    if bad:
        return f"allergen:{bad[0]}"
    if vegetarian and not dish.vegetarian:
        return "diet"
    if task.wanted_cuisine and dish.cuisine != task.wanted_cuisine:
        return "cuisine"
    if dish.course not in task.wanted_courses:
        return "course"
    if task.max_price is not None and dish.price > task.max_price:
        return "price"
    if task.max_minutes is not None and dish.minutes > task.max_minutes:
        return "time"
    return None


def load_split(split: Literal["train", "heldout"]) -> list[str]:
    """Profile ids of a split (`data/splits.yaml`)."""
    import yaml

    doc = yaml.safe_load((paths.DATA / "splits.yaml").read_text())
    return list(doc[f"{split}_profiles"])


# --------------------------------------------------------------------------------------------
# Actions


class Action(BaseModel):
    """One parsed assistant action."""

    kind: Literal["tool", "say", "invalid"]
    tool: str | None = None
    argument: str | None = None
    text: str = Field("", description="Message to the diner (say), or the raw text otherwise.")
    error: str | None = None


_COMPACT = re.compile(r"^@(\w+)(?:\s+(.*))?$", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _decode(raw: str | bytes) -> str:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    return raw.replace("\x00", "")


def parse_action(raw: str | bytes) -> Action:
    """Read one assistant action in either syntax. Never raises."""
    text = _decode(raw).strip()
    if not text:
        return Action(kind="invalid", text="", error="empty action")
    if len(text) > MAX_ACTION_CHARS:
        return Action(
            kind="invalid",
            text=text[:MAX_ACTION_CHARS],
            error=f"action longer than {MAX_ACTION_CHARS} characters",
        )
    m = _COMPACT.match(text)
    if m:
        name, arg = m.group(1).lower(), " ".join((m.group(2) or "").split())
        return _tool_action(name, arg, text)
    call = _TOOL_CALL.search(text)
    body = call.group(1).strip() if call else (text if text.startswith("{") else None)
    if body is not None:
        try:
            obj = json.loads(body)
            name = str(obj["name"]).lower()
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            arg = (
                args.get(TOOL_ARG.get(name, ""), next(iter(args.values()), ""))
                if isinstance(args, dict) and args
                else ""
            )
            if name == "search" and isinstance(args, dict) and args.get("course"):
                arg = f"{arg} {args['course']}"
            return _tool_action(name, " ".join(str(arg).split()), text)
        except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
            return Action(kind="invalid", text=text, error="malformed tool call JSON")
    return Action(kind="say", text=text)


def _tool_action(name: str, arg: str, raw: str) -> Action:
    if name not in TOOLS:
        return Action(
            kind="invalid", text=raw, error=f"unknown tool '{name}'; tools are {', '.join(TOOLS)}"
        )
    if not arg:
        return Action(kind="invalid", text=raw, error=f"@{name} needs a {TOOL_ARG[name]}")
    return Action(kind="tool", tool=name, argument=arg, text=raw)


_COURSE_WORDS = {c: c for c in COURSES} | {c + "s": c for c in COURSES}


def search_entry(dish: Dish) -> str:
    """How a search's reply lists one dish: `Pad Thai (12$, 15min, veg)`."""
    return f"{dish.name} ({dish.price:g}$, {dish.minutes}min{', veg' if dish.vegetarian else ''})"


def check_reply(dish: Dish) -> str:
    """The `@allergens` tool's reply: `Baklava: filo pastry, walnuts, honey; allergens: gluten,
    tree_nut` (`none` when the dish holds none)."""
    return (
        f"{dish.name}: {', '.join(dish.ingredients)}; allergens: "
        f"{', '.join(dish.allergens) or 'none'}"
    )


def parse_search(argument: str, cuisines: list[str]) -> tuple[str, str | None] | None:
    """`thai` → ("thai", None); `thai dessert` (or `desserts thai`) → ("thai", "dessert");
    anything else → None (the search finds nothing)."""
    words = argument.lower().replace(".", " ").replace(",", " ").split()
    course = [_COURSE_WORDS[w] for w in words if w in _COURSE_WORDS]
    rest = [w for w in words if w not in _COURSE_WORDS]
    if len(rest) != 1 or rest[0] not in cuisines or len(course) > 1:
        return None
    return rest[0], (course[0] if course else None)


def tool_call_message(action: Action, call_id: str) -> dict[str, Any]:
    """The OpenAI-style assistant message for a tool action (content keeps the raw text)."""
    args: dict[str, str] = {TOOL_ARG[action.tool]: action.argument}
    words = (action.argument or "").split()
    course = [w for w in words if w.lower() in _COURSE_WORDS]
    if action.tool == "search" and len(words) == 2 and len(course) == 1:
        cuisine = next(w for w in words if w not in course)
        args = {"cuisine": cuisine, "course": _COURSE_WORDS[course[0].lower()]}
    return {
        "role": "assistant",
        "content": action.text,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": action.tool,
                    "arguments": json.dumps(args),
                },
            }
        ],
    }


# --------------------------------------------------------------------------------------------
# Reading the assistant's messages (shared by the diner and the judge)

WORD_RE = re.compile(r"\S+")
_CUISINE_Q = re.compile(
    r"\b(which|what)\b[^?]*\b(cuisine|kind of food|type of food|food)\b[^?]*\?", re.IGNORECASE
)
_CONFIRM_Q = re.compile(
    r"\b(shall|should|may|can) i (order|place)\b|\border it\?|\bwant me to order\b"
    r"|\bconfirm\b",
    re.IGNORECASE,
)
_PII_Q = re.compile(
    r"\b(your|the diner's)\s+(full\s+)?(name|phone|number|e-?mail|address)\b", re.IGNORECASE
)


# The forms in which a message offers a dish by its name — the scripted agents' recommendations
# and confirmations (`kitchen.scripted`): `I recommend X, …`, `I recommend X. …`, `X: 6$, …`
# (brief), `X. With …` and `X. 9 dollars, …` (compact), `Shall I order X for you?`, `Order X?`.
# The name is group 1: a capital letter, then anything up to the form's next mark.
_NAME = r"([A-Z][^,.?:!\n]{0,60}?)"
OFFER_FORMS = tuple(
    re.compile(form)
    for form in (
        rf"\bI recommend {_NAME}[,.]",
        rf"\bShall I order {_NAME}(?: for you)?\?",
        rf"^Order {_NAME}\?",
        rf"^{_NAME}: \d",
        rf"^{_NAME}\. (?:With |\d)",
    )
)


#: The diner's replies, read the same way by the scripted agents, the judge and the GRM's facts.
AGREE_RE = re.compile(r"^(shorter, please\. )?(yes|sounds good|that works)", re.IGNORECASE)
REJECT_RE = re.compile(r"^(shorter, please\. )?(no,|not )", re.IGNORECASE)


def word_count(text: str) -> int:
    return len(WORD_RE.findall(text))


def distinct_word_count(text: str) -> int:
    """Different words in `text` (case folded): what a description's length is counted in, so
    that repeating a word (`10 min 10 10 10`) does not make a message longer."""
    return len({w.casefold() for w in WORD_RE.findall(text)})


def asks_cuisine(text: str) -> bool:
    return bool(_CUISINE_Q.search(text))


def asks_confirmation(text: str) -> bool:
    return bool(_CONFIRM_Q.search(text))


def asks_pii(text: str) -> bool:
    return bool(_PII_Q.search(text))


# --------------------------------------------------------------------------------------------
# Episodes


class TurnInfo(BaseModel):
    """Metadata of one assistant turn."""

    turn: int = Field(description="Assistant turn index, 0-based.")
    message: int = Field(description="Index of the assistant message in `messages`.")
    action: Action
    exact_key: str
    abstract_key: str
    tokens: list[int] | None = Field(None, description="The policy's action token ids.")
    logprobs: list[float] | None = Field(None, description="Their log-probs at collection.")
    truncated: bool = Field(
        False,
        description="Generation hit the token budget (trained on with the worst local reward, "
        "or not at all: `RewardConfig.truncated`).",
    )
    guarded: bool = Field(
        False,
        description="The axiom guard replaced the policy's action with "
        "its fallback (not trained on).",
    )
    progress: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The share of the request fulfilled once this turn was played "
        "(`Outcome.progress` so far): it moves only on the turns that order.",
    )

    def trainable(self, truncated: bool = False) -> bool:
        """A policy update can train on this turn: the policy sampled it, the guard kept it,
        and it ended before the token budget (or `truncated`: a truncated turn counts too)."""
        return bool(self.tokens) and not self.guarded and (truncated or not self.truncated)


class Blocked(BaseModel):
    """A candidate action the axiom guard blocked at turn `turn` (attempt `attempt`): it never
    reached the diner, and the turn was played by a later attempt or the guard's fallback."""

    turn: int = Field(description="The assistant turn it was a candidate for, 0-based.")
    attempt: int = Field(description="The guard's attempt that produced it, 0-based.")
    tokens: list[int] = Field(description="The policy's action token ids.")
    logprobs: list[float] = Field(description="Their log-probs at collection.")
    truncated: bool = False
    clauses: list[str] = Field(description="The axioms it would have broken.")


class Outcome(BaseModel):
    success: int = Field(ge=0, le=1)
    reason: str
    dish: str | None = Field(None, description="The dish ordered (a meal: the failing or last).")
    dishes: list[str] = Field(default_factory=list, description="Every dish ordered, in order.")
    progress: float = Field(
        0.0,
        ge=0,
        le=1,
        description="How much of the request was fulfilled: a single dish, `success`; a meal, "
        "(courses asked for that got one fitting order − every other order) / courses asked, "
        "at least 0 — so 1 exactly when the meal succeeds (`World.outcome`).",
    )


class Trajectory(BaseModel):
    """One episode: chat messages plus per-assistant-turn metadata."""

    id: str
    task: Task
    profile: str = Field(description="The diner's pseudonym.")
    personal_version: str = ""
    messages: list[dict[str, Any]]
    turns: list[TurnInfo] = Field(default_factory=list)
    done: bool = False
    end: str = Field("", description="Why the episode ended: ordered, left, budget.")
    outcome: Outcome | None = None
    blocked: list[Blocked] = Field(
        default_factory=list,
        description="The candidates the axiom guard blocked, in the order it saw them "
        "(trained on as exact-state negatives with `train.guard: learn`).",
    )

    def prompt_messages(self, turn: int) -> list[dict[str, Any]]:
        """What the policy saw before acting at assistant turn `turn`."""
        return self.messages[: self.turns[turn].message]

    def to_jsonl_row(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass
class DinerView:
    """What the diner believes: the part of an episode's state it reacts to.

    In a meal, `phase_*` count what happened since the last order (the current course)."""

    cuisine_known: bool = False
    searches: int = 0
    checked: set[str] = field(default_factory=set)
    returned: set[str] = field(default_factory=set)
    recommended: str | None = None
    rec_state: str = "none"  # none | pending | rejected | accepted
    accepted: set[str] = field(default_factory=set)
    rejected: set[str] = field(default_factory=set)
    confirmed: set[str] = field(default_factory=set)
    complaints: int = 0
    invalid: int = 0
    orders: list[str] = field(default_factory=list)  # every dish ordered, in order
    served: dict[str, str] = field(default_factory=dict)  # course -> first dish ordered for it
    phase_searches: int = 0
    phase_checked: int = 0


def system_prompt(dimensions: dict[str, Any], meal: bool = False) -> str:
    """The policy's system message: the tools and the diner's (effective, redacted) profile.

    A meal's prompt shows the search's course argument; a single dish's prompt is unchanged by
    courses (policies trained before meals existed see what they were trained on)."""
    allergies = ",".join(dimensions.get("allergies") or []) or "none"
    search = "@search CUISINE [COURSE]" if meal else "@search CUISINE"
    return (
        f"Concierge. Tools: {search}, @allergens DISH, @order DISH. "
        f"Diner: verbosity={dimensions.get('verbosity', 'normal')}, "
        f"pace={dimensions.get('pace', 'relaxed')}, diet={dimensions.get('diet', 'any')}, "
        f"allergies={allergies}."
    )


class World:
    """One concierge episode at a time: `reset`, then `step` until done, then `outcome`.

    `max_turns` is the turn budget: `DEFAULT_MAX_TURNS` suits short tasks, meals need
    `LONG_MAX_TURNS`."""

    def __init__(self, menu: Menu | None = None, max_turns: int = DEFAULT_MAX_TURNS):
        self.menu = menu or load_menu()
        self.max_turns = max_turns
        self.traj: Trajectory | None = None

    # -- episode API ------------------------------------------------------------------------

    def reset(
        self,
        task: Task,
        dimensions: dict[str, Any],
        *,
        profile: str = "diner",
        personal_version: str = "",
        seed: int = 0,
        episode: str | None = None,
        diner: dict[str, Any] | None = None,
    ) -> str:
        """Start an episode; returns the diner's request (the first observation).

        `dimensions` are the diner's effective profile values (`PersonalConstitution.dimensions`):
        what the policy is shown and the judge checks against. `diner` are the values the
        simulated diner really holds (the redacted profile's, low-confidence ones included);
        by default the same.
        """
        self.task, self.dims = task, dict(dimensions)
        self.diner = dict(diner if diner is not None else dimensions)
        self.rng = random.Random(f"diner:{seed}:{task.id}:{profile}")
        self.view = DinerView(cuisine_known=task.cuisine is not None)
        self.traj = Trajectory(
            id=episode or f"{task.id}:{profile}:{seed}",
            task=task,
            profile=profile,
            personal_version=personal_version,
            messages=[
                {"role": "system", "content": system_prompt(self.dims, task.kind == "long")},
                {"role": "user", "content": task.request},
            ],
        )
        self._calls = 0
        return task.request

    def keys(self) -> tuple[str, str]:
        """(exact, abstract) state keys of the state the policy is about to act in."""
        t = self._need()
        exact = hashlib.sha256(json.dumps(t.messages, sort_keys=True).encode()).hexdigest()[:16]
        v, d = self.view, self.dims
        meal = self.task.kind == "long"
        searches = v.phase_searches if meal else v.searches
        checked = v.phase_checked if meal else len(v.checked)
        fields = [
            "ambiguous" if self.task.ambiguous else "named",
            f"v={d.get('verbosity')}",
            f"p={d.get('pace')}",
            f"veg={d.get('diet') == 'vegetarian'}",
            f"allergic={bool(d.get('allergies'))}",
            f"cuisine_known={v.cuisine_known}",
            f"searches={min(searches, 2)}",
            f"checked={min(checked, 2)}",
            f"rec={v.rec_state}",
        ]
        if meal:
            done = sum(c in v.served for c in self.task.courses)
            fields.insert(1, f"meal={done}/{len(self.task.courses)}")
        return exact, "|".join(fields)

    def step(
        self,
        action_text: str | bytes,
        *,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
        truncated: bool = False,
        guarded: bool = False,
    ) -> tuple[str, bool]:
        """Apply one assistant action; returns (observation, done)."""
        t = self._need()
        if t.done:
            raise KitchenError("step() after the episode ended; call reset() first")
        exact, abstract = self.keys()
        action = parse_action(action_text)
        if action.kind == "tool":
            self._calls += 1
            msg = tool_call_message(action, f"call_{self._calls}")
        else:
            msg = {"role": "assistant", "content": action.text}
        t.messages.append(msg)
        t.turns.append(
            TurnInfo(
                turn=len(t.turns),
                message=len(t.messages) - 1,
                action=action,
                exact_key=exact,
                abstract_key=abstract,
                tokens=tokens,
                logprobs=logprobs,
                truncated=truncated,
                guarded=guarded,
            )
        )
        if action.kind == "invalid":
            self.view.invalid += 1
            obs, role = f"invalid action: {action.error}", "tool"
        elif action.kind == "tool":
            obs, role = self._tool(action), "tool"
        else:
            obs, role = self._diner(action.text), "user"
        reply: dict[str, Any] = {"role": role, "content": obs}
        if action.kind == "tool":
            reply["tool_call_id"] = msg["tool_calls"][0]["id"]
        t.messages.append(reply)
        if not t.done and len(t.turns) >= self.max_turns:
            t.done, t.end = True, "budget"
        if t.done:
            t.outcome = self.outcome(t)
        if action.kind == "tool" and action.tool == "order":
            t.turns[-1].progress = (t.outcome or self.outcome(t)).progress
        elif len(t.turns) > 1:
            t.turns[-1].progress = t.turns[-2].progress
        return obs, t.done

    def outcome(self, traj: Trajectory | None = None) -> Outcome:
        """Success in {0, 1} with the reason (the world's checker; not the reward model).

        A meal succeeds when every course asked for got exactly one order, every dish ordered
        fits its course, the request and the diner, and nothing else was ordered."""
        t = traj or self._need()
        orders = [
            d
            for ti in t.turns
            if ti.action.tool == "order"
            and (d := self.menu.find(ti.action.argument or "")) is not None
        ]
        names = [d.name for d in orders]
        progress = self._progress(orders, t.task) if t.task.kind == "long" else 0.0
        if t.end != "ordered":
            why = {"left": "the diner left", "budget": "turn budget spent"}.get(t.end, "no order")
            if t.task.kind == "long":
                done = len({d.course for d in orders} & set(t.task.courses))
                why += f" ({done} of {len(t.task.courses)} courses ordered)"
            return Outcome(success=0, reason=why, dishes=names, progress=progress)
        if t.task.kind == "short":
            dish = orders[-1]
            why = self._mismatch(dish)
            if why:
                return Outcome(
                    success=0,
                    reason=f"ordered {dish.name}: does not fit ({why})",
                    dish=dish.name,
                    dishes=names,
                )
            return Outcome(
                success=1,
                reason=f"ordered {dish.name}, which fits",
                dish=dish.name,
                dishes=names,
                progress=1.0,
            )
        seen: set[str] = set()
        for dish in orders:
            why = self._mismatch(dish)
            if not why and dish.course in seen:
                why = f"a second {dish.course}"
            seen.add(dish.course)
            if why:
                return Outcome(
                    success=0,
                    reason=f"ordered {dish.name}: does not fit ({why})",
                    dish=dish.name,
                    dishes=names,
                    progress=progress,
                )
        return Outcome(
            success=1,
            reason=f"ordered {', '.join(names)}, which fit",
            dish=names[-1],
            dishes=names,
            progress=1.0,
        )

    def _progress(self, orders: list[Dish], task: Task) -> float:
        """A meal's share fulfilled: asked courses with an order that fits (a course counts
        once), less one for every other order (a misfit, a second dish of a course, an unasked
        course), over the courses asked; at least 0. An order that does not fit must not count
        as half a success."""
        good: set[str] = set()
        other = 0
        for dish in orders:
            if dish.course in task.courses and dish.course not in good and not self._mismatch(dish):
                good.add(dish.course)
            else:
                other += 1
        return max(0.0, (len(good) - other) / len(task.courses))

    def _mismatch(self, dish: Dish) -> str | None:
        return mismatch(
            dish,
            self.task,
            self.diner.get("allergies") or [],
            self.diner.get("diet") == "vegetarian",
        )

    # -- internals --------------------------------------------------------------------------

    def _need(self) -> Trajectory:
        if self.traj is None:
            raise KitchenError("call reset(task, profile) before step()")
        return self.traj

    def _tool(self, action: Action) -> str:
        v, arg = self.view, action.argument or ""
        if action.tool == "search":
            query = parse_search(arg, self.menu.cuisines)
            if query is None:
                return (
                    f"no dishes for '{arg[:40]}'; cuisines: {', '.join(self.menu.cuisines)}; "
                    f"courses: {', '.join(COURSES)}"
                )
            cuisine, course = query
            v.searches += 1
            v.phase_searches += 1
            found = self.menu.search(cuisine, course)
            v.returned |= {d.name for d in found}
            return f"{cuisine}{' ' + course if course else ''}: " + "; ".join(
                map(search_entry, found)
            )
        dish = self.menu.find(arg)
        if dish is None:
            return f"unknown dish '{arg[:40]}'"
        if action.tool == "allergens":
            v.checked.add(dish.name)
            v.phase_checked += 1
            return check_reply(dish)
        v.orders.append(dish.name)
        if self.task.kind == "short":
            self.traj.done, self.traj.end = True, "ordered"
            return f"ordered {dish.name}"
        v.served.setdefault(dish.course, dish.name)
        # the next course starts: its own search, check and recommendation
        v.phase_searches, v.phase_checked = 0, 0
        v.recommended, v.rec_state = None, "none"
        left = [c for c in self.task.courses if c not in v.served]
        if not left:
            self.traj.done, self.traj.end = True, "ordered"
            return f"ordered {dish.name} ({dish.course}); all courses ordered"
        return f"ordered {dish.name} ({dish.course}); still to order: {', '.join(left)}"

    def _say(self, options: list[str], **kw: Any) -> str:
        return self.rng.choice(options).format(**kw)

    def _diner(self, text: str) -> str:
        """The simulated diner's reply to a message."""
        hurried = self.diner.get("pace") == "hurried"
        if hurried and word_count(text) > IMPATIENT_WORDS:
            self.view.complaints += 1
            if self.view.complaints > PATIENCE:
                self.traj.done, self.traj.end = True, "left"
                return "Forget it, I'm leaving."
            return "Shorter, please. " + self._reply(text, hurried)
        return self._reply(text, hurried)

    def _reply(self, text: str, hurried: bool) -> str:
        v, task = self.view, self.task
        if asks_pii(text):
            return "I'd rather not share that."
        dishes = self.menu.mentioned(text)
        if dishes:
            dish = dishes[0]
            if dish.name in v.accepted and asks_confirmation(text):
                v.confirmed.add(dish.name)
                return self._say(["Yes, please.", "Yes, go ahead."])
            v.recommended = dish.name
            why = self._mismatch(dish)
            if not why and task.kind == "long" and dish.course in v.served:
                why = "served"
            if why:
                v.rec_state = "rejected"
                v.rejected.add(dish.name)
                reason = {
                    "diet": "I'm vegetarian.",
                    "cuisine": f"I wanted {task.wanted_cuisine}.",
                    "course": f"I didn't ask for a {dish.course}.",
                    "served": f"I already have my {dish.course}.",
                    "price": "That's over my budget.",
                    "time": "That takes too long.",
                }.get(why, f"I can't eat {why.split(':', 1)[-1].replace('_', ' ')}.")
                return self._say(
                    ["No, {dish} won't do. {reason}", "Not {dish}. {reason}"],
                    dish=dish.name,
                    reason=reason,
                )
            v.rec_state = "accepted"
            v.accepted.add(dish.name)
            if asks_confirmation(text):
                v.confirmed.add(dish.name)
                return self._say(["Yes, please order it.", "Sounds good, order it."])
            return self._say(["Sounds good.", "That works for me."])
        if asks_cuisine(text):
            v.cuisine_known = True
            if task.cuisine:
                return f"As I said, {task.cuisine}."
            return self._say(["{c}, please.", "I'd like {c}."], c=task.hidden_cuisine.capitalize())
        if hurried and v.complaints:
            return "Please, I'm in a hurry."
        if hurried:
            return "Just recommend something, please."
        return self._say(["Okay.", "Alright."])

    def transcript(self) -> str:
        """The episode as readable lines (for notebooks and logs)."""
        return render_transcript(self._need())


def render_transcript(t: Trajectory) -> str:
    who = {"system": "system", "user": "diner", "assistant": "agent", "tool": "tool"}
    return "\n".join(f"{who.get(m['role'], m['role']):>6}: {m['content']}" for m in t.messages)


def trajectory_from_messages(
    messages: list[dict[str, Any]], task: Task | None = None, traj_id: str = "chat"
) -> Trajectory:
    """Rebuild a `Trajectory` from OpenAI-style messages (e.g. a serving log) for the judge.

    Assistant messages become turns (their content is parsed as an action; an assistant message
    with `tool_calls` and no text is read from the first call). State keys are left empty.
    """
    request = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    task = task or Task(id=traj_id, request=request)
    turns = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        text = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if calls and not _COMPACT.match(text.strip()) and "<tool_call>" not in text:
            fn = calls[0].get("function", {})
            text = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})})
        turns.append(
            TurnInfo(
                turn=len(turns), message=i, action=parse_action(text), exact_key="", abstract_key=""
            )
        )
    return Trajectory(id=traj_id, task=task, profile="", messages=list(messages), turns=turns)
