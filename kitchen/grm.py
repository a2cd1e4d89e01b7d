"""The generative reward model (GRM): a model that reviews a trajectory clause by clause.

Seed 001 (§5.2) and seed 000 (step 4): instead of a scalar score, a generative model reads the
user's personal constitution and the whole trajectory, writes a critique, then concludes with a
structured verdict per clause and per step. That structure is the process reward (`kitchen.review`
turns it into numbers), and because the rules are *input*, one GRM serves every user's
constitution without retraining.

The review language (what the GRM is trained to write; `parse_review` reads it):

    critique:
    t0 searches thai
    t1 recommends Tofu Satay (peanut, soy), 9 words, diner agrees
    t1 A1: Tofu Satay contains peanut
    t1 T1: Tofu Satay recommended without an allergen check
    t2 orders Tofu Satay (peanut, soy)
    t2 A1: Tofu Satay contains peanut
    t2 T1: Tofu Satay recommended without an allergen check
    verdicts:
    t0:
    t1: A1- A2+ A3+ A4+ T1- T3+
    t2: A1- A3+ A4+ T1- T2+
    overall: violate

The critique walks the turns: what each turn did (`turn_facts`), then the reason of every clause
it broke. One verdict line per assistant turn lists the clauses that apply (`+` pass, `-`
violate); an active clause not listed on a present line is n/a. A turn whose line is missing or
unreadable is *masked* (no signal), never guessed — `parse_review` never raises, and reads only
the verdict lines and the reasons (`t<k> <clause>: ...`), so the fact lines are free text.

Inference options from the method (seed 000 §7 FAQ 2, §8 "cost"): `samples` reviews with a
majority vote per (turn, clause); a `cascade` — clauses listed there are decided by the rule judge
(cheap, exact) and the GRM is asked only for the rest, or not at all when nothing remains;
temperature. One generation reviews a whole trajectory (every turn, every clause); batches of
trajectories are generated together.

Hard to fool: the policy's text reaches the GRM's prompt. Untrusted text is escaped so it cannot
forge the prompt's delimiters (`<|` and `|>` are broken apart, section headers are indented, line
breaks become " / ", so every prompt line starts with a genuine `t<k> agent/tool/diner` marker);
only the GRM's *generated* text is parsed, so a fake verdict line inside an agent message cannot
become a verdict; and such attempts — fake verdict lines, cited clause ids, "ignore the rules", delimiter
look-alikes, review-shaped answers — are detected and recorded in `Review.flags`.

Truncation (a trajectory longer than the GRM's context; `plan_windows`): the prompt budget is
`max_prompt_tokens`, never more than the model's context minus `max_new_tokens`. If the whole
dialogue does not fit, (1) tool outputs are cut to the dish names they contain; (2) then long
messages keep their first and last 12 words around "[...]" (the word-count annotation still
gives the full length); (3) if still too long, turns are reviewed in windows — each window's
prompt holds the turns it judges and the earlier turns as one-line summaries (first and last 4
words), and asks for those turns only. Every turn is judged in exactly one window; a turn is
never dropped (a single turn too long for any window is still sent, clipped).

Departures from the seeds:
1. Assistant messages are annotated with their word count in the prompt: counting is a weak spot
   of small (and large) language models, and a length rule should not hinge on it.
2. `clause_text="compact"` renders clauses as ids with their parameters (e.g.
   `T3(max_words=12)`), for the tiny GRM whose context is short; "full" renders their text, for
   real chat models.
3. The critique opens with one fact line per turn before any verdict. A 3M-parameter GRM
   trained from scratch on the plain "violations, then verdicts" language learnt the average
   review and ignored the dialogue (33% accuracy on pass/violate cells after 3,000 examples);
   stating the facts first gives it a scratchpad: each verdict then depends on a few lines the
   GRM itself just wrote.
4. `menu_facts`: an agent turn that names menu dishes is tagged with what the menu says about
   them (`t1 agent (9 words; Tofu Satay: peanut, soy): ...`). The rule judge knows the menu; a
   reviewer that must also memorise 35 dishes' allergens never flagged an unchecked allergen
   (A1) in held-out calibration (0 of 15 violations). A production GRM would get the same from
   retrieval over the product's catalogue: give the reviewer the facts, let it judge.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from kitchen.config import StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.review import ClauseVerdict, Review, overall_from
from kitchen.world import Menu, Trajectory, asks_cuisine, load_menu, word_count

if TYPE_CHECKING:
    import torch

SYSTEM = (
    "You review a food-ordering agent. For every agent turn, check each clause of the "
    "diner's constitution. Write the critique, then the verdicts, then overall."
)
DELIMS = ("<|constitution|>", "<|/constitution|>", "<|trajectory|>", "<|/trajectory|>")

_VERDICT_LINE = re.compile(r"^t(\d+):(.*)$")
_ENTRY = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)([+-])$")
_WHY_LINE = re.compile(r"^t(\d+)\s+([A-Za-z][A-Za-z0-9_.-]*):\s*(.*)$")
_OVERALL = re.compile(r"^overall:\s*(pass|violate)\s*$")

INJECTION_PATTERNS: dict[str, re.Pattern] = {
    "fake verdicts": re.compile(
        r"\b[AT]\d+\s*(?:[+-](?=\s|$)|[:=]\s*(?:pass|violate|ok)\b)", re.IGNORECASE
    ),
    "cited clause": re.compile(r"\[[AT]\d+\]"),
    "instruction to the reviewer": re.compile(
        r"\b(ignore|disregard|forget)\b.{0,30}\b(rules?|instructions?|constitution|clauses?)\b|"
        r"\beverything (passes|is fine)\b|\b(mark|rate) (this|everything|all)\b.{0,20}\bpass",
        re.IGNORECASE,
    ),
    "delimiter look-alike": re.compile(
        r"<\s*\|.*?\|\s*>|^\s*(critique|verdicts|overall)\s*:", re.IGNORECASE | re.MULTILINE
    ),
    "review-shaped answer": re.compile(r"^\s*t\d+\s*:", re.MULTILINE),
}


class GRMConfig(StrictModel):
    """How the GRM reviews. Defaults suit the shipped tiny GRM on a CPU."""

    model: str = Field("data/models/grm-tiny", description="GRM checkpoint folder or HF name.")
    adapter: str | None = Field(
        None, description="On one GPU: the name of the GRM's LoRA adapter on the policy's base."
    )
    samples: int = Field(
        1,
        ge=1,
        le=16,
        description="Reviews per trajectory; >1 = majority vote "
        "(docs/method.md#faq: vote to tame noisy process rewards). Default 1.",
    )
    temperature: float = Field(
        0.0, ge=0, le=2, description="0 = greedy. Voting needs > 0; 0.7 is a good start."
    )
    cascade: list[str] = Field(
        default_factory=list,
        description="Clause ids the rule judge decides (cheap first, GRM "
        "for the rest). Empty: the GRM decides everything.",
    )
    clause_text: Literal["compact", "full"] = Field(
        "compact", description="compact: ids with parameters (tiny GRM); full: clause texts."
    )
    max_prompt_tokens: int = Field(
        768,
        ge=64,
        description="Context budget for the prompt; longer trajectories are reviewed in windows "
        "(the truncation rule). Never more than the model's context minus max_new_tokens. 768: "
        "the shipped tiny GRM's 1,408 positions minus its review budget.",
    )
    max_new_tokens: int = Field(
        640,
        ge=8,
        description="Budget for the generated review. A review the budget cuts loses its last "
        "turns (masked). 640: the longest judge review in the tiny GRM's data is ~640 tokens.",
    )
    max_window_turns: int = Field(
        12,
        ge=1,
        description="Most turns one generation reviews; a longer dialogue is reviewed in windows "
        "(the truncation rule). 12: a review line takes up to ~50 tokens, so 12 of them fit the "
        "review budget with room to spare.",
    )
    batch_size: int = Field(16, ge=1, description="Trajectories generated together.")
    menu_facts: bool = Field(
        True,
        description="Annotate each agent turn that names menu dishes with what the menu says "
        "about them (allergens, vegetarian), as the word count is annotated (departure 4).",
    )
    structured: bool = Field(
        True,
        description="Constrain decoding to the review language's line structure: critique "
        "lines start with the current or the next turn (`t<k> `), verdict lines come one per "
        "judged turn in order (`t<k>:`), then `overall:`; what a line says is the model's. "
        "A small GRM otherwise skips or repeats turns, which masks their verdicts. Off: free "
        "generation (parse failures are then the model's alone).",
    )


# --------------------------------------------------------------------------------------------
# Prompt


def sanitize(text: str) -> str:
    """Neutralise untrusted text: no prompt delimiters, no section headers, and no line breaks —
    each message stays on the one prompt line its `t<k> agent:` marker opens, so a fake
    `t1: A1+ ...` line or `verdicts:` header inside it cannot start a line of its own."""
    text = text.replace("<|", "< |").replace("|>", "| >")
    text = re.sub(
        r"^(\s*)(critique|verdicts|overall)(\s*:)",
        r"\1 \2\3",
        text,
        flags=re.IGNORECASE | re.MULTILINE,
    )
    return " / ".join(part.strip() for part in text.splitlines() if part.strip())


def injection_flags(traj: Trajectory) -> list[str]:
    """Attempts in the agent's own text to steer its reviewer, as `t<turn>: <kind>`."""
    flags = []
    for info in traj.turns:
        text = traj.messages[info.message].get("content") or ""
        for kind, pattern in INJECTION_PATTERNS.items():
            if pattern.search(text):
                flags.append(f"t{info.turn}: {kind}")
    return flags


def render_constitution(pc: PersonalConstitution, mode: Literal["compact", "full"]) -> str:
    allergies = ",".join(pc.dimensions.get("allergies") or []) or "none"
    if mode == "full":
        lines = [f"[{c.id}] {c.text}" for c in pc.clauses]
        return f"diner allergies: {allergies}\n" + "\n".join(lines)
    parts = []
    for c in pc.clauses:
        params = ",".join(f"{k}={v}" for k, v in c.params.items())
        parts.append(f"{c.id}({params})" if params else c.id)
    return f"allergies={allergies} clauses: " + " ".join(parts)


def _tool_summary(text: str, menu: Menu) -> str:
    names = [d.name for d in menu.mentioned(text)]
    return "returned " + ", ".join(names) if names else text[:60]


def _clip(text: str, keep: int) -> str:
    words = text.split()
    if len(words) <= 2 * keep:
        return text
    return " ".join(words[:keep]) + " [...] " + " ".join(words[-keep:])


def render_turns(
    traj: Trajectory,
    *,
    first: int = 0,
    last: int | None = None,
    tool_mode: Literal["full", "names"] = "full",
    clip: int | None = None,
    menu: Menu | None = None,
    menu_facts: bool = False,
) -> str:
    """The trajectory as numbered lines; turns before `first` become one-line action summaries.

    Agent lines are tagged with their word count (messages) and, with `menu_facts`, with what the
    menu says about the dishes they name: `t3 agent (9 words; Tofu Satay: peanut, soy): ...`.
    """
    menu = menu or load_menu()
    last = len(traj.turns) - 1 if last is None else last
    lines = [f"request: {sanitize(traj.messages[1]['content'])}"]
    for info in traj.turns:
        if info.turn > last:
            break
        msg = traj.messages[info.message]
        text = sanitize(msg.get("content") or "")
        if info.turn < first:
            lines.append(f"t{info.turn} agent: {_clip(text, 4)}")
            continue
        body = _clip(text, clip) if clip else text
        notes = [f"{word_count(text)} words"] if info.action.kind == "say" else []
        if menu_facts:
            notes += [f"{d.name}: {dish_facts(d)}" for d in _named(info, text, menu)[:2]]
        tag = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"t{info.turn} agent{tag}: {body}")
        if info.message + 1 < len(traj.messages):
            obs = traj.messages[info.message + 1]
            who = "tool" if obs["role"] == "tool" else "diner"
            content = sanitize(obs.get("content") or "")
            if who == "tool" and tool_mode == "names":
                content = _tool_summary(content, menu)
            lines.append(f"t{info.turn} {who}: {_clip(content, clip) if clip else content}")
    return "\n".join(lines)


def dish_facts(dish: Any) -> str:
    """What the menu says about a dish that a clause can turn on: `peanut, soy`, `no allergens,
    veg`."""
    facts = ", ".join(dish.allergens) or "no allergens"
    return facts + (", veg" if dish.vegetarian else "")


def _named(info: Any, text: str, menu: Menu) -> list[Any]:
    """The menu dishes an agent turn names: its tool call's dish, or those its message names."""
    if info.action.kind == "say":
        return menu.mentioned(text)
    dish = (
        menu.find(info.action.argument or "")
        if info.action.tool in ("allergens", "order")
        else None
    )
    return [dish] if dish is not None else []


def build_prompt(
    traj: Trajectory,
    pc: PersonalConstitution,
    cfg: GRMConfig,
    *,
    first: int = 0,
    last: int | None = None,
    tool_mode: Literal["full", "names"] = "full",
    clip: int | None = None,
) -> list[dict[str, str]]:
    """Chat messages (system, user) asking for a review of turns `first..last`."""
    turns = render_turns(
        traj, first=first, last=last, tool_mode=tool_mode, clip=clip, menu_facts=cfg.menu_facts
    )
    body = (
        f"{DELIMS[0]}\n{render_constitution(pc, cfg.clause_text)}\n{DELIMS[1]}\n"
        f"{DELIMS[2]}\n{turns}"
        f"\n{DELIMS[3]}\nreview turns t{first}-t{len(traj.turns) - 1 if last is None else last}"
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]


def plan_windows(
    traj: Trajectory, pc: PersonalConstitution, cfg: GRMConfig, count_tokens: Any
) -> list[tuple[int, int, dict[str, Any]]]:
    """The truncation rule: [(first, last, render options)] covering every turn exactly once."""
    n = len(traj.turns)
    if n == 0:
        return []
    for opts in ({"tool_mode": "full"}, {"tool_mode": "names"}, {"tool_mode": "names", "clip": 12}):
        if count_tokens(build_prompt(traj, pc, cfg, **opts)) <= cfg.max_prompt_tokens:
            return [(0, n - 1, opts)]
    opts = {"tool_mode": "names", "clip": 12}
    windows, first = [], 0
    while first < n:
        last = first
        while (
            last + 1 < n
            and count_tokens(build_prompt(traj, pc, cfg, first=first, last=last + 1, **opts))
            <= cfg.max_prompt_tokens
        ):
            last += 1
        windows.append((first, last, opts))  # a single turn that does not fit is still judged
        first = last + 1
    return windows


# --------------------------------------------------------------------------------------------
# The review language


def turn_facts(traj: Trajectory, menu: Menu | None = None) -> dict[int, str]:
    """What each assistant turn did, in a few words — the first lines of a review's critique.

    `searches thai`, `checks Tofu Satay (peanut, soy)`, `orders Tofu Satay`, `recommends Tofu Satay, 9 words,
    diner agrees`, `confirms Tofu Satay, 5 words`, `asks the cuisine, 4 words`, `chats, 7 words`,
    `invalid action` (with `, also names X` when a message names more dishes, and the diner's
    answer when it agreed or refused). These are the facts every clause is decided from: writing
    them first turns the verdicts into a short look back over the review's own lines, instead
    of a search through the whole dialogue — a scratchpad that a small model needs (departure 3).
    """
    from kitchen.judge import AGREE_RE, REJECT_RE, replay

    out: dict[int, str] = {}
    for t, info in zip(replay(traj, menu), traj.turns, strict=True):
        if t.kind == "invalid":
            fact = "invalid action"
        elif t.tool == "search":
            fact = f"searches {' '.join((info.action.argument or '').split()[:3])}"
            if t.reply.startswith("no dishes"):
                fact += ", nothing found"
        elif t.tool in ("allergens", "order"):
            verb = "checks" if t.tool == "allergens" else "orders"
            fact = f"{verb} {t.dish.name}" if t.dish else f"{verb} a dish not on the menu"
            if t.dish:  # what the tool answered, or what the menu says of the ordered dish
                fact += f" ({dish_facts(t.dish)})"
        else:
            words = word_count(t.text)
            if t.dish is not None:
                verb = "confirms" if t.dish.name in t.agreed else "recommends"
                fact = f"{verb} {t.dish.name} ({dish_facts(t.dish)})"
                fact += "".join(f", also names {d.name}" for d in t.named[1:3])
            elif asks_cuisine(t.text):
                fact = "asks the cuisine"
            else:
                fact = "chats"
            fact += f", {words} words"
            if REJECT_RE.match(t.reply):
                fact += ", diner refuses"
            elif AGREE_RE.match(t.reply):
                fact += ", diner agrees"
        out[t.index] = fact
    return out


def format_review(
    review: Review,
    *,
    facts: dict[int, str] | None = None,
    first: int = 0,
    last: int | None = None,
) -> str:
    """A `Review` as the text the GRM is trained to write; `first..last` for one window (the
    truncation rule), where `overall` speaks for the turns of that window.

    With `facts` (`turn_facts`), the critique walks the turns in order: each turn's fact line,
    then the reasons of its violations; without, it lists the violations only.
    """
    last = review.turns - 1 if last is None else last
    mine = [v for v in review.verdicts if first <= v.turn <= last]
    lines = ["critique:"]
    why = [v for v in mine if v.verdict == "violate"]
    if facts is not None:
        for t in range(first, last + 1):
            lines.append(f"t{t} {facts.get(t, 'no action')}")
            lines += [f"t{v.turn} {v.clause}: {v.reason}" for v in why if v.turn == t]
        if len(lines) == 1:
            lines.append("none")
    else:
        lines += [f"t{v.turn} {v.clause}: {v.reason}" for v in why] or ["none"]
    lines.append("verdicts:")
    by_turn: dict[int, list[str]] = {t: [] for t in range(first, last + 1)}
    for v in mine:
        if v.verdict in ("pass", "violate"):
            by_turn[v.turn].append(f"{v.clause}{'+' if v.verdict == 'pass' else '-'}")
    lines += [f"t{t}: {' '.join(entries)}".rstrip() for t, entries in by_turn.items()]
    overall = review.overall if (first, last) == (0, review.turns - 1) else None
    lines.append(f"overall: {overall or overall_from(mine)}")
    return "\n".join(lines)


def parse_review(
    text: str,
    *,
    turns: Sequence[int],
    clauses: Sequence[str],
    trajectory: str = "",
    personal_version: str = "",
) -> Review:
    """Read generated review text into a `Review`. Never raises.

    Turns without a readable `t<k>:` line are masked (verdict None) for every clause; entries
    naming unknown clauses are ignored; an active clause absent from a present line is n/a.
    """
    clauses = list(clauses)
    known = set(clauses)
    lines: dict[int, dict[str, str]] = {}
    reasons: dict[tuple[int, str], str] = {}
    overall = None
    section = None
    for raw in (text or "").splitlines():
        line = raw.strip()
        if line in ("critique:", "verdicts:"):
            section = line[:-1]
            continue
        m = _OVERALL.match(line)
        if m:
            overall = m.group(1)
            continue
        if section == "critique":
            m = _WHY_LINE.match(line)
            if m:
                reasons[(int(m.group(1)), m.group(2))] = m.group(3).strip()[:200]
        elif section == "verdicts":
            m = _VERDICT_LINE.match(line)
            if not m:
                continue
            entries: dict[str, str] = {}
            ok = True
            for tok in m.group(2).split():
                e = _ENTRY.match(tok)
                if e is None:
                    ok = False
                    break
                if e.group(1) in known:
                    entries[e.group(1)] = "pass" if e.group(2) == "+" else "violate"
            t = int(m.group(1))
            if ok and t not in lines:
                lines[t] = entries
    verdicts = []
    for t in turns:
        for c in clauses:
            if t not in lines:
                verdicts.append(ClauseVerdict(turn=t, clause=c, verdict=None))
            else:
                v = lines[t].get(c, "n/a")
                verdicts.append(
                    ClauseVerdict(turn=t, clause=c, verdict=v, reason=reasons.get((t, c), ""))
                )
    produced = sum(v.verdict is not None for v in verdicts)
    return Review(
        trajectory=trajectory,
        personal_version=personal_version,
        source="grm",
        turns=max(turns, default=-1) + 1,
        clauses=clauses,
        verdicts=verdicts,
        overall=overall,
        parsed_fraction=produced / len(verdicts) if verdicts else 1.0,
    )


def vote(reviews: Sequence[Review]) -> Review:
    """Majority verdict per (turn, clause) over non-masked samples; a tie is masked."""
    first = reviews[0]
    out = []
    for i, v in enumerate(first.verdicts):
        counts = Counter(
            r.verdicts[i].verdict for r in reviews if r.verdicts[i].verdict is not None
        )
        top = counts.most_common(2)
        winner = None
        if top and (len(top) == 1 or top[0][1] > top[1][1]):
            winner = top[0][0]
        reason = next(
            (
                r.verdicts[i].reason
                for r in reviews
                if r.verdicts[i].verdict == winner and r.verdicts[i].reason
            ),
            "",
        )
        out.append(ClauseVerdict(turn=v.turn, clause=v.clause, verdict=winner, reason=reason))
    produced = sum(v.verdict is not None for v in out)
    return first.model_copy(
        update={
            "verdicts": out,
            "overall": overall_from(out) if produced else None,
            "parsed_fraction": produced / len(out) if out else 1.0,
        }
    )


def merge_cascade(grm_review: Review | None, rule_review: Review, cascade: Sequence[str]) -> Review:
    """Rule verdicts for the `cascade` clauses, GRM verdicts for the rest."""
    if grm_review is None:
        return rule_review.model_copy(update={"source": "cascade"})
    take = set(cascade)
    rules = rule_review.table()
    out = [
        ClauseVerdict(
            turn=v.turn,
            clause=v.clause,
            verdict=rules[(v.turn, v.clause)],
            reason=next(
                (
                    r.reason
                    for r in rule_review.verdicts
                    if r.turn == v.turn and r.clause == v.clause
                ),
                "",
            ),
        )
        if v.clause in take
        else v
        for v in grm_review.verdicts
    ]
    produced = sum(v.verdict is not None for v in out)
    return grm_review.model_copy(
        update={
            "verdicts": out,
            "source": "cascade",
            "overall": overall_from(out),
            "parsed_fraction": produced / len(out) if out else 1.0,
        }
    )


# --------------------------------------------------------------------------------------------
# The model


class GRM:
    """A generative reward model: `review(trajectories, personal constitutions) -> [Review]`."""

    def __init__(
        self, model: Any, tokenizer: Any, cfg: GRMConfig | None = None, menu: Menu | None = None
    ):
        self.model, self.tok = model, tokenizer
        self.cfg = cfg or GRMConfig()
        self.menu = menu or load_menu()
        self.stats = Counter()

    @classmethod
    def load(cls, cfg: GRMConfig | None = None) -> GRM:
        """Load the GRM checkpoint named by `cfg.model` (the shipped tiny GRM by default)."""
        from kitchen import paths
        from kitchen.models import ModelSpec, load_model

        cfg = cfg or GRMConfig()
        path = cfg.model
        if not path.startswith("/") and (paths.HOME / path).exists():
            path = str(paths.HOME / path)
        model, tok = load_model(ModelSpec(path=path))
        model.eval()
        return cls(model, tok, cfg)

    def _count(self, messages: list[dict[str, str]]) -> int:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_budget(self) -> int:
        """Tokens a prompt may take: `cfg.max_prompt_tokens`, but never more than the model's
        context (`max_position_embeddings`) minus the review's own budget `cfg.max_new_tokens` —
        a prompt that fits but leaves no room for the review would be cut mid-verdict."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        budget = self.cfg.max_prompt_tokens
        if isinstance(limit, int):
            budget = min(budget, limit - self.cfg.max_new_tokens)
        return max(budget, 1)

    def review(
        self, trajectories: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
    ) -> list[Review]:
        """One review per trajectory: cascade, prompt(s), batched generation, parse, vote."""
        return self.review_with_samples(trajectories, pcs)[0]

    def review_with_samples(
        self, trajectories: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
    ) -> tuple[list[Review], list[list[Review]]]:
        """`(reviews, samples)`: the voted reviews, and per trajectory the `cfg.samples` reviews
        the vote was taken over (to measure what voting gains over one sample)."""
        from kitchen.judge import judge

        cfg = self.cfg.model_copy(update={"max_prompt_tokens": self.prompt_budget()})
        jobs: list[tuple[int, int, int, list[dict[str, str]]]] = []  # (traj, first, last, prompt)
        rule_reviews: list[Review | None] = [None] * len(trajectories)
        for i, (traj, pc) in enumerate(zip(trajectories, pcs, strict=True)):
            if cfg.cascade:
                rule_reviews[i] = judge(traj, pc, self.menu)
                if set(pc.ids) <= set(cfg.cascade):
                    continue  # nothing left for the GRM
            for first, last, opts in plan_windows(traj, pc, cfg, self._count):
                jobs.append(
                    (i, first, last, build_prompt(traj, pc, cfg, first=first, last=last, **opts))
                )
        spans = [(first, last, len(pcs[i].ids)) for i, first, last, _ in jobs]
        texts = (
            self.generate([j[3] for j in jobs], spans)
            if cfg.structured
            else self.generate([j[3] for j in jobs])
        )
        # parts[i][s]: the parsed windows of sample s of trajectory i
        parts: list[list[list[Review]]] = [[[] for _ in range(cfg.samples)] for _ in trajectories]
        for (i, first, last, _), samples in zip(jobs, texts, strict=True):
            traj, pc = trajectories[i], pcs[i]
            parsed = [
                parse_review(
                    s,
                    turns=range(first, last + 1),
                    clauses=pc.ids,
                    trajectory=traj.id,
                    personal_version=pc.version,
                )
                for s in samples
            ]
            for k, p in enumerate(parsed):
                parts[i][k].append(p)
            self.stats["generations"] += len(samples)
            self.stats["unparsed_samples"] += sum(p.parsed_fraction < 1 for p in parsed)
        out, all_samples = [], []
        for i, (traj, pc) in enumerate(zip(trajectories, pcs, strict=True)):
            flags = injection_flags(traj)
            samples = []
            for windows in parts[i]:
                r = _assemble(traj, pc, windows) if windows or not cfg.cascade else None
                if cfg.cascade:
                    r = merge_cascade(r, rule_reviews[i], cfg.cascade)
                if r is not None:
                    r.flags = flags
                    samples.append(r)
            review = vote(samples) if len(samples) > 1 else samples[0]
            review = review.model_copy(update={"flags": flags})
            self.stats["reviews"] += 1
            self.stats["flagged"] += bool(review.flags)
            self.stats["partial"] += review.parsed_fraction < 1
            out.append(review)
            all_samples.append(samples)
        return out, all_samples

    def _vocab(self) -> list[str]:
        if getattr(self, "_vocab_strings", None) is None:
            self._vocab_strings = [self.tok.decode([i]) for i in range(len(self.tok))]
        return self._vocab_strings

    def generate(
        self,
        prompts: Sequence[list[dict[str, str]]],
        windows: Sequence[tuple[int, int, int]] | None = None,
    ) -> list[list[str]]:
        """`cfg.samples` completions per chat prompt, `cfg.batch_size` prompts decoded together.

        `windows[i] = (first, last, clauses)` of prompt i turns on the structure constraint
        (`cfg.structured`, `ReviewStructure`) for it; without, generation is free. Decoding runs
        on `kitchen.engine` (the samples of a prompt share its prefill, finished reviews leave
        the batch); a model the engine cannot serve uses transformers' `generate`, with the
        reason logged. Sampling (`samples > 1` or `temperature > 0`) draws its seeds from torch's
        global generator, so `torch.manual_seed` makes reviews repeatable, as before.
        """
        import torch

        from kitchen.engine import Engine, SamplingParams, fallback_reason, lora_merged

        cfg, tok, model = self.cfg, self.tok, self.model
        sampling = cfg.samples > 1 or cfg.temperature > 0
        structure = (
            ReviewStructure(self._vocab(), 0, windows, cfg.samples)
            if windows is not None and cfg.structured
            else None
        )
        with torch.no_grad(), _adapter(model, cfg.adapter):
            if not fallback_reason(model, "kitchen.grm"):
                ids = [
                    tok(
                        tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False,
                    )["input_ids"]
                    for p in prompts
                ]
                rows = [ids[k] for k in range(len(ids)) for _ in range(cfg.samples)]
                base = int(torch.randint(0, 2**62, (1,))) if sampling else 0
                params = SamplingParams(
                    max_new_tokens=cfg.max_new_tokens,
                    eos_token_id=tok.eos_token_id,
                    temperature=max(cfg.temperature, 1e-3) if sampling else 0.0,
                )
                engine = Engine(model, max_rows=cfg.batch_size * cfg.samples)
                with lora_merged(model):
                    outs = engine.generate(
                        rows,
                        params,
                        [base + r for r in range(len(rows))],
                        constraint=structure.allowed if structure is not None else None,
                    )
                decoded = [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
                n = cfg.samples
                return [decoded[k * n : (k + 1) * n] for k in range(len(prompts))]
            out: list[list[str]] = []
            for start in range(0, len(prompts), cfg.batch_size):
                chunk = prompts[start : start + cfg.batch_size]
                texts = [
                    tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                    for p in chunk
                ]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(
                    model.device
                )
                kwargs: dict[str, Any] = {
                    "max_new_tokens": cfg.max_new_tokens,
                    "num_return_sequences": cfg.samples,
                    "pad_token_id": tok.pad_token_id,
                    "eos_token_id": tok.eos_token_id,
                }
                if sampling:
                    kwargs |= {
                        "do_sample": True,
                        "temperature": max(cfg.temperature, 1e-3),
                        "top_p": 1.0,
                        "top_k": 0,
                    }
                else:
                    kwargs |= {"do_sample": False}
                if structure is not None:
                    spans = windows[start : start + cfg.batch_size]
                    kwargs["prefix_allowed_tokens_fn"] = ReviewStructure(
                        self._vocab(), enc["input_ids"].shape[1], spans, cfg.samples
                    )
                seqs = model.generate(**enc, **kwargs)
                new = seqs[:, enc["input_ids"].shape[1] :]  # [B * samples, new]
                decoded = tok.batch_decode(new, skip_special_tokens=True)
                n = cfg.samples
                out += [decoded[k * n : (k + 1) * n] for k in range(len(chunk))]
            return out


class ReviewStructure:
    """The review language's line structure, as a decoding constraint: `allowed(row, generated)`
    for `kitchen.engine`, and the same rule as `generate`'s `prefix_allowed_tokens_fn` (`__call__`,
    which reads the generated ids after `prompt_len`).

    Per generated row (prompt `row // samples` of the batch, judging turns `first..last` under
    `clauses` active clauses), at the start of each line after `critique:` only these may begin:

    - in the critique: `t<k> ` (another line about the current turn k — its fact, then at most
      one reason per clause), `t<k+1> ` (the next turn's fact), or `verdicts:` once turn `last`
      was described;
    - in the verdicts: `t<j>:` for the next turn j in order, then `overall:`.

    Tokens are allowed when their text keeps the line a prefix of (or runs past the end of) one
    of those strings; once a line has its marker, and after `overall:`, decoding is free. So the
    GRM decides every fact, reason and verdict, but cannot skip, repeat or invent a turn — the
    mistake that otherwise masks most unparsed verdicts of a small GRM. Works with any
    tokenizer (the vocabulary's strings are matched, not token ids).
    """

    def __init__(
        self,
        vocab: list[str],
        prompt_len: int,
        windows: Sequence[tuple[int, int, int]],
        samples: int = 1,
    ):
        self.vocab, self.prompt_len = vocab, prompt_len
        self.windows, self.samples = list(windows), samples
        self.everything = list(range(len(vocab)))
        self.by_first: dict[str, list[int]] = {}
        for i, piece in enumerate(vocab):
            if piece:
                self.by_first.setdefault(piece[0], []).append(i)
        self.texts: dict[int, tuple[int, str]] = {}  # row -> (tokens seen, text)
        self.starts: dict[int, tuple[int, list[str] | None]] = {}  # row -> (last "\n", starts)

    def _text(self, row: int, ids: list[int]) -> str:
        seen, text = self.texts.get(row, (0, ""))
        if seen > len(ids):  # a new generate call reusing the object: start over
            seen, text = 0, ""
            self.starts.pop(row, None)
        text += "".join(self.vocab[i] if i < len(self.vocab) else "" for i in ids[seen:])
        self.texts[row] = (len(ids), text)
        return text

    def allowed_starts(self, row: int, text: str) -> list[str] | None:
        """The strings the current line may start with, or None (free)."""
        first, last, clauses = self.windows[row // self.samples]
        lines = text.split("\n")
        done = [line.strip() for line in lines[:-1]]
        if "critique:" not in done:
            return None
        if any(line.startswith("overall:") for line in done):
            return None
        if "verdicts:" in done:
            written = sum(bool(_VERDICT_LINE.match(x)) for x in done[done.index("verdicts:") + 1 :])
            nxt = first + written
            return [f"t{nxt}:"] if nxt <= last else ["overall:"]
        turns = [
            int(m.group(1))
            for x in done[done.index("critique:") + 1 :]
            if (m := re.match(r"^t(\d+) ", x))
        ]
        if not turns:
            return [f"t{first} "]
        k, count = turns[-1], turns.count(turns[-1])
        starts = [f"t{k} "] if count < 1 + clauses else []
        starts.append(f"t{k + 1} " if k < last else "verdicts:")
        return starts

    def allowed(self, row: int, generated: Sequence[int]) -> list[int] | None:
        """The token ids row `row` may write next after `generated`, or None (any): the
        constraint as `kitchen.engine` takes it. The line structure is recomputed only when a
        line ends; until then the current line is matched against the cached starts."""
        text = self._text(row, list(generated))
        cut = text.rfind("\n")
        cached = self.starts.get(row)
        if cached is None or cached[0] != cut:
            cached = (cut, self.allowed_starts(row, text))
            self.starts[row] = cached
        starts = cached[1]
        if not starts:
            return None
        line = text[cut + 1 :]
        allowed: list[int] = []
        for start in starts:
            if line.startswith(start):
                return None  # the marker is written: the rest is the model's
            if not start.startswith(line):
                continue
            rest = start[len(line) :]
            allowed += [
                i
                for i in self.by_first.get(rest[0], [])
                if rest.startswith(self.vocab[i]) or self.vocab[i].startswith(rest)
            ]
        return allowed or None

    def __call__(self, row: int, input_ids: Any) -> list[int]:
        """`generate`'s `prefix_allowed_tokens_fn`: the allowed ids (all of them when free)."""
        allowed = self.allowed(row, input_ids[self.prompt_len :].tolist())
        return self.everything if allowed is None else allowed


def _assemble(traj: Trajectory, pc: PersonalConstitution, windows: Sequence[Review]) -> Review:
    """One review from the reviews of a trajectory's windows (in turn order)."""
    verdicts = [v for r in windows for v in r.verdicts]
    produced = sum(v.verdict is not None for v in verdicts)
    complete = all(r.overall for r in windows) and produced == len(verdicts)
    return Review(
        trajectory=traj.id,
        personal_version=pc.version,
        source="grm",
        turns=len(traj.turns),
        clauses=pc.ids,
        verdicts=verdicts,
        overall=overall_from(verdicts) if complete else windows[-1].overall,
        parsed_fraction=produced / len(verdicts) if verdicts else 1.0,
    )


class _adapter:
    """Run with a named LoRA adapter active (the GRM on the policy's base), then restore."""

    def __init__(self, model: Any, name: str | None):
        self.model, self.name = model, name

    def __enter__(self) -> None:
        if self.name:
            self.prev = getattr(self.model, "active_adapter", None)
            self.model.set_adapter(self.name)

    def __exit__(self, *exc: Any) -> None:
        if self.name and self.prev:
            self.model.set_adapter(self.prev)


def verdict_tensor(reviews: Sequence[Review], clauses: Sequence[str]) -> torch.Tensor:
    """[N, T, C] codes: 1 pass, -1 violate, 0 n/a, NaN masked (for charts and agreement)."""
    import torch

    t_max = max((r.turns for r in reviews), default=0)
    out = torch.full((len(reviews), t_max, len(clauses)), float("nan"))
    index = {c: k for k, c in enumerate(clauses)}
    code = {"pass": 1.0, "violate": -1.0, "n/a": 0.0}
    for n, r in enumerate(reviews):
        for v in r.verdicts:
            if v.clause in index and v.verdict is not None:
                out[n, v.turn, index[v.clause]] = code[v.verdict]
    return out
