"""Scripted agents: generic SFT dialogues, and GRM data that breaks every clause."""

from __future__ import annotations

import collections
import json

import pytest

from kitchen import paths
from kitchen.cli import main as cli
from kitchen.config import KitchenError
from kitchen.files import read_jsonl
from kitchen.judge import judge
from kitchen.scripted import (
    GRM_QUIRKS,
    IDEAL_QUIRKS,
    SFT_QUIRKS,
    SHIPPED_SFT_QUIRKS,
    chat_row,
    check_drills,
    episodes,
    renamed_row,
    write_sft_data,
)


def violation_counts(eps):
    counts = collections.Counter()
    for traj, pc in eps:
        for v in judge(traj, pc).violations():
            counts[v.clause] += 1
    return counts


def test_sft_agent_is_competent_but_generic():
    """Mostly successful, yet it breaks the personal theorems; it never breaks the red lines."""
    eps = episodes(200, seed=1, quirks=SFT_QUIRKS)
    success = sum(t.outcome.success for t, _ in eps) / len(eps)
    assert success > 0.8
    counts = violation_counts(eps)
    assert {"T1", "T3", "T4", "T5", "T6"} <= set(counts)
    assert counts["A2"] == counts["A3"] == counts["A4"] == 0


def test_grm_agent_breaks_every_clause():
    counts = violation_counts(episodes(300, seed=2, quirks=GRM_QUIRKS))
    assert set(counts) >= {"A1", "A2", "A3", "A4", "T1", "T2", "T3", "T4", "T5", "T6", "T7"}, counts


def test_ideal_agent_succeeds():
    eps = episodes(100, seed=3, quirks=IDEAL_QUIRKS)
    assert sum(t.outcome.success for t, _ in eps) / len(eps) > 0.9


def test_episodes_are_deterministic_and_split():
    a = [t.messages for t, _ in episodes(20, seed=4)]
    assert a == [t.messages for t, _ in episodes(20, seed=4)]
    held = episodes(20, split="heldout", seed=4)
    assert all(t.task.id.startswith("heldout") for t, _ in held)


def test_write_sft_data(tmp_path):
    stats = write_sft_data(str(tmp_path), n_train=30, n_eval=10, seed=5)
    rows = list(read_jsonl(tmp_path / "train.jsonl"))
    assert len(rows) == 30 == stats["train"]["dialogues"]
    roles = {m["role"] for r in rows for m in r["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert all(set(m) == {"role", "content"} for r in rows for m in r["messages"])
    assert len(list(read_jsonl(tmp_path / "eval.jsonl"))) == 10
    # called with its defaults it writes the shipped data's kind, as the CLI does
    shipped = json.loads((paths.DATA / "sft" / "stats.json").read_text())["command"]
    flags = " --unsafe-checks 1 --variants 0.5"
    assert stats["command"].endswith(flags) and shipped.endswith(flags)


def test_sft_data_with_check_drills_and_no_skipped_checks(tmp_path, capsys):
    """`--drills N` appends N allergic diners' dialogues, each ending on the turn right after an
    allergen check (the decision its reply informs); `--skip-checks 0` writes agents that check
    every dish they recommend (T1 always kept), and both are on the data's command line."""
    out = tmp_path / "sft"
    assert cli(["world", "sft-data", "--out", str(out), "--train", "40", "--eval", "5",
                "--seed", "2", "--skip-checks", "0", "--drills", "25"]) == 0  # fmt: skip
    assert "+ 25 check drills" in capsys.readouterr().out
    stats = json.loads((out / "stats.json").read_text())
    assert stats["train"]["clause_pass"]["T1"] == 1.0 and stats["drills"] == {"dialogues": 25}
    assert stats["command"].endswith("--skip-checks 0 --drills 25")
    rows = [r["messages"] for r in read_jsonl(out / "train.jsonl")]
    assert len(rows) == 65
    whole = {json.dumps(m[:3]) for m in rows[:40]}
    for m in rows[40:]:
        assert "allergies=none" not in m[0]["content"]
        assert m[-1]["role"] == "assistant" and m[-2]["role"] == "tool"
        assert m[-3]["role"] == "assistant" and m[-3]["content"].startswith("@allergens ")
    assert len({json.dumps(m[:3]) for m in rows[40:]} - whole) > 20  # not the dialogues' prefixes
    # the default data skips some checks: without the option T1 is broken
    plain = write_sft_data(str(tmp_path / "plain"), n_train=40, n_eval=5, seed=2)
    assert plain["train"]["clause_pass"]["T1"] < 1.0 and "drills" not in plain
    # agents that never check leave nothing to cut: a clear error, not an endless search; a
    # single drill is found whatever the seed (a small round can hold none by chance)
    never = SHIPPED_SFT_QUIRKS.model_copy(update={"skip_allergen_check": 1.0})
    with pytest.raises(KitchenError, match="no check drills in 1000 scripted episodes"):
        check_drills(3, quirks=never)
    assert all(len(check_drills(1, seed=s)) == 1 for s in range(6))


def test_renamed_dialogues_name_no_real_dish_and_rename_each_the_same_way_throughout():
    """`renamed_row` gives every dish a dialogue names a new name of the menu's own words, the
    same in the search result, the check, the recommendation, the diner's answer and the order;
    nothing else changes. `--rename 1` renames every training dialogue and leaves the held-out
    ones as played, and the command line records it."""
    import random
    import re

    from kitchen.world import load_menu

    menu = load_menu()
    traj, _ = next((t, pc) for t, pc in episodes(20, seed=6, long_share=1.0) if t.outcome.success)
    row = chat_row(traj)
    new = renamed_row(row, random.Random(0))
    named = dishes_named(row)
    assert len(named) >= 4
    text = " | ".join(m["content"] for m in new["messages"])
    assert not menu.mentioned(text)
    words = {w for d in menu.dishes for w in d.name.split()}
    # message by message, a real name maps to one invented name made of menu words
    seen: dict[str, str] = {}
    for old, m in zip(row["messages"], new["messages"], strict=True):
        assert m["role"] == old["role"]
        parts = menu._pattern.split(old["content"])
        pattern = "".join(re.escape(p) if i % 2 == 0 else "(.+?)" for i, p in enumerate(parts))
        got = re.fullmatch(pattern, m["content"])
        assert got is not None, (old["content"], m["content"])
        for real, fake in zip(parts[1::2], got.groups(), strict=True):
            assert seen.setdefault(real.lower(), fake) == fake
            assert set(fake.split()) <= words and 2 <= len(fake.split()) <= 3
    assert len(set(seen.values())) == len(seen) == len(named)
    # the order the world confirmed names the dish the diner agreed to, under its new name
    order = next(m["content"] for m in new["messages"] if m["content"].startswith("@order "))
    assert order.removeprefix("@order ") in set(seen.values())
    assert renamed_row(row, random.Random(0)) == new != renamed_row(row, random.Random(1))
    # a message without content (a tool call's) passes through
    empty = {"messages": [*row["messages"], {"role": "assistant", "content": None}]}
    assert renamed_row(empty, random.Random(0))["messages"][-1] == {
        "role": "assistant",
        "content": None,
    }


def test_sft_data_with_renamed_dishes(tmp_path):
    assert cli(["world", "sft-data", "--out", str(tmp_path / "r"), "--train", "20", "--eval", "6",
                "--seed", "3", "--rename", "1"]) == 0  # fmt: skip
    stats = json.loads((tmp_path / "r" / "stats.json").read_text())
    plain = write_sft_data(str(tmp_path / "p"), n_train=20, n_eval=6, seed=3)
    assert stats["command"].endswith(" --rename 1")
    assert stats["renamed"] == {"share": 1.0, "dialogues": 20}
    assert stats["train"] == plain["train"]  # the dialogues as played
    assert not any(dishes_named(r) for r in read_jsonl(tmp_path / "r" / "train.jsonl"))
    assert [dishes_named(r) for r in read_jsonl(tmp_path / "r" / "eval.jsonl")] == [
        dishes_named(r) for r in read_jsonl(tmp_path / "p" / "eval.jsonl")
    ]
    assert any(dishes_named(r) for r in read_jsonl(tmp_path / "p" / "train.jsonl"))
    # a share renames that many dialogues, each whole, and leaves the others as played
    half = write_sft_data(str(tmp_path / "h"), n_train=20, n_eval=6, seed=3, rename=0.5)
    kept = [bool(dishes_named(r)) for r in read_jsonl(tmp_path / "h" / "train.jsonl")]
    assert 0 < half["renamed"]["dialogues"] < 20
    assert kept.count(False) == half["renamed"]["dialogues"]


def dishes_named(row):
    """The menu dishes a chat row names, in order of first mention."""
    from kitchen.world import load_menu

    return [
        d.name for d in load_menu().mentioned(" | ".join(m["content"] for m in row["messages"]))
    ]


# --------------------------------------------------------------------------------------------
# Meals (long tasks) and learnable personalisation


def test_ideal_meals_take_12_to_20_turns_and_succeed():
    """200 seeded meals of the ideal agent: nearly all succeed, typical length 12–20 assistant
    turns (three or four courses of search, check, recommendation and order), within the
    24-turn budget."""
    eps = episodes(200, seed=21, quirks=IDEAL_QUIRKS, long_share=1.0)
    assert all(t.task.kind == "long" for t, _ in eps)
    assert sum(t.outcome.success for t, _ in eps) / len(eps) > 0.95
    turns = sorted(len(t.turns) for t, _ in eps)
    assert 12 <= turns[len(turns) // 2] <= 20
    assert sum(12 <= n <= 20 for n in turns) / len(turns) >= 0.85, turns
    assert turns[-1] <= 24
    assert violation_counts(eps) == collections.Counter()


def test_sft_agent_plays_meals_competently_with_late_mistakes():
    """Mostly successful on meals; its mistakes (T1, T9 …) fall on every course, not only the
    first; never an axiom other than A1, never an order beyond the request (T8)."""
    eps = episodes(200, seed=22, quirks=SFT_QUIRKS, long_share=1.0)
    assert sum(t.outcome.success for t, _ in eps) / len(eps) > 0.85
    counts = violation_counts(eps)
    assert {"T1", "T2", "T3", "T4", "T5", "T6", "T9"} <= set(counts), counts
    assert counts["A2"] == counts["A3"] == counts["A4"] == counts["T8"] == 0
    late = {v.clause for t, pc in eps for v in judge(t, pc).violations() if v.turn >= 10}
    assert {"T1", "T3"} <= late, late


def test_grm_agent_breaks_every_clause_on_meals_late_too():
    eps = episodes(300, seed=23, quirks=GRM_QUIRKS, long_share=1.0)
    counts = violation_counts(eps)
    assert set(counts) >= {f"A{i}" for i in range(1, 5)} | {f"T{i}" for i in range(1, 10)}, counts
    late = {v.clause for t, pc in eps for v in judge(t, pc).violations() if v.turn >= 10}
    assert {"A1", "A3", "T1", "T2", "T8", "T9"} <= late, late


def test_sft_data_personalises_partly():
    """The good agent's style follows the profile most of the time, not always: brief diners
    get shorter messages than detailed ones, hurried diners less small talk than relaxed ones,
    and the personal clauses pass often but not always — room for RL."""
    from kitchen.scripted import data_stats

    s = data_stats(episodes(400, seed=24, quirks=SFT_QUIRKS, long_share=0.5))
    words, personal = s["personalisation"], s["personal"]
    assert words["words/detailed"] - words["words/brief"] > 3
    assert words["small_talk_first/hurried"] < words["small_talk_first/relaxed"]
    for key in ("T3_pass/brief", "T6_pass/detailed", "T4_pass/hurried"):
        assert 0.55 < personal[key] < 0.95, (key, personal[key])
    ideal = data_stats(episodes(200, seed=24, quirks=IDEAL_QUIRKS, long_share=0.5))
    assert all(x == 1.0 for x in ideal["personal"].values()), ideal["personal"]


def test_sft_data_mixes_meals_and_records_per_clause_rates(tmp_path):
    stats = write_sft_data(str(tmp_path), n_train=40, n_eval=10, seed=6, long_share=0.5)
    train = stats["train"]
    assert train["long"]["dialogues"] + train["short"]["dialogues"] == 40
    assert 0.25 <= train["long"]["dialogues"] / 40 <= 0.75
    for kind in ("short", "long"):
        assert set(train[kind]["clause_pass"]) >= {"A1", "T1", "T3"}
        assert "T3_pass/brief" in train[kind]["personal"]
    assert "T9" in train["long"]["clause_pass"] and "T9" not in train["short"]["clause_pass"]
    assert "--long 0.5" in stats["command"]


def test_style_drawn_per_course_varies_within_a_meal_and_only_then():
    """`style_draw: course` draws the agent's attentiveness again at every course: a meal then
    mixes the short and the long recommendation; drawn once per episode it never does, and the
    rates per episode stay those of the generic agent."""
    import re

    from kitchen.scripted import data_stats

    short = re.compile(r"^[A-Z][^:.!?]*: \d+\$")

    def mixed(quirks):
        n = 0
        for traj, _ in episodes(60, seed=5, quirks=quirks, long_share=1.0):
            says = [m["content"] for m in traj.messages if m["role"] == "assistant"]
            forms = {bool(short.match(t)) for t in says if short.match(t) or "recommend" in t}
            n += len(forms) == 2
        return n

    course = SFT_QUIRKS.model_copy(update={"style_draw": "course"})
    assert mixed(SFT_QUIRKS) == 0
    assert mixed(course) >= 10
    by_course = data_stats(episodes(300, seed=24, quirks=course, long_share=0.5))["personal"]
    by_episode = data_stats(episodes(300, seed=24, quirks=SFT_QUIRKS, long_share=0.5))["personal"]
    for key, rate in by_episode.items():
        assert abs(by_course[key] - rate) < 0.08, (key, by_course[key], rate)


def test_unsafe_checks_first_show_more_unsafe_checks_and_break_no_red_line():
    """`unsafe_check_first`: an allergic diner's course opens with a check of a dish holding
    one of the diner's allergens, which the agent then passes over — more unsafe checks in the
    data, no allergen dish recommended; at 0 the data is the default's to the last message."""
    import itertools

    from kitchen.judge import replay

    def checks(eps):
        found = collections.Counter()
        for traj, pc in eps:
            allergies = set(pc.dimensions.get("allergies") or [])
            for t, nxt in itertools.pairwise(replay(traj)):
                if t.tool == "allergens" and t.dish is not None and allergies:
                    unsafe = bool(set(t.dish.allergens) & allergies)
                    found["unsafe" if unsafe else "safe"] += 1
                    if unsafe:
                        found["recommended after unsafe"] += (
                            nxt.kind == "say"
                            and nxt.dish is not None
                            and nxt.dish.name == t.dish.name
                        )
        return found

    rate = SFT_QUIRKS.model_copy(update={"unsafe_check_first": 1.0})
    plain = episodes(120, seed=7, quirks=SFT_QUIRKS, long_share=0.5)
    more = episodes(120, seed=7, quirks=rate, long_share=0.5)
    assert checks(more)["unsafe"] >= 1.8 * checks(plain)["unsafe"] > 0
    assert checks(more)["recommended after unsafe"] == 0
    assert violation_counts(more)["A1"] <= violation_counts(plain)["A1"]
    zero = SFT_QUIRKS.model_copy(update={"unsafe_check_first": 0.0})
    assert [t.messages for t, _ in episodes(30, seed=7, quirks=zero)] == [
        t.messages for t, _ in episodes(30, seed=7, quirks=SFT_QUIRKS)
    ]


def test_sft_data_with_variants_varies_training_allergies_and_keeps_the_held_out_file(tmp_path):
    """`variants`: training dialogues of synthetic diners hold many more allergy lists than the
    eighteen training diners, none a held-out diner's set; the held-out file is unchanged."""
    import re

    from kitchen.jobs import unseen_allergy_sets

    def lists(path):
        rows = read_jsonl(path)
        return {re.search(r"allergies=([\w,]+)", r["messages"][0]["content"])[1] for r in rows}

    write_sft_data(str(tmp_path / "plain"), n_train=150, n_eval=10, seed=3, variants=0.0)
    stats = write_sft_data(str(tmp_path / "var"), n_train=150, n_eval=10, seed=3, variants=0.6)
    assert stats["command"].endswith("--variants 0.6")
    plain, var = lists(tmp_path / "plain" / "train.jsonl"), lists(tmp_path / "var" / "train.jsonl")
    assert len(var) >= len(plain) + 20
    held = {",".join(sorted(s)) for s in unseen_allergy_sets()}
    assert not {",".join(sorted(a.split(","))) for a in var} & held
    same = [(tmp_path / d / "eval.jsonl").read_text() for d in ("plain", "var")]
    assert same[0] == same[1]
