"""Where a policy breaks the personal clauses, and what the local reward pays for each way of
writing. For #14.

Not a test. Reads the held-out episodes `kitchen demo` keeps (`runs/<out>/held_out/<name>.json`,
played on the jobs of `runs/<out>/results.json`'s evaluation settings) and reports, per policy
and profile group (brief, detailed, hurried diners), every message to the diner sorted by its
form —

- *short*: a recommendation in the short form (`Mango Sticky Rice: 5$, 10 min.`);
- *recommend*: any other message that names a dish (`I recommend Mango Sticky Rice, ...`);
- *opening*: a line before the first recommendation of the episode or course that names no dish
  (`Good evening!`, `Great choice! Now the dessert.`);
- *question*: any other message that names no dish and asks something (`Which cuisine?`);
- *other*: the rest —

with how often the group's own clause (T3 for brief, T6 for detailed, T4 for hurried diners)
breaks on each form and the mean local reward the rule judge's verdicts give it (the kit's
weighted mean over the clauses that apply, `kitchen.review.turn_rewards`). For hurried diners it
also counts the episode's first action: a tool call carries no clause, so it never enters a state
group's local statistics (`mapo.StepBatch.valid`), and an opening line that breaks T4 is compared
only with other messages, never with the search it could have been.

Two more readings say whether RL *can* move a form:

- *the advantage each form earns*: every valid turn's local reward under each local mode
  (`reward.local_mode` mean and violations; `local_signal: clauses`), normalised among the turns
  that share its abstract state key (`mapo.local_advantages`, `mapo.clause_advantages`) — the
  comparison MAPO's local term makes, here over the whole held-out set. A form whose mean is
  near its rivals' gets no push, whatever its clause says. "mean|form" is the mean with content
  compared only among turns of the same form (`advantage.overrides.form_clauses: [T3, T4, T6]`,
  `mapo.form_judged`): what is left is the push of the form's own clauses;
- *first and later recommendations*: the short form's share among the recommendations of each
  profile group, the first of the episode against the later ones — a policy that picks the form
  from the diner's style keeps it; one that copies its own earlier messages or loses the thread
  in a long episode drifts;
- *what a recommendation follows*, per form: its dish checked earlier in the episode, right
  after a check of another dish (the wrong name copied), or unchecked otherwise. The scripted
  data checks both forms alike; a form that follows other dishes' checks more often earns less
  local reward for that, not for its length.

    .venv/bin/python benchmarks/bench_personal.py runs/demo-seeds sft demo-seeds-mapo-s0
    .venv/bin/python benchmarks/bench_personal.py --data data/sft/train.jsonl   # the data's forms
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean

import torch

from kitchen.config import KitchenError
from kitchen.demo import kept_settings
from kitchen.evaluate import eval_jobs
from kitchen.files import read_jsonl
from kitchen.judge import Turn, judge, replay
from kitchen.mapo import clause_advantages, encode, form_judged, local_advantages
from kitchen.models import profile_tag
from kitchen.review import clause_scores, turn_rewards
from kitchen.train import EpisodeRewards, form_share
from kitchen.world import Trajectory, load_menu, trajectory_from_messages

SHORT = re.compile(r"^[A-Z][^:.!?]*: \d+\$")  # `Dish: 5$, 10 min.`
FORMS = ("short", "recommend", "opening", "question", "other")
GROUPS = {"brief": ("verbosity", "T3"), "detailed": ("verbosity", "T6"), "hurried": ("pace", "T4")}


def form(turn: Turn) -> str:
    """The form of one message to the diner (module docstring)."""
    text = turn.text.strip()
    if SHORT.match(text):
        return "short"
    if turn.named:
        return "recommend"
    if turn.opening:
        return "opening"
    return "question" if text.endswith("?") else "other"


def first_action(turns: list[Turn]) -> str:
    if not turns:
        return "none"
    return f"tool @{turns[0].tool}" if turns[0].kind == "tool" else f"message: {form(turns[0])}"


MODES = ("mean", "violations", "clauses", "mean|form")
VALID = {"mean": "mean", "violations": "violations", "clauses": "mean", "mean|form": "mean"}
FORM_CLAUSES = ("T3", "T4", "T6")  # `advantage.overrides.form_clauses` for "mean|form"
RECS = ("short", "recommend")


def step_form(turn: Turn) -> str:
    """A message's form, or `@tool` for a tool call."""
    return form(turn) if turn.kind == "say" else f"@{turn.tool}"


def form_advantages(steps: list[dict]) -> dict[str, dict[tuple[str, str], float]]:
    """Mean local advantage per (profile group, form), per local signal (module docstring).

    `steps`: one dict per assistant turn — `key` (abstract state key), `groups`, `form`, and per
    mode in "mean"/"violations" the turn's `reward` and `valid`, plus `scores` (clause id →
    verdict, ±1) and `weights` (clause id → weight) for "clauses", and `form_share` (the form
    clauses' share of the mean reward, the code of their verdicts) for "mean|form"."""
    weights = {c: w for s in steps for c, w in s["weights"].items()}
    ids = sorted(weights)
    out: dict[str, dict[tuple[str, str], float]] = {}
    for mode in MODES:
        rows = [s for s in steps if s["valid"][VALID[mode]]]  # the turns with that signal
        if not rows:
            continue
        keys = encode([s["key"] for s in rows])
        if mode == "clauses":
            nan = float("nan")
            scores = torch.tensor([[s["scores"].get(c, nan) for c in ids] for s in rows])
            w = torch.tensor([weights[c] for c in ids], dtype=scores.dtype)
            adv, _ = clause_advantages(scores, w, keys)
        elif mode == "mean|form":
            rewards = torch.tensor([s["reward"]["mean"] for s in rows])
            share = torch.tensor([s["form_share"][0] for s in rows])
            code = torch.tensor([s["form_share"][1] for s in rows])
            adv, _ = local_advantages(form_judged(rewards, share, keys, code), keys)
        else:
            rewards = torch.tensor([s["reward"][mode] for s in rows])
            adv, _ = local_advantages(rewards, keys)
        cells: dict[tuple[str, str], list[float]] = defaultdict(list)
        for s, a in zip(rows, adv.tolist(), strict=True):
            for g in s["groups"]:
                cells[(g, s["form"])].append(a)
        out[mode] = {cell: mean(xs) for cell, xs in cells.items()}
    return out


def recommendation_drift(forms: list[str]) -> tuple[str | None, list[str]]:
    """(the first recommendation's form, the later ones') among an episode's messages."""
    recs = [f for f in forms if f in RECS]
    return (recs[0] if recs else None), recs[1:]


FOLLOWS = ("its dish checked", "after checking another", "unchecked, otherwise")


def follows(turns: list[Turn], forms: list[str]) -> list[tuple[str, str]]:
    """(form, what it follows) of every recommendation of an episode: its dish checked earlier
    in the episode, right after an `@allergens` call on another dish (the policy named another
    dish than the one it had just checked), or unchecked otherwise. In the scripted data both
    forms follow a check of their own dish alike; a policy whose short form, which opens with the
    dish's name, names another dish after a check copies the wrong name."""
    out = []
    for i, (t, f) in enumerate(zip(turns, forms, strict=True)):
        if f not in RECS or t.dish is None:
            continue
        before = turns[i - 1] if i else None
        if t.dish.name in t.checked:
            what = FOLLOWS[0]
        elif before is not None and before.kind == "tool" and before.tool == "allergens":
            what = FOLLOWS[1]
        else:
            what = FOLLOWS[2]
        out.append((f, what))
    return out


def data_follows(path: Path, menu=None) -> Counter:
    """`follows` for SFT dialogues (chat JSONL, as `kitchen world sft-data` writes them), each
    rebuilt as a trajectory and replayed as the judge reads it: (verbosity, form, whether the
    dish was checked before) → count."""
    menu = menu or load_menu()
    found: Counter = Counter()
    for row in read_jsonl(path):
        messages = row["messages"]
        verbosity = (profile_tag(messages) or "none").split()[0]  # `brief hurried` → brief
        turns = replay(trajectory_from_messages(messages), menu)
        for f, what in follows(turns, [step_form(t) for t in turns]):
            found[(verbosity, f, what == FOLLOWS[0])] += 1
    return found


def report(trajs: list[Trajectory], pcs: list, menu) -> None:
    count: dict[str, Counter] = defaultdict(Counter)
    broken: dict[str, Counter] = defaultdict(Counter)
    reward: dict[tuple[str, str], list[float]] = defaultdict(list)
    first: Counter = Counter()
    drift: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    steps: list[dict] = []
    followed: Counter = Counter()
    for traj, pc in zip(trajs, pcs, strict=True):
        review = judge(traj, pc, menu)
        local, valid, contrib = turn_rewards(review, pc)
        lost, lost_valid, _ = turn_rewards(review, pc, mode="violations")
        scores = clause_scores(review, pc)
        rewards = EpisodeRewards(local, valid, contrib, 0.0, scores=scores)
        verdict = {(v.turn, v.clause): v.verdict for v in review.verdicts}
        turns = replay(traj, menu)
        groups = [g for g, (dim, _) in GROUPS.items() if pc.dimensions.get(dim) == g]
        if "hurried" in groups:
            first[first_action(turns)] += 1
        forms = [step_form(t) for t in turns]  # a message's form, or `@tool`
        followed.update(follows(turns, forms))
        weights = {c.id: c.weight for c in pc.clauses}
        head, later = recommendation_drift(
            [f for t, f in zip(turns, forms, strict=True) if t.kind == "say"]
        )
        for g in groups:
            if head is not None:
                drift[g]["first"][head] += 1
                drift[g]["later"].update(later)
        for t, f in zip(turns, forms, strict=True):
            steps.append(
                {
                    "key": traj.turns[t.index].abstract_key,
                    "groups": groups,
                    "form": f,
                    "reward": {"mean": local[t.index], "violations": lost[t.index]},
                    "valid": {"mean": valid[t.index], "violations": lost_valid[t.index]},
                    "scores": scores[t.index],
                    "weights": weights,
                    "form_share": form_share(rewards, t.index, FORM_CLAUSES),
                }
            )
            if t.kind != "say":
                continue
            for g in groups:
                count[g][f] += 1
                broken[g][f] += verdict.get((t.index, GROUPS[g][1])) == "violate"
                if valid[t.index]:
                    reward[(g, f)].append(local[t.index])
    for g, (_, clause) in GROUPS.items():
        n = sum(count[g].values())
        print(f"  {g} diners, {n} messages ({clause} broken, mean local reward):")
        for f in FORMS:
            if count[g][f]:
                r = reward[(g, f)]
                print(
                    f"    {f:<10} {count[g][f] / n:6.1%}  {clause} {broken[g][f]:>4}/"
                    f"{count[g][f]:<5} reward {mean(r) if r else float('nan'):+.3f}"
                )
    n = sum(first.values())
    print(f"  hurried diners' first action ({n} episodes):")
    for what, k in first.most_common():
        print(f"    {what:<22} {k / n:6.1%}")
    print("  short form's share of recommendations, the episode's first · the later ones:")
    for g in GROUPS:
        cells = []
        for when in ("first", "later"):
            c = drift[g][when]
            k = sum(c.values())
            cells.append(f"{c['short'] / k:6.1%} of {k:<4}" if k else "     — of 0   ")
        print(f"    {g:<9} {cells[0]} · {cells[1]}")
    print("  what a recommendation follows, every diner:")
    for f in RECS:
        k = sum(followed[(f, w)] for w in FOLLOWS)
        cells = ", ".join(f"{w} {followed[(f, w)] / k:.0%}" for w in FOLLOWS) if k else "none"
        print(f"    {f:<10} {k:>5}: {cells}")
    adv = form_advantages(steps)
    shown = ("short", "recommend", "opening", "@search")
    print("  mean local advantage per form, normalised in abstract state groups (std units):")
    print(f"    {'':<20}" + "".join(f"{f:>11}" for f in shown))
    for g in GROUPS:
        for mode, cells in adv.items():
            row = "".join(
                f"{cells[(g, f)]:>+11.2f}" if (g, f) in cells else f"{'—':>11}" for f in shown
            )
            print(f"    {g + ' · ' + mode:<20}{row}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, nargs="?", help="a `kitchen demo` output folder")
    ap.add_argument("names", nargs="*", help="policies in its held_out/ (e.g. sft demo-mapo)")
    ap.add_argument("--data", type=Path, help="SFT dialogues: how often each form is unchecked")
    args = ap.parse_args()
    if args.data:
        found = data_follows(args.data)
        print(f"{args.data}: recommendations whose dish was not checked before, per form")
        for v in ("brief", "normal", "detailed"):
            cells = []
            for f in RECS:
                n = found[(v, f, True)] + found[(v, f, False)]
                cells.append(f"{f} {found[(v, f, False)] / n:.1%} of {n}" if n else f"{f} —")
            print(f"  {v:<9} " + " · ".join(cells))
    if not args.folder or not args.names:
        return
    cfg = kept_settings(args.folder)
    pcs = [pc for _, pc, _ in eval_jobs(cfg) for _ in range(cfg.samples)]
    menu = load_menu()
    for name in args.names:
        doc = json.loads((args.folder / "held_out" / f"{name}.json").read_text())
        trajs = [Trajectory.model_validate(r) for r in doc["episodes"]["policy"]]
        print(f"{name}: {len(trajs)} episodes")
        report(trajs, pcs, menu)


if __name__ == "__main__":
    try:
        main()
    except (KitchenError, OSError) as e:
        raise SystemExit(f"bench_personal: {e}") from None
