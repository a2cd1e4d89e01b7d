"""The concierge world: a menu, three tools, a simulated diner, and episodes stored as chat messages.

DESIGN.md §4. A diner asks a food-ordering assistant for a dish. The assistant acts in text, one
action per turn:

- a tool call — `@search thai`, `@allergens Tofu Satay`, `@order Tofu Satay` (the tiny models'
  compact syntax) or `<tool_call>{"name": "search", "arguments": {"cuisine": "thai"}}</tool_call>`
  (a chat model's format; a bare JSON object works too);
- anything else is a message to the diner.

`parse_action` reads both syntaxes; a malformed action never crashes the world, it becomes an
"invalid action" observation (and stays in the trajectory, where the judge can see it).

The diner is rule-based and deterministic given a seed. It answers a cuisine question (an
ambiguous request hides a preferred cuisine until asked), accepts or rejects a recommended dish
(allergen, diet, cuisine, price or time mismatch), confirms an order of a dish it accepted,
refuses to give personal identifiers, and grows impatient when a hurried diner gets long
messages — twice too many and it leaves. An episode ends when an order is placed, the diner
leaves, or the turn budget is spent. Success (`outcome`): an order of a dish that fits the
request, is safe and suits the diner's diet, within the turn budget. (Whether the diner agreed
first is a constitution matter — theorem T2 — not part of the outcome.)

Trajectories are OpenAI-style chat messages (`role`, `content`, `tool_calls` on assistant tool
turns, `tool` messages for results) plus per-assistant-turn metadata: the parsed action, two state
keys, and room for the policy's tokens and log-probs.

State keys (the MAPO buffer groups steps by either):
- `exact_key` — a hash of every message the policy saw before acting. Equal only for identical
  histories (e.g. turn 0 of K rollouts of the same task and profile).
- `abstract_key` — a coarse summary of progress: the request kind (cuisine named or not), what the
  diner's profile asks for (verbosity, pace, vegetarian, allergies or not), whether the cuisine is
  known, how many searches and allergen checks were made, the recommendation state (none,
  pending, rejected, accepted), and the turn index. Steps from different tasks at the same stage
  share it, which is what makes step-level groups large enough without exponential sampling.

Departures from DESIGN §4:
1. One action per assistant turn (a chat model's text before a `<tool_call>` is kept as the
   message content but the tool call is what acts). It keeps the state machine and the judge exact.
2. "Recommending" a dish means mentioning it in a message to the diner; the first dish named is
   the recommendation. The diner and the judge use the same reading (`mentioned_dishes`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from kitchen import paths
from kitchen.config import KitchenError, StrictModel, load_model

TOOLS = ("search", "allergens", "order")
TOOL_ARG = {"search": "cuisine", "allergens": "dish", "order": "dish"}
MAX_ACTION_CHARS = 2000
DEFAULT_MAX_TURNS = 10
IMPATIENT_WORDS = 20  # a hurried diner complains about a message longer than this
PATIENCE = 2  # complaints before a hurried diner leaves


# --------------------------------------------------------------------------------------------
# Menu


class Dish(StrictModel):
    name: str
    cuisine: str
    ingredients: list[str]
    allergens: list[str]
    vegetarian: bool
    price: float = Field(gt=0)
    minutes: int = Field(gt=0)


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
        names = sorted((re.escape(d.name) for d in self.dishes), key=len, reverse=True)
        return re.compile(r"(?<![\w])(" + "|".join(names) + r")(?![\w])", re.IGNORECASE)

    def find(self, name: str) -> Dish | None:
        return self.by_name.get(" ".join(name.strip().strip(".!?\"'").split()).lower())

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
    """One diner request. `cuisine` None means the request names no cuisine (ambiguous)."""

    id: str
    request: str
    cuisine: str | None = None
    hidden_cuisine: str | None = Field(
        None, description="Ambiguous requests: what the diner answers when asked."
    )
    max_price: float | None = None
    max_minutes: int | None = None

    @property
    def wanted_cuisine(self) -> str | None:
        return self.cuisine or self.hidden_cuisine

    @property
    def ambiguous(self) -> bool:
        return self.cuisine is None


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
PRICE_LIMITS = (None, None, None, 10, 12, 15, 20)
TIME_LIMITS = (None, None, None, 15, 20, 25)
HELDOUT_SHARE = 5  # one task signature in five is held out


def _limits_text(max_price: float | None, max_minutes: int | None) -> str:
    parts = []
    if max_price is not None:
        parts.append(f" under {max_price:g} dollars")
    if max_minutes is not None:
        parts.append(f" within {max_minutes} minutes")
    return " and".join(parts)


def task_split(
    cuisine: str | None, hidden: str | None, price: float | None, minutes: int | None, template: int
) -> Literal["train", "heldout"]:
    """Which split a task signature belongs to: a hash, so the splits never share a task."""
    sig = f"{cuisine}|{hidden}|{price}|{minutes}|{template}"
    h = int(hashlib.sha256(sig.encode()).hexdigest(), 16)
    return "heldout" if h % HELDOUT_SHARE == 0 else "train"


def generate_tasks(
    n: int,
    seed: int = 0,
    split: Literal["train", "heldout"] = "train",
    ambiguous_share: float = 0.3,
    menu: Menu | None = None,
) -> list[Task]:
    """`n` tasks of one split, deterministic given `seed`. Every task has a dish that fits it."""
    menu = menu or load_menu()
    rng = random.Random(f"tasks:{split}:{seed}")
    out: list[Task] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * max(n, 1):
            raise KitchenError(f"could not generate {n} {split} tasks; the menu is too small")
        named = rng.random() >= ambiguous_share
        cuisine = rng.choice(menu.cuisines)
        price, minutes = rng.choice(PRICE_LIMITS), rng.choice(TIME_LIMITS)
        template = rng.randrange(len(REQUESTS[named]))
        c, hidden = (cuisine, None) if named else (None, cuisine)
        if task_split(c, hidden, price, minutes, template) != split:
            continue
        if not fitting(
            menu,
            Task(
                id="",
                request="",
                cuisine=c,
                hidden_cuisine=hidden,
                max_price=price,
                max_minutes=minutes,
            ),
        ):
            continue
        text = REQUESTS[named][template].format(
            cuisine=cuisine, limits=_limits_text(price, minutes)
        )
        out.append(
            Task(
                id=f"{split}-{seed}-{len(out):04d}",
                request=text,
                cuisine=c,
                hidden_cuisine=hidden,
                max_price=price,
                max_minutes=minutes,
            )
        )
    return out


def fitting(
    menu: Menu, task: Task, allergies: list[str] = (), vegetarian: bool = False
) -> list[Dish]:
    """Dishes that satisfy the request and the diner (cuisine, price, time, allergens, diet)."""
    return [d for d in menu.dishes if not mismatch(d, task, allergies, vegetarian)]


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


def tool_call_message(action: Action, call_id: str) -> dict[str, Any]:
    """The OpenAI-style assistant message for a tool action (content keeps the raw text)."""
    return {
        "role": "assistant",
        "content": action.text,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": action.tool,
                    "arguments": json.dumps({TOOL_ARG[action.tool]: action.argument}),
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


def word_count(text: str) -> int:
    return len(WORD_RE.findall(text))


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
    truncated: bool = Field(False, description="Generation hit the token budget (not trained on).")
    guarded: bool = Field(
        False,
        description="The axiom guard replaced the policy's action with "
        "its fallback (not trained on).",
    )


class Outcome(BaseModel):
    success: int = Field(ge=0, le=1)
    reason: str
    dish: str | None = None


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

    def prompt_messages(self, turn: int) -> list[dict[str, Any]]:
        """What the policy saw before acting at assistant turn `turn`."""
        return self.messages[: self.turns[turn].message]

    def to_jsonl_row(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass
class DinerView:
    """What the diner believes: the part of an episode's state it reacts to."""

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


def system_prompt(dimensions: dict[str, Any]) -> str:
    """The policy's system message: the tools and the diner's (effective, redacted) profile."""
    allergies = ",".join(dimensions.get("allergies") or []) or "none"
    return (
        f"Concierge. Tools: @search CUISINE, @allergens DISH, @order DISH. "
        f"Diner: verbosity={dimensions.get('verbosity', 'normal')}, "
        f"pace={dimensions.get('pace', 'relaxed')}, diet={dimensions.get('diet', 'any')}, "
        f"allergies={allergies}."
    )


class World:
    """One concierge episode at a time: `reset`, then `step` until done, then `outcome`."""

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
                {"role": "system", "content": system_prompt(self.dims)},
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
        abstract = "|".join(
            [
                "ambiguous" if self.task.ambiguous else "named",
                f"v={d.get('verbosity')}",
                f"p={d.get('pace')}",
                f"veg={d.get('diet') == 'vegetarian'}",
                f"allergic={bool(d.get('allergies'))}",
                f"cuisine_known={v.cuisine_known}",
                f"searches={min(v.searches, 2)}",
                f"checked={min(len(v.checked), 2)}",
                f"rec={v.rec_state}",
                f"turn={min(len(t.turns), self.max_turns)}",
            ]
        )
        return exact, abstract

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
        return obs, t.done

    def outcome(self, traj: Trajectory | None = None) -> Outcome:
        """Success in {0, 1} with the reason (the world's checker; not the reward model)."""
        t = traj or self._need()
        if t.end != "ordered":
            return Outcome(
                success=0,
                reason={"left": "the diner left", "budget": "turn budget spent"}.get(
                    t.end, "no order"
                ),
            )
        dish_name = next(
            ti.action.argument for ti in reversed(t.turns) if ti.action.tool == "order"
        )
        dish = self.menu.find(dish_name)
        why = self._mismatch(dish)
        if why:
            return Outcome(
                success=0, reason=f"ordered {dish.name}: does not fit ({why})", dish=dish.name
            )
        return Outcome(success=1, reason=f"ordered {dish.name}, which fits", dish=dish.name)

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
            cuisine = arg.lower().strip(".")
            if cuisine not in self.menu.cuisines:
                return f"no dishes for '{arg[:40]}'; cuisines: {', '.join(self.menu.cuisines)}"
            v.searches += 1
            found = [d for d in self.menu.dishes if d.cuisine == cuisine]
            v.returned |= {d.name for d in found}
            return f"{cuisine}: " + "; ".join(
                f"{d.name} ({d.price:g}$, {d.minutes}min{', veg' if d.vegetarian else ''})"
                for d in found
            )
        dish = self.menu.find(arg)
        if dish is None:
            return f"unknown dish '{arg[:40]}'"
        if action.tool == "allergens":
            v.checked.add(dish.name)
            return (
                f"{dish.name}: {', '.join(dish.ingredients)}; allergens: "
                f"{', '.join(dish.allergens) or 'none'}"
            )
        self.traj.done, self.traj.end = True, "ordered"
        return f"ordered {dish.name}"

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
            if why:
                v.rec_state = "rejected"
                v.rejected.add(dish.name)
                reason = {
                    "diet": "I'm vegetarian.",
                    "cuisine": f"I wanted {task.wanted_cuisine}.",
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
