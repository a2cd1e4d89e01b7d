"""Where a policy breaks the red lines, and whether it reads its own allergen checks. For #14.

Not a test. Reads the held-out episodes `kitchen demo` keeps (`runs/<out>/held_out/<name>.json`,
played on the jobs of `runs/<out>/results.json`'s evaluation settings) or `bench_arms.py` keeps
(`runs/arms`; both write the settings they played with into the folder's `results.json`) and
reports, per policy:

- axiom violations per axiom and task kind (the rule judge);
- where each A1 violation stood to the checks: right after the check of that dish, after an
  earlier check of it, or never checked (`a1_reasons`);
- why each A3 violation named a dish no search returned, by the turn that named it (a message,
  `@allergens`, `@order`): no dish of the menu, a dish of another course or cuisine, or the
  right course and cuisine never searched (`a3_reasons`);
- what the policy does right after an `@allergens` check, for allergic diners, by what the check
  found — *unsafe* (the dish holds one of the diner's allergens) or *safe*: recommend that very
  dish, check another, anything else. A policy that reads its checks recommends after a safe
  check and moves on after an unsafe one; the scripted agents of the SFT data never recommend a
  dish their check found unsafe;
- with `--grm N`: the shipped GRM's verdicts on the first N episodes against the rule judge's,
  every clause (violations caught, called n/a, false alarms), and how far the local reward it
  gives each turn is from the judge's — is the reviewer what misses them?

`--diners POLICY` plays held-out tasks twice with the same policy — once with the training
diners, once with the held-out ones — and compares the axiom violations (A1 per judged turn of an
allergic diner): does the policy read the allergy list, or remember the eighteen diners it was
trained with? (`POLICY`: a model folder or a run; `--tasks N`, 120 by default, × 2 samples.)

`--probe POLICY ...` asks the same question without playing episodes: every allergen check of an
allergic diner in held-out SFT dialogues (`--dialogues`, `data/sft/eval.jsonl` by default; the
scripted agent's own turns before it), the policy writes the next turn `--answers` times at
temperature 1 — recommend the checked dish, check another, anything else — by what the check
found: one of the diner's allergens, only other allergens, or none. A policy that reads the
allergy list treats the last two alike; one that only reads the check's reply does not. The
same contexts for every policy, so a cold start can be compared before any RL (about two
minutes per policy on one core). `--temperature 0` asks for the policy's most likely turn instead
(one answer per check): is a wrong answer the tail of the distribution, or its mode? With it the
probe also prints the mean probability the policy gives to opening its turn with `@allergens`
(checking another dish) by what the check found: how sure the decision is, not only which way it
falls. `--dialogues` of training dialogues (e.g. `head -300 data/sft/train.jsonl`) asks whether
the decision is fitted at all, before asking whether it generalises.

`--data data/sft/train.jsonl` counts the safe and unsafe checks of SFT dialogues (allergic
diners), and `--samples runs/<run>/samples.jsonl` averages the local reward of a training run's
turn after a check, by what the check found and what the turn did.

    .venv/bin/python benchmarks/bench_red_lines.py runs/demo-seeds sft demo-seeds-mapo-s0
    .venv/bin/python benchmarks/bench_red_lines.py runs/arms sft mapo   # after bench_arms.py
    .venv/bin/python benchmarks/bench_red_lines.py runs/demo-seeds demo-seeds-mapo-s0 --grm 80
    .venv/bin/python benchmarks/bench_red_lines.py --diners data/models/policy-tiny
    .venv/bin/python benchmarks/bench_red_lines.py --probe data/models/policy-tiny
    .venv/bin/python benchmarks/bench_red_lines.py --probe data/models/policy-tiny --temperature 0
    .venv/bin/python benchmarks/bench_red_lines.py --data data/sft/train.jsonl
    .venv/bin/python benchmarks/bench_red_lines.py --samples runs/demo-seeds-mapo-s0/samples.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean

import torch

from kitchen.config import KitchenError
from kitchen.demo import kept_settings
from kitchen.evaluate import EvalConfig, eval_jobs
from kitchen.files import read_jsonl
from kitchen.judge import RULES, Turn, judge, replay
from kitchen.world import Task, Trajectory, load_menu

AXIOMS = ("A1", "A3", "A4")
ALLERGIES = re.compile(r"allergies=([\w,]+)")


def after_check(turns: list[Turn], allergies: set[str]) -> list[tuple[str, str, int]]:
    """(what the check found, what the next turn did, the next turn's index) for every
    `@allergens` check of an allergic diner followed by another turn."""
    out = []
    for t, nxt in itertools.pairwise(turns):
        if t.tool != "allergens" or t.dish is None or not allergies:
            continue
        found = "unsafe" if set(t.dish.allergens) & allergies else "safe"
        if nxt.kind == "say" and nxt.dish is not None and nxt.dish.name == t.dish.name:
            did = "recommend it"
        elif nxt.tool == "allergens":
            did = "check another"
        else:
            did = "other"
        out.append((found, did, nxt.index))
    return out


def a3_reasons(turns: list[Turn], task: Task, broken: set[int]) -> Counter:
    """Why each A3 violation of an episode (`broken`: the turns the judge found breaking A3) named
    a dish no search returned, by the turn that broke it (`say`, `@allergens`, `@order`): no dish
    of the menu at all (a name garbled in copying; only a tool call can name one — a message's
    dishes are the menu's names it holds), a dish of another course, of another cuisine than the
    diner's, or of the right course and cuisine (returned by no search because the search that
    would return it was never made)."""
    out = Counter()
    for t in turns:
        if t.index not in broken:
            continue
        how = f"@{t.tool}" if t.tool else t.kind
        d = next((d for d in t.named if d.name not in t.returned), None)
        if t.unknown_dish or d is None:
            out[(how, "no dish of the menu")] += 1
        elif d.course != next((c for c in t.courses if c not in t.served), "main"):
            out[(how, "another course")] += 1
        elif task.wanted_cuisine and d.cuisine != task.wanted_cuisine:
            out[(how, "another cuisine")] += 1
        else:
            out[(how, "the right course and cuisine, unsearched")] += 1
    return out


def a1_reasons(turns: list[Turn], broken: set[int]) -> Counter:
    """Where each A1 violation of an episode (`broken`: the turns the judge found breaking A1)
    stood to the checks, by the turn that broke it (`say`, `@order`): right after the check of
    that very dish (the check was read wrongly), after a check of it earlier in the episode (read
    and then forgotten), or with the dish never checked (T1 skipped: the policy could not know)."""
    out = Counter()
    by_index = {t.index: t for t in turns}
    for i in sorted(broken):
        t, prev = by_index[i], by_index.get(i - 1)
        how = f"@{t.tool}" if t.tool else t.kind
        name = t.dish.name if t.dish is not None else None
        if prev is not None and prev.tool == "allergens" and prev.dish and prev.dish.name == name:
            out[(how, "right after its check")] += 1
        elif name in t.checked:
            out[(how, "checked earlier")] += 1
        else:
            out[(how, "never checked")] += 1
    return out


def next_turn(text: str, dish: str) -> str:
    """What an assistant turn written right after the check of `dish` does."""
    text = text.strip()
    if text.startswith("@allergens") and dish not in text:
        return "check another"
    if not text.startswith("@") and dish in text:
        return "recommend it"
    return "other"


def probe(
    policy: str, dialogues: Path, answers: int, seed: int = 0, temperature: float = 1.0
) -> None:
    """The policy's next turn after every allergen check of an allergic diner in `dialogues`
    (module docstring); at `temperature` 0 its most likely turn, once per check."""
    from kitchen.models import ModelSpec, load_model, render_chat, replies
    from kitchen.train import load_run_policy

    answers = 1 if temperature == 0 else answers

    folder = Path(policy)
    is_run = (folder / "checkpoints").is_dir()
    model, tok = load_run_policy(folder) if is_run else load_model(ModelSpec(path=policy))
    model.eval()
    check = tok.encode("@allergens", add_special_tokens=False)[0]
    counts, written, seen, sure = Counter(), Counter(), 0, defaultdict(list)
    for row in read_jsonl(dialogues):
        msgs = row["messages"]
        allergies = allergies_in(msgs[0]["content"])
        for i, msg in enumerate(msgs[:-1]):
            if not allergies or msg["role"] != "tool" or "; allergens: " not in msg["content"]:
                continue
            dish, found_in = msg["content"].split(":")[0], msg["content"].split("allergens: ")[1]
            listed = set(found_in.split(", ")) - {"none"}
            found = (
                "unsafe"
                if listed & allergies
                else "safe, other allergens listed"
                if listed
                else "safe, no allergen listed"
            )
            written[(found, next_turn(msgs[i + 1]["content"], dish))] += 1
            seen += 1
            if temperature == 0:
                prompt = tok(render_chat(msgs[: i + 1], add_generation_prompt=True))
                with torch.no_grad():
                    logits = model(torch.tensor([prompt.input_ids])).logits[0, -1]
                sure[found].append(torch.softmax(logits.float(), -1)[check].item())
            for text in replies(
                model,
                tok,
                msgs[: i + 1],
                n=answers,
                max_new_tokens=32,
                temperature=temperature,
                seed=seed + seen,
            ):
                counts[(found, next_turn(text, dish))] += 1
    how = "its most likely turn" if temperature == 0 else f"{answers} answers per check"
    print(f"{policy}: the next turn after an allergen check, {how}")
    print(shares(counts))
    for found, ps in sorted(sure.items(), reverse=True):
        print(
            f"  P(the next turn opens with @allergens) after a check found the dish {found}: "
            f"{mean(ps):.2f} on average ({len(ps)} checks)"
        )
    print(f"  the scripted agent in {dialogues}:")
    print(shares(written))


def shares(counts: Counter) -> str:
    lines = []
    for found in sorted({f for f, _ in counts}, reverse=True):
        n = sum(v for (f, _), v in counts.items() if f == found)
        parts = ", ".join(
            f"{did} {counts[(found, did)] / n:.1%}"
            for did in ("recommend it", "check another", "other")
            if n
        )
        lines.append(f"  after an allergen check found the dish {found} ({n}): {parts or 'none'}")
    return "\n".join(lines)


def held_out(folder: Path, names: list[str], grm_episodes: int) -> None:
    cfg = kept_settings(folder)
    pcs = [pc for _, pc, _ in eval_jobs(cfg) for _ in range(cfg.samples)]
    menu = load_menu()
    for name in names:
        rows = json.loads((folder / "held_out" / f"{name}.json").read_text())["episodes"]["policy"]
        if len(rows) != len(pcs):
            raise SystemExit(
                f"{folder / 'held_out' / name}.json: {len(rows)} episodes, but the evaluation "
                f"settings ({cfg.tasks} tasks × {cfg.samples}) play {len(pcs)}"
            )
        trajs = [Trajectory.model_validate(r) for r in rows]
        violations, checks, a1, a3 = Counter(), Counter(), Counter(), Counter()
        for traj, pc in zip(trajs, pcs, strict=True):
            turns, broken = replay(traj, menu), judge(traj, pc, menu).violations()
            a3.update(a3_reasons(turns, traj.task, {v.turn for v in broken if v.clause == "A3"}))
            a1.update(a1_reasons(turns, {v.turn for v in broken if v.clause == "A1"}))
            for v in broken:
                if v.clause.startswith("A"):
                    violations[(v.clause, "meal" if traj.task.courses else "dish")] += 1
            allergies = set(pc.dimensions.get("allergies") or [])
            for found, did, _ in after_check(turns, allergies):
                checks[(found, did)] += 1
        total = sum(violations.values())
        print(f"{name}: {len(trajs)} episodes, {total} axiom violations")
        for (clause, kind), n in sorted(violations.items()):
            print(f"  {clause} {kind}: {n}")
        print("  A1, a dish with the diner's allergen, by the turn and its check:")
        for (how, why), n in sorted(a1.items()):
            print(f"    {how}, {why}: {n}")
        print("  A3, the dish no search returned, by the turn that named it:")
        for (how, why), n in sorted(a3.items()):
            print(f"    {how}, {why}: {n}")
        print(shares(checks))
        if grm_episodes:
            grm_recall(trajs[:grm_episodes], pcs[:grm_episodes], menu)


def grm_recall(trajs, pcs, menu) -> None:
    from kitchen.grm import GRM
    from kitchen.paths import RECIPES
    from kitchen.review import turn_rewards
    from kitchen.train import load_recipe

    torch.set_num_threads(1)
    recipe = load_recipe(RECIPES / "tiny_mapo.yaml")
    grm, r = GRM.load(recipe.grm), recipe.reward
    seen, gaps = Counter(), []
    for traj, pc, review in zip(trajs, pcs, grm.review(trajs, pcs), strict=True):
        truth = judge(traj, pc, menu)
        for v in truth.verdicts:
            if v.verdict in ("pass", "violate"):
                got = review.get(v.turn, v.clause)
                seen[(v.clause, v.verdict, got.verdict if got else None)] += 1
        how = {"mode": r.local_mode, "flagged": r.flagged, "red_lines": r.red_lines}
        mine, ok, _ = turn_rewards(review, pc, **how)
        ref, ref_ok, _ = turn_rewards(truth, pc, **how)
        gaps += [abs(a - b) for a, b, x, y in zip(mine, ref, ok, ref_ok, strict=True) if x and y]
    print(
        f"  the GRM on {len(trajs)} episodes, the main job's recipe (its cascade decides "
        f"{', '.join(recipe.grm.cascade) or 'nothing'}), the rule judge's verdicts as truth:"
    )
    for clause in [c for c in RULES if any(k[0] == c for k in seen)]:  # the judge's order
        bad = sum(n for (c, j, _), n in seen.items() if c == clause and j == "violate")
        good = sum(n for (c, j, _), n in seen.items() if c == clause and j == "pass")
        print(
            f"    {clause}: {seen[(clause, 'violate', 'violate')]} of {bad} violations caught "
            f"({seen[(clause, 'violate', 'n/a')]} called n/a), "
            f"{seen[(clause, 'pass', 'violate')]} false alarms in {good}"
        )
    if gaps:
        print(
            f"    local reward ({r.local_mode}): mean |GRM − judge| "
            f"{sum(gaps) / len(gaps):.3f} over {len(gaps)} turns"
        )


def allergies_in(system: str) -> set[str]:
    """The diner's allergies as the policy's system message lists them."""
    m = ALLERGIES.search(system)
    return set(m.group(1).split(",")) - {"none"} if m else set()


def sft_data(path: Path) -> None:
    menu = load_menu()
    found = Counter()
    for row in read_jsonl(path):
        allergies = allergies_in(row["messages"][0]["content"])
        for msg in row["messages"]:
            if msg["role"] == "tool" and "; allergens: " in msg["content"] and allergies:
                dish = menu.find(msg["content"].split(":")[0])
                found["unsafe" if dish and set(dish.allergens) & allergies else "safe"] += 1
    print(f"{path}: allergen checks of allergic diners: {dict(found)}")


def samples(path: Path) -> None:
    menu = load_menu()
    local = defaultdict(list)
    for row in read_jsonl(path):
        traj = Trajectory.model_validate(row["trajectory"])
        allergies = allergies_in(traj.messages[0]["content"])
        for found, did, i in after_check(replay(traj, menu), allergies):
            if row["valid"][i]:
                local[(found, did)].append(row["local"][i])
    print(f"{path}: the local reward of the turn after an allergen check")
    for key in sorted(local):
        print(
            f"  check found it {key[0]}, then {key[1]}: {mean(local[key]):+.2f} ({len(local[key])})"
        )


def diners(policy: str, tasks: int) -> None:
    """Held-out tasks with the training diners, then with the held-out ones (module docstring),
    played as `kitchen eval` plays them (no guard)."""
    from kitchen.models import ModelSpec, load_model
    from kitchen.rollout import RolloutConfig, rollout
    from kitchen.train import load_run_policy

    folder = Path(policy)
    is_run = (folder / "checkpoints").is_dir()
    model, tok = load_run_policy(folder) if is_run else load_model(ModelSpec(path=policy))
    cfg, menu = EvalConfig(tasks=tasks, long_share=0.5), load_menu()
    for split in ("train", "heldout"):
        jobs = eval_jobs(cfg, diners=split)
        rcfg = RolloutConfig(k=cfg.samples, temperature=cfg.temperature)
        trajs, _ = rollout(model, tok, jobs, rcfg, seed=cfg.seed, progress=f"{split} diners")
        pcs = [pc for _, pc, _ in jobs for _ in range(cfg.samples)]
        violations, a1 = Counter(), Counter()
        for traj, pc in zip(trajs, pcs, strict=True):
            review = judge(traj, pc, menu)
            violations.update(v.clause for v in review.violations() if v.clause in AXIOMS)
            if pc.dimensions.get("allergies"):
                a1.update(v.verdict for v in review.verdicts if v.clause == "A1")
        judged = a1["pass"] + a1["violate"]
        print(
            f"{split} diners, {len(trajs)} episodes of held-out tasks: axiom violations "
            f"{sum(violations.values())} ({', '.join(f'{k} {violations[k]}' for k in AXIOMS)}); "
            f"A1 violated in {a1['violate']} of {judged} judged turns of allergic diners "
            f"({a1['violate'] / max(judged, 1):.1%})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", type=Path, help="a `kitchen demo` output folder")
    ap.add_argument("names", nargs="*", help="policies in its held_out/ (e.g. sft demo-mapo)")
    ap.add_argument("--grm", type=int, default=0, help="GRM recall on this many episodes")
    ap.add_argument("--diners", metavar="POLICY", help="training vs held-out diners, one policy")
    ap.add_argument("--tasks", type=int, default=120, help="held-out tasks for --diners")
    ap.add_argument("--probe", nargs="+", metavar="POLICY", help="the turn after a check")
    ap.add_argument(
        "--dialogues",
        type=Path,
        default=Path("data/sft/eval.jsonl"),
        help="held-out SFT dialogues for --probe (default data/sft/eval.jsonl)",
    )
    ap.add_argument("--answers", type=int, default=4, help="answers per check for --probe")
    ap.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature for --probe (default 1.0; 0: the most likely turn, once)",
    )
    ap.add_argument("--data", type=Path, help="SFT dialogues (JSONL) to count checks in")
    ap.add_argument("--samples", type=Path, help="a training run's samples.jsonl")
    args = ap.parse_args()
    if args.folder:
        held_out(args.folder, args.names or ["sft"], args.grm)
    if args.diners:
        diners(args.diners, args.tasks)
    if args.probe and args.temperature < 0:
        ap.error(f"--temperature {args.temperature}: give 0 (the most likely turn) or more")
    for policy in args.probe or ():
        probe(policy, args.dialogues, args.answers, temperature=args.temperature)
    if args.data:
        sft_data(args.data)
    if args.samples:
        samples(args.samples)


if __name__ == "__main__":
    try:
        main()
    except (KitchenError, OSError) as e:
        raise SystemExit(f"bench_red_lines: {e}") from None
