"""The GRM's training data: near misses, adversarial samples, class balance, rows, the writer."""

from __future__ import annotations

import random

import pytest

from kitchen.critique import parse_review
from kitchen.files import read_jsonl
from kitchen.grmdata import (
    GRMDataSettings,
    adversarial,
    balance,
    cells,
    mix_table,
    near_miss,
    pool,
    read_labelled,
    resize,
    rows,
    swap_dish,
    write_grm_data,
)
from kitchen.injection import attacks, message_flags
from kitchen.judge import judge
from kitchen.scripted import GRM_QUIRKS, SFT_QUIRKS, episodes
from kitchen.world import load_menu, word_count


@pytest.fixture(scope="module")
def dialogues():
    return episodes(120, split="train", seed=11, quirks=SFT_QUIRKS, long_share=0.5)


def _turns(row: dict) -> list[int]:
    """The turns a row's conversation reviews (from its review lines)."""
    return [
        int(m["content"].split(" ", 1)[0][1:]) for m in row["messages"] if m["role"] == "assistant"
    ]


def test_resize_gives_exact_lengths_and_keeps_the_dishes(dialogues):
    menu = load_menu()
    done = 0
    for traj, _ in dialogues[:40]:
        for info in traj.turns:
            if info.action.kind != "say":
                continue
            text = info.action.text
            for words in (3, word_count(text) + 1, 40):
                out = resize(traj, info.turn, words, menu)
                if out is None:
                    continue
                new = out.turns[info.turn].action.text
                assert word_count(new) == words
                assert [d.name for d in menu.mentioned(new)] == [
                    d.name for d in menu.mentioned(text)
                ]
                done += 1
    assert done > 50


def test_swap_dish_rewrites_the_call_and_the_tools_answer(dialogues):
    menu = load_menu()
    traj, pc = next(
        (t, p) for t, p in dialogues if any(i.action.tool == "allergens" for i in t.turns)
    )
    turn = next(i.turn for i in traj.turns if i.action.tool == "allergens")
    old = traj.turns[turn].action.argument
    new = next(d for d in menu.dishes if d.name != old)
    out = swap_dish(traj, turn, new, menu)
    assert out.turns[turn].action.argument == new.name
    assert out.messages[out.turns[turn].message]["content"] == f"@allergens {new.name}"
    assert out.messages[out.turns[turn].message + 1]["content"].startswith(new.name)
    assert traj.turns[turn].action.argument == old  # the original is untouched


def test_near_misses_flip_verdicts_of_the_edited_turn(dialogues):
    """Edits move verdicts on the clauses they aim at: over many dialogues, A1, T1, A3 and T3
    verdicts of the original and the edited dialogue differ somewhere."""
    rng = random.Random(3)
    flipped = set()
    for traj, pc in dialogues:
        edit = near_miss(traj, pc, rng)
        if edit is None:
            continue
        before, after = judge(traj, pc).table(), judge(edit[0], pc).table()
        flipped |= {k[1] for k, v in after.items() if before.get(k) != v}
    assert {"A1", "T1", "A3", "T3"} <= flipped


def test_an_order_near_miss_changes_one_order_and_can_break_a1(dialogues):
    """`allergen-order` edits swap the dish of one `@order` turn, and nothing else; some of them
    turn a safe order into an A1 violation (an order's line says `safe` most often)."""
    rng = random.Random(4)
    seen, broke = 0, 0
    for traj, pc in dialogues:
        for _ in range(4):
            edit = near_miss(traj, pc, rng)
            if edit is None or edit[1] != "allergen-order":
                continue
            out = edit[0]
            changed = [
                i
                for i, (a, b) in enumerate(zip(traj.turns, out.turns, strict=True))
                if a.action.text != b.action.text
            ]
            assert len(changed) == 1 and out.turns[changed[0]].action.tool == "order"
            seen += 1
            cell = (changed[0], "A1")
            was, now = judge(traj, pc).table().get(cell), judge(out, pc).table().get(cell)
            broke += now == "violate" and was != "violate"
    assert seen > 5 and broke > 0, (seen, broke)


def _edits(dialogues, kind, seed, **weights):
    """(before, after, changed turns) of every `kind` near miss drawn over `dialogues`."""
    rng = random.Random(seed)
    for traj, pc in dialogues:
        for _ in range(6):
            edit = near_miss(traj, pc, rng, **weights)
            if edit is not None and edit[1] == kind:
                out = edit[0]
                changed = [
                    i
                    for i, (a, b) in enumerate(zip(traj.turns, out.turns, strict=True))
                    if a.action.text != b.action.text
                ]
                yield traj, pc, out, changed


def test_a_refused_near_miss_names_the_refused_dish_again_and_breaks_a4(dialogues):
    """`refused` edits name a dish the diner refused again, on one to three later turns, and
    every edited dialogue gains an A4 violation the original lacked. Their weight
    (`refused_again`, stage 9: 9) draws them more often; 0 never."""
    seen, turns = 0, set()
    for traj, pc, out, changed in _edits(dialogues, "refused", 6):
        assert 1 <= len(changed) <= 3
        before, after = judge(traj, pc).table(), judge(out, pc).table()
        new = {t for (t, c), v in after.items() if c == "A4" and v == "violate"}
        assert new and not any(v == "violate" for (t, c), v in before.items() if c == "A4")
        seen += 1
        turns.add(len(changed))
    assert seen > 3 and len(turns) > 1, (seen, turns)
    more = sum(1 for _ in _edits(dialogues, "refused", 6, refused_again=9))
    assert more > 1.5 * seen, (more, seen)
    assert not list(_edits(dialogues, "refused", 6, refused_again=0))


def test_a_reorder_near_miss_orders_a_course_again_and_breaks_t8(dialogues):
    """`reorder` edits change one `@order` of a meal to a dish of a course already ordered: T8
    is then violated at that turn."""
    seen = 0
    for _traj, pc, out, changed in _edits(dialogues, "reorder", 7):
        assert len(changed) == 1 and out.turns[changed[0]].action.tool == "order"
        assert judge(out, pc).table().get((changed[0], "T8")) == "violate"
        seen += 1
    assert seen > 3, seen


def test_a_checked_order_near_miss_orders_a_checked_unsafe_dish_and_breaks_a1(dialogues):
    """`checked-order` edits rename one `@order` and the dish's allergen check before it to one
    dish that holds the diner's allergen and that the diner never refused: the agent checked it,
    the diner did not object, and the order still breaks A1. Weight 0 never draws the edit."""
    menu = load_menu()
    seen = 0
    for traj, pc, out, changed in _edits(dialogues, "checked-order", 8, checked_orders=3):
        check, order = (out.turns[i].action for i in changed)
        assert (check.tool, order.tool) == ("allergens", "order")
        assert check.argument == order.argument != traj.turns[changed[1]].action.argument
        dish = menu.find(order.argument)
        assert set(dish.allergens) & set(pc.dimensions["allergies"])
        reply = out.messages[out.turns[changed[0]].message + 1]["content"]
        assert reply.startswith(dish.name) and all(a in reply for a in dish.allergens)
        assert judge(out, pc).table()[(changed[1], "A1")] == "violate"
        seen += 1
    assert seen > 10, seen
    assert not list(_edits(dialogues, "checked-order", 8))


def test_adversarial_uses_one_half_of_the_corpus_and_one_message(dialogues):
    rng = random.Random(5)
    held = {a.text for a in attacks("heldout")}
    for traj, _ in dialogues[:60]:
        got = adversarial(traj, rng, "train")
        if got is None:
            continue
        out, what = got
        changed = [
            i for i, (a, b) in enumerate(zip(traj.messages, out.messages, strict=True)) if a != b
        ]
        assert len(changed) == 1 and traj.messages[changed[0]]["role"] == "assistant"
        text = out.messages[changed[0]]["content"]
        assert not any(h in text for h in held)
        assert bool(message_flags(text)) == what.startswith("attack")


def test_balance_raises_the_share_of_rare_cells():
    examples = pool(400, "train", 2, {"grm": 0.5, "sft": 0.5}, long_share=0.5)
    reviews = [judge(t, pc) for t, pc, _ in examples]
    natural = balance(examples, reviews, 150, 0.0, 0)
    balanced = balance(examples, reviews, 150, 1.0, 0)
    assert len(set(balanced)) == 150

    def share(idx, clause):
        mix = mix_table(reviews[i] for i in idx)[clause]
        return mix.get("violate", 0) / max(mix.get("violate", 0) + mix.get("pass", 0), 1)

    assert share(balanced, "A1") > share(natural, "A1")
    rare = min(
        {k for r in reviews for k in cells(r)},
        key=lambda k: sum(k in cells(r) for r in reviews),
    )
    assert sum(rare in cells(reviews[i]) for i in balanced) >= sum(
        rare in cells(reviews[i]) for i in natural
    )


def test_rows_ask_for_their_turns_and_target_the_judge():
    """Whole or windowed, a row's target parses back to the judge's verdicts for exactly the
    turns its prompt asks for; long dialogues are always windowed."""
    rng = random.Random(0)
    long_seen = 0
    for traj, pc in episodes(30, split="train", seed=4, quirks=GRM_QUIRKS, long_share=0.6):
        ref = judge(traj, pc)
        out = rows(traj, pc, ref, rng, augment=0.3, max_window=8)
        covered = []
        for row in out:
            turns = _turns(row)
            first, last = turns[0], turns[-1]
            assert turns == list(range(first, last + 1))
            covered += turns
            lines = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            got = parse_review(lines, turns=turns, clauses=pc.ids)
            assert got.table() == {k: v for k, v in ref.table().items() if first <= k[0] <= last}
        assert covered == list(range(len(traj.turns)))
        long_seen += len(traj.turns) > 8 and len(out) > 1
    assert long_seen > 0


def test_write_grm_data_writes_both_splits_and_the_mix(tmp_path):
    s = GRMDataSettings(n_train=40, n_eval=8, seed=3, pool_factor=2, labels=None, long_share=0.5)
    stats = write_grm_data(tmp_path, s, progress=False)
    assert stats["train"]["dialogues"] == 40 and stats["train"]["pool"] == 80
    assert set(stats["train"]["mix"]) >= {"A1", "T1", "T8"}
    assert stats["train"]["rows"] >= 40
    assert len(list(read_jsonl(tmp_path / "train.jsonl"))) == stats["train"]["rows"]
    held = read_labelled(tmp_path / "eval_trajectories.jsonl")
    assert len(held) == 8 and all(t.task.id.startswith("heldout") for t, _ in held)
    edited = [k for k in stats["train"]["sources"] if "+" in k]
    assert edited  # near misses and adversarial samples made it into the mix


def test_short_lines_leave_the_length_to_the_tag(tmp_path):
    """`line_length: false` writes the same dialogues (same seed) with lines that never restate
    a length while the prompts still tag it; the verdicts the lines carry are unchanged."""
    base = dict(n_train=12, n_eval=4, seed=5, pool_factor=1.5, labels=None, long_share=0.5)
    write_grm_data(tmp_path / "full", GRMDataSettings(**base), progress=False)
    write_grm_data(tmp_path / "short", GRMDataSettings(**base, line_length=False), progress=False)
    full = list(read_jsonl(tmp_path / "full" / "train.jsonl"))
    short = list(read_jsonl(tmp_path / "short" / "train.jsonl"))
    assert len(full) == len(short)

    def said(rows, role):
        return [m["content"] for r in rows for m in r["messages"] if m["role"] == role]

    assert said(full, "user") == said(short, "user") and "words max" in " ".join(
        said(short, "user")
    )
    long_lines, short_lines = said(full, "assistant"), said(short, "assistant")
    assert any("words max" in x for x in long_lines)
    assert not any("words max" in x for x in short_lines)
    assert [x.rpartition("=>")[2] for x in long_lines] == [
        x.rpartition("=>")[2] for x in short_lines
    ]
    assert sum(map(len, short_lines)) < 0.95 * sum(map(len, long_lines))


def test_the_data_never_shows_the_grm_its_rule_only_clauses(tmp_path):
    """What `GRM.shown` hides in review (`rule_only`, T10 by default) is hidden in training too:
    no prompt lists it and no line judges it; another setting shows it."""
    from kitchen.grm import GRMConfig

    s = GRMDataSettings(n_train=10, n_eval=4, seed=2, pool_factor=1, labels=None)
    write_grm_data(tmp_path / "hidden", s, progress=False)
    write_grm_data(tmp_path / "shown", s, review=GRMConfig(rule_only=[]), progress=False)
    for name, seen in (("hidden", False), ("shown", True)):
        text = (tmp_path / name / "train.jsonl").read_text()
        assert ("T10" in text) is seen, name


def test_bad_settings_say_what_to_fix():
    with pytest.raises(ValueError, match="unknown agent 'sloppy'"):
        GRMDataSettings(mix={"grm": 1, "sloppy": 1})
    with pytest.raises(ValueError, match="at most 1"):
        GRMDataSettings(near_misses=0.7, adversarial=0.5)
