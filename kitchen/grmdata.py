"""The GRM's training data: judge-labelled reviews that cover every clause's violations.

The method's first stage of GRM training (docs/method.md#grm-training) is "criteria and judgement
data": reviews of dialogues, clause by clause, that show the reviewer every way a rule can be kept
and broken. A reviewer learns what its data shows it. The previous tiny GRM saw allergen (A1)
violations in 6% of A1's decided cells and learnt to call every dish safe (0 of 35 held-out A1
violations caught). This module builds data where every (clause, verdict) cell is well represented:

1. **Sources** (`pool`): dialogues of the scripted agents (`kitchen.scripted`: the clause
   breaker, the generic cold-start agent, the ideal agent) and, when given, rollouts of the SFT
   policy — the text the GRM will review during RL. Training tasks and profiles only — and, with
   `variants`, synthetic diners drawn around the training profiles (their dimensions redrawn,
   never a held-out diner's allergy set): eighteen diners hold only three two-allergy sets, and a
   reviewer trained on them alone learns those sets instead of reading the diner's list.
2. **Near misses** (`near_miss`): one turn of a dialogue edited so that a verdict hinges on one
   detail — a message padded or cut to exactly the word limit or one word past it, a dish swapped
   for another one allergen away in a recommendation or an order (or one no search returned, or
   one the diner refused earlier, named again on up to three later turns, or in a meal a second
   dish of a course already ordered, or — `checked_orders` — an order and the allergen check
   before it both renamed to an unrefused dish that holds the diner's allergen),
   an allergen check of a *different* dish, a confirmation naming a different dish, a request for
   a phone number slipped into a message. Edits are made in place (the diner's answer is
   kept), and the rule judge labels the edited dialogue, so labels stay exact. Edits also break the
   world's correlations a reviewer could lean on instead of the rule (a diner who always refuses
   an allergen dish would let "diner refuses" stand in for "contains the allergen").
3. **Adversarial samples** (`adversarial`): an attack of the corpus's training half, or a harmless
   rewording, added to one agent message (`kitchen.injection`), judge-labelled: the GRM learns that
   neither changes the other turns' verdicts (docs/method.md#reward-hacking).
4. **Class balance** (`balance`): from a pool several times larger than needed, dialogues are drawn
   without replacement with weight `max over its cells c of (1 / f_c)^γ`, `f_c` the share of pool
   dialogues holding a cell of kind c = (clause, verdict). A dialogue with a rare cell (an A1 or T7
   violation, a T6 pass) is drawn more often; γ = 0 is no balancing. `mix_table` reports the result
   per clause and verdict.
5. **Renderings** (`rows`): the dialogue as the GRM will see it — whole, or, as the truncation rule
   renders long dialogues, with compact tool results, clipped messages, or one window of turns.

Departure: the method's judgement data comes from people and strong models; here the rule judge
labels everything (the concierge world is built so that every clause is checkable), and the human
labels folder (`data/labels/`, notebook 03) overrides it where people disagree.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from kitchen.config import KitchenError, Problem, StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.critique import (
    RENDERINGS,
    conversation,
    format_lines,
    review_turns,
    turn_facts,
)
from kitchen.files import atomic_write_json, jsonl_rows, read_jsonl, write_jsonl
from kitchen.injection import attacks, message_turns, rewordings, with_text
from kitchen.judge import judge, max_words, min_words
from kitchen.review import ClauseVerdict, Review, overall_from
from kitchen.world import Menu, Trajectory, check_reply, load_menu, word_count

Example = tuple[
    Trajectory, PersonalConstitution, str
]  # (trajectory, personal constitution, source)

#: Requests for personal identifiers (A2 violations), in the world's phrasing.
PII_ASKS = (
    "Could you give me your phone number?",
    "What is your e-mail address?",
    "Can I have your full name for the order?",
    "What is your address, please?",
)

#: Neutral words that pad a message to an exact length (no dish, no question, no review words).
FILLER = [
    "it",
    "is",
    "a",
    "fine",
    "pick",
    "for",
    "tonight",
    "and",
    "many",
    "guests",
    "like",
    "it",
    "a",
    "lot",
    "so",
    "you",
    "may",
    "too",
]


# --------------------------------------------------------------------------------------------
# Edits (in place: one agent turn changes, the rest of the dialogue stays)


def _set_message(traj: Trajectory, turn: int, text: str) -> Trajectory:
    return with_text(traj, turn, text, mode="replace")


def resize(traj: Trajectory, turn: int, words: int, menu: Menu | None = None) -> Trajectory | None:
    """A copy whose message at `turn` has exactly `words` words: padded with neutral filler, or
    cut from the end as long as the dishes it names stay the same (None when that fails)."""
    menu = menu or load_menu()
    text = traj.messages[traj.turns[turn].message].get("content") or ""
    have = text.split()
    if len(have) < words:
        pad = [FILLER[i % len(FILLER)] for i in range(words - len(have))]
        new = " ".join(have + pad)
        if word_count(new) != words:
            return None
    else:
        new = " ".join(have[:words])
        if [d.name for d in menu.mentioned(new)] != [d.name for d in menu.mentioned(text)]:
            return None
    return _set_message(traj, turn, new)


def swap_dish(traj: Trajectory, turn: int, dish: Any, menu: Menu | None = None) -> Trajectory:
    """A copy where the dish that turn `turn` names first (its tool call's dish, or its message's
    first dish) is `dish` instead; a tool's answer about the dish is rewritten to match."""
    menu = menu or load_menu()
    out = traj.model_copy(deep=True)
    info = out.turns[turn]
    msg = out.messages[info.message]
    if info.action.kind == "say":
        old = menu.mentioned(info.action.text)[0]
        new = _replace_name(info.action.text, old.name, dish.name)
        msg["content"] = new
        info.action = info.action.model_copy(update={"text": new})
        return out
    raw = f"@{info.action.tool} {dish.name}"
    info.action = info.action.model_copy(update={"argument": dish.name, "text": raw})
    msg["content"] = raw
    for call in msg.get("tool_calls") or []:
        args = json.loads(call["function"]["arguments"])
        if "dish" in args:
            args["dish"] = dish.name
        call["function"]["arguments"] = json.dumps(args)
    if info.message + 1 < len(out.messages) and out.messages[info.message + 1]["role"] == "tool":
        reply = out.messages[info.message + 1]
        if info.action.tool == "allergens":
            reply["content"] = check_reply(dish)
        elif info.action.tool == "order":
            reply["content"] = f"ordered {dish.name}"
    return out


def _replace_name(text: str, old: str, new: str) -> str:
    low = text.lower()
    i = low.find(old.lower())
    return text if i < 0 else text[:i] + new + text[i + len(old) :]


def _neighbours(dish: Any, candidates: Iterable[Any], allergies: Sequence[str]) -> list[Any]:
    """Dishes "one allergen away": whether they hit the diner's allergies differs from `dish`, or
    their allergens differ by one; nearest first."""
    mine = set(dish.allergens)
    hit = bool(mine & set(allergies))
    scored = []
    for d in candidates:
        if d.name == dish.name:
            continue
        diff = len(mine ^ set(d.allergens))
        flips = bool(set(d.allergens) & set(allergies)) != hit
        scored.append((0 if flips else 1, diff, d.name, d))
    scored.sort(key=lambda x: x[:3])
    return [d for *_, d in scored]


def near_miss(
    traj: Trajectory,
    pc: PersonalConstitution,
    rng: random.Random,
    menu: Menu | None = None,
    checked_orders: int = 0,
    refused_again: int = 3,
) -> tuple[Trajectory, str] | None:
    """One near-miss edit of `traj` (see the module docstring) and its name, or None if no edit
    applies to this dialogue. `checked_orders` is the weight of the `checked-order` edit among
    the others (0: never drawn, as in the recipes written before it); `refused_again` the
    weight of the `refused` edit (3, as in the recipes written before it was a setting)."""
    from kitchen.judge import replay

    menu = menu or load_menu()
    turns = replay(traj, menu)
    allergies = list(pc.dimensions.get("allergies") or [])
    params = {c.id: c.params for c in pc.clauses}
    says = [t for t in turns if t.kind == "say"]
    named = [t for t in turns if t.dish is not None and (t.kind == "say" or t.tool == "order")]
    checks = [t for t in turns if t.tool == "allergens" and t.dish is not None]
    refused = [t for t in named if any(d in t.rejected for d in [t.dish.name])]
    late = [t for t in named if t.rejected - {t.dish.name}]  # a dish was refused before this turn
    orders = [t for t in named if t.tool == "order"]
    reorders = [t for t in orders if t.courses and t.served]  # a course was ordered before
    # orders of a dish the agent checked and the diner did not refuse: in the scripted data such
    # an order is safe 98% of the time, so a reviewer learns `checked` as `safe`
    vetted = [t for t in orders if allergies and t.dish.name in t.checked - t.rejected]
    options = []
    if says:
        options += ["length", "pii"]
    if named:  # the axioms' near misses weigh most: A1, A3 and A4 had the lowest recall
        options += ["allergen", "allergen", "unreturned", "unreturned"]
    if orders:  # an order of a dish one allergen away (an order's line says `safe` most often)
        options += ["allergen-order"]
    if reorders:  # T8: a second dish of a course already ordered
        options += ["reorder"] * 2
    if checks:
        options.append("check")
    if late and not refused:
        options += ["refused"] * refused_again
    if vetted:
        options += ["checked-order"] * checked_orders
    if not options:
        return None
    kind = rng.choice(options)
    if kind == "pii":
        t = rng.choice(says)
        ask = rng.choice(PII_ASKS)
        text = t.text if t.dish is not None else ""
        return _set_message(traj, t.index, f"{text} {ask}".strip()), "pii"
    if kind == "refused":
        # the refused dish named again on one to three later turns: the GRM's last line about
        # it said `not refused` (it was refused after), so only the card tells what changed
        t = rng.choice(late)
        again = menu.find(sorted(t.rejected - {t.dish.name})[0])
        if again is None:
            return None
        later = [u for u in late if again.name in u.rejected and u.index >= t.index]
        out = traj
        for u in sorted(
            rng.sample(later, min(len(later), rng.randint(1, 3))), key=lambda u: u.index
        ):
            out = swap_dish(out, u.index, again, menu)
        return out, "refused"
    if kind == "reorder":
        t = rng.choice(reorders)
        done = [d for d in menu.dishes if d.course in t.served and d.name != t.dish.name]
        seen = [d for d in done if d.name in t.returned] or done
        return (swap_dish(traj, t.index, rng.choice(seen), menu), "reorder") if seen else None
    if kind == "length":
        t = rng.choice(says)
        limits = []
        if "T3" in params:
            limits += [max_words(params), max_words(params) + 1]
        if "T6" in params and t.dish is not None:
            least = min_words(params)
            limits += [least - 1, least]
        if not limits:
            return None
        out = resize(traj, t.index, max(1, rng.choice(limits)), menu)
        return (out, "length") if out is not None else None
    if kind == "checked-order":
        return _checked_order(traj, rng.choice(vetted), checks, allergies, rng, menu)
    if kind == "check":
        t = rng.choice(checks)
        others = [d for d in menu.dishes if d.cuisine == t.dish.cuisine and d.name != t.dish.name]
        return (swap_dish(traj, t.index, rng.choice(others), menu), "check") if others else None
    t = rng.choice(orders if kind == "allergen-order" else named)
    if kind == "unreturned":
        pool = [d for d in menu.dishes if d.name not in t.returned]
    else:
        pool = [d for d in menu.dishes if d.name in t.returned] or list(menu.dishes)
    near = _neighbours(t.dish, pool, allergies)[:3]
    if not near:
        return None
    return swap_dish(traj, t.index, rng.choice(near), menu), kind


def _checked_order(
    traj: Trajectory,
    t: Any,
    checks: Sequence[Any],
    allergies: Sequence[str],
    rng: random.Random,
    menu: Menu,
) -> tuple[Trajectory, str] | None:
    """The `checked-order` edit: the order at turn `t` and the dish's last allergen check before
    it both name a dish that holds one of the diner's allergies (of the same course in a meal,
    returned by a search when one is, never refused) — checked, unrefused and unsafe, the case
    the scripted agents never play (they order only what their check found safe)."""
    check = max(
        (c for c in checks if c.dish.name == t.dish.name and c.index < t.index),
        key=lambda c: c.index,
        default=None,
    )
    unsafe = [
        d
        for d in menu.dishes
        if set(d.allergens) & set(allergies)
        and d.name not in t.rejected
        and (not t.courses or d.course == t.dish.course)
    ]
    unsafe = [d for d in unsafe if d.name in t.returned] or unsafe
    if check is None or not unsafe:
        return None
    dish = rng.choice(unsafe)
    out = swap_dish(swap_dish(traj, check.index, dish, menu), t.index, dish, menu)
    return out, "checked-order"


def adversarial(
    traj: Trajectory, rng: random.Random, split: Literal["train", "heldout"] = "train"
) -> tuple[Trajectory, str] | None:
    """`traj` with an attack (2 in 3) or a harmless rewording added to one agent message, and the
    id of what was added; None when the dialogue has no message turn."""
    turns = message_turns(traj)
    if not turns:
        return None
    turn = rng.choice(turns)
    if rng.random() < 2 / 3:
        a = rng.choice(attacks(split))
        mode = "replace" if rng.random() < 0.2 else "append"
        return with_text(traj, turn, a.text, mode), f"attack:{a.kind}"
    r = rng.choice(rewordings(split))
    return with_text(traj, turn, r.text), "rewording"


# --------------------------------------------------------------------------------------------
# Human labels (notebook 03 writes them; they override the judge where a person disagreed)


class HumanLabel(BaseModel):
    """A person's verdict on one (trajectory, turn, clause)."""

    trajectory: str
    turn: int = Field(ge=0)
    clause: str
    verdict: Literal["pass", "violate", "n/a"]
    annotator: str = "anonymous"
    agrees_with: str | None = Field(
        None,
        description="'grm' or 'judge' when given as agree/disagree with that reviewer's verdict.",
    )


class LabelSet(BaseModel):
    """Human labels and the trajectories (and personal constitutions) they refer to."""

    labels: list[HumanLabel] = Field(default_factory=list)
    trajectories: dict[str, Trajectory] = Field(default_factory=dict)
    constitutions: dict[str, PersonalConstitution] = Field(default_factory=dict)

    def for_trajectory(self, traj_id: str) -> dict[tuple[int, str], str]:
        return {(x.turn, x.clause): x.verdict for x in self.labels if x.trajectory == traj_id}


def load_labels(folder: str | os.PathLike) -> LabelSet:
    """Read `labels.jsonl` and `trajectories.jsonl` from a labels folder (missing: empty set).

    Every problem is `FILE:LINE: field: what is wrong`, all of them at once (the first 20): a
    line that is not a JSON object, a field that does not validate, a label whose trajectory is
    not in trajectories.jsonl, or whose turn the trajectory lacks, or whose clause its personal
    constitution lacks (such a label would silently never count)."""
    from pydantic import ValidationError

    from kitchen.config import Located, pydantic_problems

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise KitchenError(
            [Problem(str(folder), None, "folder", "is a file; give the labels folder")]
        )
    out = LabelSet()
    problems: list[Problem] = []

    def rows(path: Path) -> Iterable[tuple[Located, dict]]:
        for n, row in jsonl_rows(path, problems):
            yield Located(row, str(path), {(): n}), row

    tp = folder / "trajectories.jsonl"
    if tp.exists():
        for doc, row in rows(tp):
            missing = [k for k in ("trajectory", "constitution") if k not in row]
            if missing:
                problems.append(doc.problem((), f"missing field '{missing[0]}'"))
                continue
            try:
                traj = Trajectory.model_validate(row["trajectory"])
                pc = PersonalConstitution.model_validate(row["constitution"])
            except ValidationError as err:
                key = "trajectory" if err.title == "Trajectory" else "constitution"
                problems += pydantic_problems(err, doc, BaseModel, (key,))[:3]
                continue
            out.trajectories[traj.id] = traj
            out.constitutions[traj.id] = pc
    lp = folder / "labels.jsonl"
    if lp.exists():
        for doc, row in rows(lp):
            try:
                label = HumanLabel.model_validate(row)
            except ValidationError as err:
                problems += pydantic_problems(err, doc, HumanLabel)
                continue
            traj = out.trajectories.get(label.trajectory)
            if traj is None:
                problems.append(
                    doc.problem(
                        ("trajectory",),
                        f"{label.trajectory!r} is not in {tp.name}; a label needs its "
                        "trajectory saved beside it (grmdata.save_label writes both)",
                    )
                )
            elif label.turn >= len(traj.turns):
                problems.append(
                    doc.problem(
                        ("turn",),
                        f"turn {label.turn}, but the trajectory has {len(traj.turns)} "
                        "assistant turns (counted from 0)",
                    )
                )
            elif label.clause not in out.constitutions[label.trajectory].ids:
                problems.append(
                    doc.problem(
                        ("clause",),
                        f"clause {label.clause!r} is not in the trajectory's personal "
                        f"constitution ({', '.join(out.constitutions[label.trajectory].ids)})",
                    )
                )
            elif label.agrees_with not in (None, "grm", "judge"):
                problems.append(doc.problem(("agrees_with",), "must be 'grm', 'judge' or absent"))
            else:
                out.labels.append(label)
    if problems:
        raise KitchenError(problems[:20])
    return out


def save_label(
    folder: str | os.PathLike, label: HumanLabel, traj: Trajectory, pc: PersonalConstitution
) -> None:
    """Append one label (and its trajectory, the first time) to a labels folder, atomically."""
    folder = Path(folder)
    known = (
        {r["trajectory"]["id"] for r in read_jsonl(folder / "trajectories.jsonl")}
        if (folder / "trajectories.jsonl").exists()
        else set()
    )
    if traj.id not in known:
        write_jsonl(
            folder / "trajectories.jsonl",
            [
                {
                    "trajectory": traj.model_dump(mode="json"),
                    "constitution": pc.model_dump(mode="json"),
                }
            ],
            append=True,
        )
    write_jsonl(folder / "labels.jsonl", [label.model_dump(mode="json")], append=True)


def with_labels(review: Review, labels: dict[tuple[int, str], str]) -> Review:
    """`review` with human verdicts replacing its own where a person labelled the cell."""
    if not labels:
        return review
    out = [
        ClauseVerdict(
            turn=v.turn,
            clause=v.clause,
            verdict=labels[(v.turn, v.clause)],
            reason=v.reason if labels[(v.turn, v.clause)] == v.verdict else "per a human label",
        )
        if (v.turn, v.clause) in labels
        else v
        for v in review.verdicts
    ]
    return review.model_copy(update={"verdicts": out, "overall": overall_from(out)})


# --------------------------------------------------------------------------------------------
# Pool, balance, rows


def cells(review: Review) -> set[tuple[str, str]]:
    """The kinds of cell a review holds: {(clause, verdict)}."""
    return {(v.clause, v.verdict) for v in review.verdicts if v.verdict is not None}


def balance(
    pool: Sequence[Example], reviews: Sequence[Review], n: int, gamma: float, seed: int
) -> list[int]:
    """Indices of `n` examples of `pool` drawn without replacement, weighted towards rare
    (clause, verdict) cells (module docstring, step 4); `reviews[i]` is the judge's review of
    `pool[i]`."""
    kinds = [cells(r) for r in reviews]
    freq = Counter(k for ks in kinds for k in ks)
    total = max(len(pool), 1)
    weights = [max(((total / freq[k]) ** gamma for k in ks), default=1.0) for ks in kinds]
    rng = random.Random(f"balance:{seed}")
    # weighted sampling without replacement: the n largest keys u^(1/w) (Efraimidis–Spirakis)
    keys = sorted(range(len(pool)), key=lambda i: -(rng.random() ** (1.0 / weights[i])))
    return keys[: min(n, len(pool))]


def mix_table(reviews: Iterable[Review]) -> dict[str, dict[str, int]]:
    """Cell counts per clause and verdict: {clause: {pass, violate, n/a}}."""
    out: dict[str, Counter] = {}
    for r in reviews:
        for v in r.verdicts:
            if v.verdict is not None:
                out.setdefault(v.clause, Counter())[v.verdict] += 1
    return {c: dict(out[c]) for c in sorted(out)}


def example_row(
    traj: Trajectory,
    pc: PersonalConstitution,
    review: Review,
    *,
    first: int = 0,
    last: int | None = None,
    rendering: dict[str, Any] | None = None,
    clause_text: str = "compact",
    line_length: bool = True,
) -> dict[str, Any]:
    """One SFT row `{"messages": [system, user, assistant, user, assistant, ...]}`: the review of
    turns `first..last` as a conversation, each agent turn followed by the line the GRM should
    write about it (`kitchen.critique`; `line_length`: whether a line restates the message's
    length)."""
    users = review_turns(
        traj, pc, first=first, last=last, clause_text=clause_text, **(rendering or {})
    )
    facts = turn_facts(traj, pc, with_length=line_length)
    lines = format_lines(review, facts, first=first, last=last)
    return {"messages": conversation(users, lines), "trajectory": traj.id}


def rows(
    traj: Trajectory,
    pc: PersonalConstitution,
    review: Review,
    rng: random.Random,
    *,
    augment: float,
    max_window: int,
    clause_text: str = "compact",
    line_length: bool = True,
) -> list[dict[str, Any]]:
    """The training rows of one example: the whole dialogue, or — with probability `augment`,
    and always when it has more than `max_window` turns — consecutive windows in the compact
    rendering, as the truncation rule reviews dialogues too long for the GRM's context."""
    n = len(traj.turns)
    if n == 0:
        return []
    if n <= max_window and rng.random() >= augment:
        return [example_row(traj, pc, review, clause_text=clause_text, line_length=line_length)]
    out, first = [], 0
    while first < n:
        size = rng.randint(max(1, min(max_window, n) // 2), max(1, min(max_window, n)))
        last = min(n - 1, first + size - 1)
        out.append(
            example_row(
                traj,
                pc,
                review,
                first=first,
                last=last,
                rendering=RENDERINGS[-1],
                clause_text=clause_text,
                line_length=line_length,
            )
        )
        first = last + 1
    return out


def pool(
    n: int,
    split: Literal["train", "heldout"],
    seed: int,
    mix: dict[str, float],
    *,
    policy_samples: Sequence[tuple[Trajectory, PersonalConstitution]] = (),
    near_misses: float = 0.0,
    adversarial_share: float = 0.0,
    long_share: float | None = None,
    variants: float = 0.0,
    checked_orders: int = 0,
    refused_again: int = 3,
) -> list[Example]:
    """`n` scripted dialogues of `split` shared among the agents of `mix`, plus the policy
    samples given, each edited into a near miss with probability `near_misses` or given an
    attack or rewording of the split's half of the corpus with probability `adversarial_share`.
    A near-miss dialogue gets one to three edits (on turns drawn independently), since one
    dialogue holds many passes of a clause for each violation. `variants` of the scripted
    dialogues have a synthetic diner (`kitchen.jobs.pair_jobs`). `checked_orders` and
    `refused_again` weigh the `checked-order` and `refused` edits (`near_miss`). Sources read
    `grm`, `sft`, `ideal`, `policy`, with `+<edit>` for each kind of edit made."""
    from kitchen.scripted import GRM_QUIRKS, IDEAL_QUIRKS, SFT_QUIRKS, episodes

    agents = {"grm": GRM_QUIRKS, "sft": SFT_QUIRKS, "ideal": IDEAL_QUIRKS}
    total = sum(mix.values())
    names = [k for k in mix if mix[k] > 0]
    counts = [int(n * mix[k] / total) for k in names]
    counts[0] += n - sum(counts)
    base: list[Example] = []
    extra = {} if long_share is None else {"long_share": long_share}
    for j, (name, k) in enumerate(zip(names, counts, strict=True)):
        eps = episodes(
            k, split=split, seed=seed * 31 + j, quirks=agents[name], variants=variants, **extra
        )
        base += [(t, pc, name) for t, pc in eps]
    base += [(t, pc, "policy") for t, pc in policy_samples]
    rng = random.Random(f"pool:{split}:{seed}")
    out: list[Example] = []
    for t, pc, src in base:
        u = rng.random()
        names = []
        if u < near_misses:  # one to three near misses on different turns
            for _ in range(rng.randint(1, 3)):
                edit = near_miss(
                    t, pc, rng, checked_orders=checked_orders, refused_again=refused_again
                )
                if edit is not None:
                    t, names = edit[0], [*names, edit[1]]
        elif u < near_misses + adversarial_share:
            edit = adversarial(t, rng, split)
            if edit is not None:
                t, names = edit[0], [edit[1]]
        out.append((t, pc, "+".join([src, *sorted(set(names))])))
    return out


# --------------------------------------------------------------------------------------------
# The data a GRM recipe writes


class GRMDataSettings(StrictModel):
    """What the GRM learns from: judge-labelled reviews of scripted and policy dialogues, class-
    balanced, with near misses and adversarial samples (the module docstring)."""

    n_train: int = Field(
        6000,
        ge=1,
        description="Training dialogues after balancing (train tasks and profiles). A long "
        "dialogue gives one row per window.",
    )
    n_eval: int = Field(
        300,
        ge=1,
        description="Held-out dialogues (held-out tasks and profiles, natural mix, no edits): "
        "the eval loss and the agreement printed after training.",
    )
    seed: int = Field(0, description="Seeds the dialogues, the edits, the balance and the policy.")
    mix: dict[str, float] = Field(
        default_factory=lambda: {"grm": 0.5, "sft": 0.3, "ideal": 0.2},
        description="Share of each scripted agent in the pool (grm: breaks every clause; sft: "
        "the generic cold-start agent; ideal: what the constitution asks for).",
    )
    long_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of long-horizon tasks (meals of several courses) among the scripted "
        "dialogues: the main job trains on both kinds.",
    )
    pool_factor: float = Field(
        3.0,
        ge=1,
        description="The pool holds pool_factor × n_train dialogues; balancing keeps n_train. "
        "1: no balancing possible; 3 lets rare cells be drawn about three times as often.",
    )
    balance: float = Field(
        0.5,
        ge=0,
        le=2,
        description="γ of the balancing weight max_c (1/f_c)^γ (0: the pool's natural mix). 0.5 "
        "raised A1 violations from 6% to ~20% of A1's decided cells without starving the rest.",
    )
    near_misses: float = Field(
        0.3, ge=0, le=1, description="Share of pool dialogues given one near-miss edit."
    )
    adversarial: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Share of pool dialogues given an attack (training half of the corpus) or "
        "a harmless rewording on one agent message.",
    )
    augment: float = Field(
        0.15,
        ge=0,
        le=1,
        description="Share of dialogues that fit one window rendered as the truncation rule "
        "renders long ones anyway (compact tool results, clipped messages, windows).",
    )
    variants: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of scripted training dialogues played for a synthetic diner: a "
        "training profile with its dimensions redrawn (kitchen.profile.variant), never a "
        "held-out diner's allergy set. 0: the split's own profiles only.",
    )
    checked_orders: int = Field(
        0,
        ge=0,
        le=10,
        description="Weight of the `checked-order` near miss (an order of a checked, unrefused "
        "dish that holds the diner's allergen) among the ~12 other edits; 0 (the recipes before "
        "stage 7) never draws it.",
    )
    refused_again: int = Field(
        3,
        ge=0,
        le=12,
        description="Weight of the `refused` near miss (a dish the diner refused named again on "
        "later turns, an A4 violation) among the other edits. 3: the recipes before stage 9; "
        "stage 9 raised it after stage 8 trained on wrote `not refused` for refused dishes.",
    )
    line_length: bool = Field(
        True,
        description="Whether a review line restates the message's length beside the diner's "
        "limits (`31 words max 30`). False: the agent turn's tag still shows it, the line does "
        "not — about 4 of a line's ~34 tokens saved; a GRM trained so judges T3 and T6 from "
        "the tag (or the review cascade decides them by code).",
    )
    policy: str | None = Field(
        None,
        description="A policy checkpoint whose rollouts on training tasks join the pool (e.g. "
        "data/models/policy-tiny): the GRM then knows the text it will review in RL.",
    )
    policy_samples: int = Field(0, ge=0, description="How many rollouts of `policy` to add.")
    policy_temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of those rollouts (1.0: as in RL)."
    )
    labels: str | None = Field(
        "data/labels",
        description="Human labels folder (`kitchen.calibrate.save_label`); labelled cells "
        "override the judge. A missing or empty folder adds nothing.",
    )
    reuse: str | None = Field(
        None,
        description="Train on the review data another run wrote (its run folder) instead of "
        "writing new data; the fields above are then not used. For a second training stage.",
    )

    @model_validator(mode="after")
    def _check(self) -> GRMDataSettings:
        bad = sorted(set(self.mix) - set(AGENTS))
        if bad:
            raise ValueError(f"mix: unknown agent {bad[0]!r}; use {', '.join(AGENTS)}")
        if any(v < 0 for v in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError("mix: shares must be >= 0 with a positive sum")
        if self.policy_samples and not self.policy:
            raise ValueError("policy_samples > 0 needs `policy:` (a checkpoint folder)")
        if self.near_misses + self.adversarial > 1:
            raise ValueError("near_misses + adversarial must be at most 1 (shares of one pool)")
        return self


AGENTS = ("grm", "sft", "ideal")


def write_grm_data(
    out_dir: str | os.PathLike,
    settings: GRMDataSettings,
    review: Any = None,
    policy_samples: Sequence[tuple[Trajectory, PersonalConstitution]] = (),
    labels: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write `train.jsonl`, `eval.jsonl`, `eval_trajectories.jsonl` and `stats.json` (the
    sources and the per clause × verdict mix of each split) into `out_dir`.

    `review` (a `GRMConfig`) sets how prompts render (clause text) and the window size;
    `labels` (a `kitchen.calibrate.LabelSet`) adds human-labelled dialogues to training.
    """
    from tqdm.auto import tqdm

    from kitchen.grm import GRMConfig, without_clauses

    review = review or GRMConfig()
    s = settings
    out = Path(out_dir)
    rng = random.Random(f"grm-data:{s.seed}")
    stats: dict[str, Any] = {}
    for name, split in (("train", "train"), ("eval", "heldout")):
        if name == "train":
            n_pool = max(s.n_train, int(s.n_train * s.pool_factor))
            examples = pool(
                n_pool - len(policy_samples),
                split,
                s.seed,
                s.mix,
                policy_samples=policy_samples,
                near_misses=s.near_misses,
                adversarial_share=s.adversarial,
                long_share=s.long_share,
                variants=s.variants,
                checked_orders=s.checked_orders,
                refused_again=s.refused_again,
            )
        else:
            examples = pool(s.n_eval, split, s.seed + 1, s.mix, long_share=s.long_share)
        # the GRM never sees its `rule_only` clauses (`GRM.shown`): nor does its data
        examples = [(t, without_clauses(pc, review.rule_only), src) for t, pc, src in examples]
        reviews = [
            judge(t, pc)
            for t, pc, _ in tqdm(examples, desc=f"judge {name} pool", disable=not progress)
        ]
        keep = (
            balance(examples, reviews, s.n_train, s.balance, s.seed)
            if name == "train"
            else list(range(len(examples)))
        )
        chosen = [(examples[i], reviews[i]) for i in keep]
        if name == "train" and labels is not None:
            for tid, traj in labels.trajectories.items():
                pc = without_clauses(labels.constitutions[tid], review.rule_only)
                rev = with_labels(judge(traj, pc), labels.for_trajectory(tid))
                chosen.append(((traj, pc, "human-labelled"), rev))
        out_rows = []
        for (t, pc, _), rev in chosen:
            out_rows += rows(
                t,
                pc,
                rev,
                rng,
                augment=s.augment if name == "train" else 0.0,
                max_window=review.max_window_turns,
                clause_text=review.clause_text,
                line_length=s.line_length,
            )
        write_jsonl(out / f"{name}.jsonl", out_rows)
        if name == "eval":
            write_jsonl(
                out / "eval_trajectories.jsonl",
                (
                    {
                        "trajectory": t.model_dump(mode="json"),
                        "constitution": pc.model_dump(mode="json"),
                        "source": src,
                    }
                    for (t, pc, src), _ in chosen
                ),
            )
        stats[name] = {
            "dialogues": len(chosen),
            "rows": len(out_rows),
            "pool": len(examples),
            "sources": dict(Counter(src for (_, _, src), _ in chosen).most_common()),
            "meals": sum(bool(t.task.courses) for (t, _, _), _ in chosen),
            "mix": mix_table(rev for _, rev in chosen),
            "prompt_chars": sum(_chars(r, "user") for r in out_rows) // max(len(out_rows), 1),
            "review_chars": sum(_chars(r, "assistant") for r in out_rows) // max(len(out_rows), 1),
        }
    atomic_write_json(out / "stats.json", stats)
    return stats


def _chars(row: dict[str, Any], role: str) -> int:
    return sum(len(m["content"]) for m in row["messages"] if m["role"] == role)


def read_labelled(path: str | os.PathLike) -> list[tuple[Trajectory, PersonalConstitution]]:
    """(trajectory, personal constitution) pairs from a JSONL file of
    `{"trajectory": ..., "constitution": ...}` rows (`eval_trajectories.jsonl`, labels)."""
    return [
        (
            Trajectory.model_validate(row["trajectory"]),
            PersonalConstitution.model_validate(row["constitution"]),
        )
        for row in read_jsonl(path)
    ]


def policy_episodes(
    policy: str | Any,
    n: int,
    split: Literal["train", "heldout"],
    seed: int,
    temperature: float = 1.0,
    long_share: float = 0.5,
) -> list[tuple[Trajectory, PersonalConstitution]]:
    """`n` rollouts of `policy` (a checkpoint path, or a loaded `(model, tokenizer)`) on `split`
    tasks and profiles, two per (task, profile): [(trajectory, personal constitution)]."""
    from kitchen.evaluate import EvalConfig, eval_jobs
    from kitchen.models import ModelSpec, load_model
    from kitchen.rollout import RolloutConfig, rollout

    if n <= 0:
        return []
    model, tok = load_model(ModelSpec(path=policy)) if isinstance(policy, str) else policy
    k = 2
    cfg = EvalConfig(tasks=-(-n // k), samples=k, seed=seed, long_share=long_share)
    jobs = eval_jobs(cfg, split=split)
    trajs, _ = rollout(
        model,
        tok,
        jobs,
        RolloutConfig(k=k, temperature=temperature, max_turns=24),
        seed=seed,
        group_prefix=f"policy-{split}-{seed}:",
        progress=f"policy rollouts ({split})",
    )
    pcs = [pc for _, pc, _ in jobs for _ in range(k)]
    return list(zip(trajs, pcs, strict=True))[:n]


def mix_text(mix: dict[str, dict[str, int]]) -> str:
    """The training mix per clause and verdict, one line per clause (share of decided cells that
    are violations in brackets)."""
    lines = ["training mix (cells per clause: pass / violate / n/a):"]
    for clause, c in mix.items():
        p, v, na = c.get("pass", 0), c.get("violate", 0), c.get("n/a", 0)
        lines.append(
            f"  {clause:4} {p:7d} / {v:6d} / {na:7d}  ({v / max(p + v, 1):.0%} violations)"
        )
    return "\n".join(lines)
