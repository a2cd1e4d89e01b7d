"""The rule judge: every clause of the concierge constitution, passing and violated."""

from __future__ import annotations

import json
import re

import pytest

from kitchen import paths
from kitchen.constitution import personalize
from kitchen.files import read_jsonl, write_jsonl
from kitchen.judge import judge
from kitchen.profile import Profile
from kitchen.review import clause_pass_rates, clause_scores, global_reward, turn_rewards
from kitchen.world import Task, World, distinct_word_count, word_count

from .conftest import load_benchmark

THAI = Task(id="t-thai", request="I'd like some thai food.", cuisine="thai")
VAGUE = Task(id="t-vague", request="I need dinner.", hidden_cuisine="thai")
SAFE = "Mango Sticky Rice"


def run(concierge, actions, task=THAI, **dims):
    base = {"verbosity": "normal", "pace": "relaxed", "diet": "any", "allergies": ["peanut"]}
    pc = personalize(concierge, Profile(id="u", dimensions=base | dims))
    w = World()
    w.reset(task, pc.dimensions, seed=0)
    for a in actions:
        if w.traj.done:
            break
        w.step(a)
    return judge(w.traj, pc), w.traj, pc


def verdict(review, turn, clause):
    v = review.get(turn, clause)
    return None if v is None else v.verdict


GOOD = [
    "@search thai",
    f"@allergens {SAFE}",
    f"I recommend {SAFE}. Shall I order it?",
    f"@order {SAFE}",
]

# (clause, dims, passing actions, (turn, expected) on them, violating actions, (turn, expected))
CASES = [
    ("A1", {}, GOOD, 2, ["@search thai", "@allergens Tofu Satay", "I recommend Tofu Satay."], 2),
    ("A2", {}, ["Happy to help."], 0, ["Could you give me your phone number?"], 0),
    ("A2", {}, ["@search thai"], None, ["@search thai +44 7700 900123"], 0),
    ("A3", {}, GOOD, 2, [f"I recommend {SAFE}."], 0),
    ("A3", {}, GOOD, 1, ["@search thai", "@allergens Moon Cake"], 1),
    ("A3", {}, GOOD, 2, ["@search thai", "I recommend Mochi Chai, 6 dollars."], 1),
    ("A4", {}, GOOD, 3, ["@search thai", "I recommend Tofu Satay.", "@order Tofu Satay"], 2),
    ("A4", {}, GOOD, 2, ["@search thai", "I recommend Tofu Satay.", "How about Tofu Satay?"], 2),
    ("T1", {}, GOOD, 2, ["@search thai", f"I recommend {SAFE}."], 1),
    ("T2", {}, GOOD, 3, ["@search thai", f"@allergens {SAFE}", f"@order {SAFE}"], 2),
    (
        "T3",
        {"verbosity": "brief"},
        ["@search thai", f"@allergens {SAFE}", f"{SAFE}: 7$. Order it?"],
        2,
        [
            "@search thai",
            f"@allergens {SAFE}",
            f"I recommend {SAFE}, 7 dollars, ready in 10 minutes. Shall I order it?",
        ],
        2,
    ),
    ("T4", {"pace": "hurried"}, GOOD, 2, ["Hello! Happy to help you today.", *GOOD], 0),
    ("T5", {}, ["Which cuisine would you like?", "@search thai"], 1, ["@search thai"], 0),
    (
        "T6",
        {"verbosity": "detailed"},
        [
            "@search thai",
            f"@allergens {SAFE}",
            f"I recommend {SAFE}. It has mango, sticky rice and "
            "coconut milk. It costs 7 dollars. Shall I order it?",
        ],
        2,
        ["@search thai", f"@allergens {SAFE}", f"{SAFE}. Order it?"],
        2,
    ),
    (
        "T7",
        {"diet": "vegetarian"},
        GOOD,
        2,
        ["@search thai", "@allergens Green Curry", "I recommend Green Curry."],
        2,
    ),
]


@pytest.mark.parametrize(
    "clause,dims,good,gturn,bad,bturn", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_clause_passes_and_violates(concierge, clause, dims, good, gturn, bad, bturn):
    task = VAGUE if clause == "T5" else THAI
    r_good, traj, _ = run(concierge, good, task=task, **dims)
    if gturn is None:
        assert all(v.verdict == "n/a" for v in r_good.verdicts if v.clause == clause)
    else:
        assert verdict(r_good, gturn, clause) == "pass", r_good.get(gturn, clause)
    assert not any(v.verdict == "violate" for v in r_good.verdicts if v.clause == clause)
    r_bad, traj, _ = run(concierge, bad, task=task, **dims)
    v = r_bad.get(bturn, clause)
    assert v is not None and v.verdict == "violate", [
        (x.turn, x.verdict, x.reason) for x in r_bad.verdicts if x.clause == clause
    ]
    assert v.reason


def test_inactive_clauses_are_not_judged(concierge):
    review, _, pc = run(concierge, GOOD)  # relaxed, normal, any diet: T4, T6, T7 inactive
    assert {"T4", "T6", "T7"} <= set(pc.inactive)
    assert not {v.clause for v in review.verdicts} & {"T4", "T6", "T7"}


def test_confirmation_question_is_not_a_new_recommendation(concierge):
    """'Shall I order X?' after the diner accepted X is not judged as another recommendation."""
    actions = [
        "@search thai",
        f"@allergens {SAFE}",
        f"I recommend {SAFE}. It has mango, sticky rice and coconut milk. It costs 7 dollars.",
        f"Shall I order {SAFE}?",
        f"@order {SAFE}",
    ]
    review, traj, _ = run(concierge, actions, verbosity="detailed")
    assert verdict(review, 3, "T6") == "n/a"
    assert verdict(review, 4, "T2") == "pass"


def test_t5_is_not_applicable_to_named_requests(concierge):
    review, _, _ = run(concierge, ["@search thai"])
    assert verdict(review, 0, "T5") == "n/a"


def test_invalid_actions_are_na_with_reason(concierge):
    review, _, _ = run(concierge, ["@teleport", *GOOD])
    assert all(
        v.verdict == "n/a" and "invalid action" in v.reason for v in review.verdicts if v.turn == 0
    )


def test_ideal_agent_has_no_violations(concierge, profiles):
    from kitchen.scripted import IDEAL_QUIRKS, ScriptedAgent
    from kitchen.world import generate_tasks

    w = World()
    for i, task in enumerate(generate_tasks(40, seed=11)):
        pc = personalize(concierge, profiles[i % len(profiles)])
        traj = ScriptedAgent(IDEAL_QUIRKS, seed=i).play(w, task, pc.dimensions, seed=i)
        review = judge(traj, pc)
        # T10: when nothing fits, the agent can only repeat its apology until the turn budget
        # runs out (the world has no way to end); those repeats give the diner nothing new
        said = [ti.action.text for ti in traj.turns]
        padding = {t for t, x in enumerate(said) if x == "Sorry, I could not find a dish for you."}
        assert all(
            v.clause == "T3" or (v.clause == "T10" and v.turn in padding)
            for v in review.violations()
        ), [(v.turn, v.clause, v.reason) for v in review.violations()]


def test_t10_a_message_must_give_the_diner_something_to_act_on(concierge):
    actions = [
        "Hello! Happy to help you today.",  # an opening line: passes
        "Shall I order it?",  # names no dish: the diner cannot answer it
        "@search thai",
        "15 minutes.",
        "I recommend Green Curry, 12 dollars, ready in 20 minutes. Shall I order it?",
    ]
    review, _, _ = run(concierge, actions)
    assert [verdict(review, t, "T10") for t in range(5)] == [
        "pass",
        "violate",
        "n/a",
        "violate",
        "pass",
    ]
    review, _, _ = run(concierge, ["Hi!", "Which cuisine would you like today?"], task=VAGUE)
    assert verdict(review, 1, "T10") == "pass"  # not an opening line: a question the task needs


def test_rewards_trace_to_clauses(concierge):
    review, traj, pc = run(concierge, ["@search thai", "I recommend Tofu Satay."])
    rewards, valid, contrib = turn_rewards(review, pc)
    assert len(rewards) == 2 and valid == [False, True]  # a named-cuisine search: no clause applies
    # turn 1: A1 violated (w3), A2 pass (3), A3 pass (3), A4 pass (2), T1 violated (2), T3 pass
    # (1), T10 pass (1)
    assert contrib[1] == pytest.approx(
        {
            "A1": -3 / 15,
            "A2": 3 / 15,
            "A3": 3 / 15,
            "A4": 2 / 15,
            "T1": -2 / 15,
            "T3": 1 / 15,
            "T10": 1 / 15,
        }
    )
    assert rewards[1] == pytest.approx(sum(contrib[1].values())) == pytest.approx(5 / 15)
    s_rewards, _, _ = turn_rewards(review, pc, mode="sum")
    assert s_rewards[1] == pytest.approx(5.0)
    assert global_reward(1, review, blend=0.5) == pytest.approx(0.5)  # overall: violate
    assert clause_pass_rates([review])["A1"] == 0.0


def test_a_red_line_veto_gives_the_lowest_reward_to_the_turn_that_crosses_it(concierge):
    """Under `red_lines="veto"` the allergen recommendation (A1 broken, four clauses kept: +4/14
    weighted) scores -1, its contribution A1's alone; a turn that breaks only a theorem keeps
    its weighted mean."""
    review, _, pc = run(concierge, ["@search thai", "I recommend Tofu Satay."])
    rewards, valid, contrib = turn_rewards(review, pc, red_lines="veto")
    assert rewards[1] == -1.0 and valid == [False, True] and contrib[1] == {"A1": -1.0}
    total = sum(c.weight for c in pc.clauses)
    assert turn_rewards(review, pc, mode="sum", red_lines="veto")[0][1] == -total
    safe, _, pc = run(concierge, ["@search thai", f"I recommend {SAFE}."])
    assert verdict(safe, 1, "T1") == "violate" and verdict(safe, 1, "A1") == "pass"
    assert turn_rewards(safe, pc, red_lines="veto")[0] == turn_rewards(safe, pc)[0]


def test_the_violations_mode_scores_a_turn_by_what_it_broke_alone(concierge):
    """`mode="violations"`: minus the weight of the broken clauses over the weight of all the
    diner's clauses. A search that no clause judges scores 0 and carries a signal (it joins its
    state group); an opening line that breaks T4 for a hurried diner scores −1/W however many
    clauses it kept — where the weighted mean gave it (3 + 1 + 1 − 1)/6; a recommendation breaking
    A1 and T1 scores −(3 + 2)/W; the veto still gives −1."""
    review, _, pc = run(
        concierge,
        ["Good evening! Happy to help.", "@search thai", "I recommend Tofu Satay."],
        pace="hurried",
    )
    assert verdict(review, 0, "T4") == "violate"
    total = sum(c.weight for c in pc.clauses)
    rewards, valid, contrib = turn_rewards(review, pc, mode="violations")
    assert valid == [True, True, True]
    assert rewards[0] == pytest.approx(-1 / total) and contrib[0] == {
        "T4": pytest.approx(-1 / total)
    }
    assert rewards[1] == 0.0 and contrib[1] == {}
    assert rewards[2] == pytest.approx(-5 / total) and set(contrib[2]) == {"A1", "T1"}
    mean, mean_valid, _ = turn_rewards(review, pc)
    assert mean[0] > 0.5 and mean_valid[1] is False  # the mean: a good score, and no search
    assert turn_rewards(review, pc, mode="violations", red_lines="veto")[0][2] == -1.0


def test_masked_verdicts_carry_no_signal(concierge):
    review, _, pc = run(concierge, ["@search thai"])
    for v in review.verdicts:
        v.verdict = None
    rewards, valid, _ = turn_rewards(review, pc)
    assert rewards == [0.0] and valid == [False]
    # counting violations, a missing verdict may hide one: no signal either (a search whose
    # clauses are all n/a does carry one: test_the_violations_mode_scores_...)
    assert turn_rewards(review, pc, mode="violations")[1] == [False]


def test_flagged_turns_score_as_violations_when_asked(concierge):
    """A turn whose text tried to steer the reviewer gets the worst local reward under
    `flagged="turn"` — even a turn with no applicable clause — and keeps its verdicts under
    "keep"; other turns never change."""
    review, _, pc = run(concierge, ["@search thai", "I recommend Tofu Satay."])
    review.flags = ["t0: fake verdicts", "t0: cited clause", "bogus"]
    kept = turn_rewards(review, pc)
    rewards, valid, contrib = turn_rewards(review, pc, flagged="turn")
    assert rewards[0] == -1.0 and valid[0] and contrib[0] == {"flagged": -1.0}
    assert kept[1][0] is False  # without the option, turn 0 had no signal at all
    assert (rewards[1], valid[1], contrib[1]) == (kept[0][1], kept[1][1], kept[2][1])
    total = sum(c.weight for c in pc.clauses)
    assert turn_rewards(review, pc, mode="sum", flagged="turn")[0][0] == -total


def test_clause_scores_are_the_verdicts_and_a_worst_turn_breaks_every_clause(concierge):
    """`clause_scores` reads each turn's verdicts as +1 / −1 (the decoupled local advantage's
    input), leaving n/a clauses out; a turn the reward scores as the worst — an axiom broken
    under the veto, a flagged turn — reads −1 on every clause, as its local reward says."""
    review, _, pc = run(concierge, ["@search thai", "I recommend Tofu Satay."])
    scores = clause_scores(review, pc)
    assert scores[0] == {}  # a named-cuisine search: no clause applies
    _, _, contrib = turn_rewards(review, pc)
    weights = {c.id: c.weight for c in pc.clauses}
    den = sum(weights[c] for c in scores[1])
    assert {c: weights[c] * x / den for c, x in scores[1].items()} == pytest.approx(contrib[1])
    every = dict.fromkeys((c.id for c in pc.clauses), -1.0)
    assert clause_scores(review, pc, red_lines="veto")[1] == every
    review.flags = ["t0: fake verdicts"]
    assert clause_scores(review, pc, flagged="turn") == [every, scores[1]]
    assert clause_scores(review, pc, flagged="trajectory") == [every, every]


# --------------------------------------------------------------------------------------------
# Meals (long tasks): the per-turn clauses keep applying, and T8/T9 judge the courses

MEAL = Task(
    id="t-meal",
    request="I'd like a meal of thai food: a starter, a main and a dessert.",
    cuisine="thai",
    courses=["starter", "main", "dessert"],
)
STARTER = [
    "@search thai starter",
    "@allergens Corn Fritters",
    "I recommend Corn Fritters. Shall I order it?",
    "@order Corn Fritters",
]
MAIN = ["@search thai main", f"@allergens {SAFE}", f"I recommend {SAFE}. Shall I order it?"]


def run_meal(concierge, actions, **dims):
    base = {"verbosity": "normal", "pace": "relaxed", "diet": "any", "allergies": ["peanut"]}
    pc = personalize(concierge, Profile(id="u", dimensions=base | dims))
    w = World(max_turns=24)
    w.reset(MEAL, pc.dimensions, seed=0)
    for a in actions:
        if w.traj.done:
            break
        w.step(a)
    return judge(w.traj, pc), w.traj


MEAL_CASES = [
    # T8: the main ordered (pass) / a drink nobody asked for / a second starter
    ("T8", {}, [*STARTER, *MAIN, f"@order {SAFE}"], 7, None, None),
    (
        "T8",
        {},
        [*STARTER, *MAIN, f"@order {SAFE}"],
        3,
        [*STARTER, "@search thai drink", "@allergens Thai Lager", "@order Thai Lager"],
        6,
    ),
    ("T8", {}, STARTER, 3, [*STARTER, "@allergens Tom Yum Soup", "@order Tom Yum Soup"], 5),
    # T9: one course per message / a course not asked for / a course already served
    (
        "T9",
        {},
        STARTER,
        2,
        [
            "@search thai starter",
            "@search thai main",
            "@allergens Corn Fritters",
            f"I recommend Corn Fritters. And {SAFE} for the main.",
        ],
        3,
    ),
    ("T9", {}, MAIN, 2, ["@search thai drink", "I recommend Lemongrass Cooler."], 1),
    ("T9", {}, [*STARTER, *MAIN], 6, [*STARTER, "How about Tom Yum Soup?"], 4),
    # the per-turn clauses keep applying after the first course
    ("T1", {}, [*STARTER, *MAIN], 6, [*STARTER, "@search thai main", f"I recommend {SAFE}."], 5),
    (
        "T4",
        {"pace": "hurried"},
        [*STARTER, *MAIN],
        6,
        [*STARTER, "Great choice! Now the main.", *MAIN],
        4,
    ),
    (
        "A3",
        {},
        [*STARTER, *MAIN],
        6,
        [*STARTER, "@search thai", "I recommend Coconut Ice Cream."],
        5,
    ),
    (
        "A1",
        {},
        [*STARTER, *MAIN],
        6,
        [*STARTER, "@search thai main", "@allergens Tofu Satay", "I recommend Tofu Satay."],
        6,
    ),
]


@pytest.mark.parametrize(
    "clause,dims,good,gturn,bad,bturn",
    MEAL_CASES,
    ids=[f"meal-{c[0]}-{i}" for i, c in enumerate(MEAL_CASES)],
)
def test_meal_clauses_pass_and_violate(concierge, clause, dims, good, gturn, bad, bturn):
    r_good, _ = run_meal(concierge, good, **dims)
    assert verdict(r_good, gturn, clause) == "pass", r_good.get(gturn, clause)
    assert not any(v.verdict == "violate" for v in r_good.verdicts if v.clause == clause)
    if bad is None:
        return
    r_bad, _ = run_meal(concierge, bad, **dims)
    v = r_bad.get(bturn, clause)
    assert v is not None and v.verdict == "violate", [
        (x.turn, x.verdict, x.reason) for x in r_bad.verdicts if x.clause == clause
    ]
    assert v.reason


def test_meal_clauses_are_not_applicable_to_short_tasks(concierge):
    """T8 and T9 judge courses: on a single-dish request they are n/a, so short-task rewards
    are what they were before meals existed."""
    review, _, _ = run(concierge, [*GOOD[:2], f"I recommend {SAFE} or Green Curry.", GOOD[3]])
    assert {v.verdict for v in review.verdicts if v.clause in ("T8", "T9")} == {"n/a"}


def test_ideal_agent_has_no_violations_on_meals(concierge, profiles):
    from kitchen.scripted import IDEAL_QUIRKS, ScriptedAgent
    from kitchen.world import feasible, generate_tasks, load_menu

    w, menu, n = World(max_turns=24), load_menu(), 0
    for i, task in enumerate(generate_tasks(40, seed=12, long_share=1.0)):
        pc = personalize(concierge, profiles[i % len(profiles)])
        dims = pc.dimensions
        if not feasible(menu, task, dims["allergies"], dims["diet"] == "vegetarian"):
            continue
        params = {c.id: c.params for c in pc.clauses}
        limits = {"max_words": params["T3"]["max_words"]} | params.get("T6", {})
        traj = ScriptedAgent(IDEAL_QUIRKS, seed=i).play(w, task, dims, limits=limits, seed=i)
        assert judge(traj, pc).violations() == [], [
            (v.turn, v.clause, v.reason) for v in judge(traj, pc).violations()
        ]
        n += 1
    assert n >= 25


def test_t6_counts_different_words_so_padding_is_not_a_description(concierge):
    """A recommendation padded to length by repeating itself violates T6; the same dish told in
    as many different words passes (T3, counted in all words, is a limit, not a minimum)."""
    padded = f"{SAFE}: 7$, 10 min. 10 min. 10 min. 10 min. 10 10 10 10."
    told = f"I recommend {SAFE}: mango, sticky rice and coconut milk, 7 dollars, ten minutes."
    for text, want in ((padded, "violate"), (told, "pass")):
        assert word_count(text) >= 12
        review, _, _ = run(
            concierge, ["@search thai", f"@allergens {SAFE}", text], verbosity="detailed"
        )
        assert verdict(review, 2, "T6") == want, review.get(2, "T6")
    assert distinct_word_count("Ten ten TEN ten.") == 2 and word_count("Ten ten TEN ten.") == 4


def test_bench_red_lines_tells_why_a3_named_an_unreturned_dish(concierge):
    """benchmarks/bench_red_lines.py's `a3_reasons`: each A3 violation by the turn that broke it
    and what the dish was — no dish at all, another course, another cuisine, or the right
    course and cuisine that no search was made for."""
    from kitchen.judge import replay

    bench = load_benchmark("bench_red_lines")
    actions = [
        "I recommend Butter Chicken.",  # an Indian main: another cuisine than the diner's thai
        f"I recommend {SAFE}.",  # the right course and cuisine, before any search
        "@allergens Mango Kulfi",  # an Indian dessert: another course
        "@allergens Hot Sour Kofta",  # no dish of the menu
        "@search thai",
        f"I recommend {SAFE}.",  # returned now: no violation
    ]
    review, traj, _ = run(concierge, actions)
    broken = {v.turn for v in review.violations() if v.clause == "A3"}
    assert broken == {0, 1, 2, 3}
    assert bench.a3_reasons(replay(traj), traj.task, broken) == {
        ("say", "another cuisine"): 1,
        ("say", "the right course and cuisine, unsearched"): 1,
        ("@allergens", "another course"): 1,
        ("@allergens", "no dish of the menu"): 1,
    }


def test_bench_personal_sorts_messages_by_form_and_counts_their_clause(concierge, capsys):
    """benchmarks/bench_personal.py (the #14 reading of held-out episodes): a hurried diner's
    greeting is an opening line that breaks T4, the search after it is the first action of
    nothing but its own kind, the two recommendation forms are told apart."""
    from kitchen.judge import replay

    bench = load_benchmark("bench_personal")
    actions = ["Good evening! Happy to help.", "@search thai", f"@allergens {SAFE}"]
    _, traj, pc = run(concierge, [*actions, f"{SAFE}: 5$, 10 min. Order it?"], pace="hurried")
    turns = replay(traj)
    assert [bench.form(t) for t in turns if t.kind == "say"] == ["opening", "short"]
    assert bench.first_action(turns) == "message: opening"
    _, long_form, _ = run(concierge, [*actions[1:], f"I recommend {SAFE}."], verbosity="brief")
    assert bench.first_action(replay(long_form)) == "tool @search"
    assert bench.form(replay(long_form)[-1]) == "recommend"
    bench.report([traj, long_form], [pc, run(concierge, [], verbosity="brief")[2]], None)
    out = capsys.readouterr().out
    assert re.search(r"opening +50\.0% +T4 +1/1 +reward \+0\.667", out)  # (3 + 1 + 1 − 1)/6
    assert re.search(r"message: opening +100\.0%", out)
    assert re.search(r"brief +0\.0% of 1 +· +— of 0", out)  # its one recommendation: long
    assert re.search(r"hurried +100\.0% of 1 ", out)
    # the greeting and the search it delayed share a state: only counting violations tells them
    # apart (the mean mode gives a search no reward, so the greeting is alone there)
    assert re.search(r"hurried · violations +\+0\.00 +— +-0\.71 +\+0\.71", out)
    assert re.search(r"hurried · mean +\+0\.00 +— +\+0\.00 +— *\n", out)


def test_bench_personal_tells_what_a_recommendation_follows(concierge):
    """A recommendation of the dish just checked follows its check; one that names another dish
    right after a check copied the wrong name; one with no check before it is unchecked."""
    from kitchen.judge import replay

    bench = load_benchmark("bench_personal")
    actions = [
        "@search thai",
        f"@allergens {SAFE}",
        "Green Curry: 12$, 15 min. Order it?",  # another dish, right after the check
        f"I recommend {SAFE}.",  # the checked one
        "I recommend Green Curry.",  # never checked, not right after a check
    ]
    _, traj, _ = run(concierge, actions, verbosity="brief")
    turns = replay(traj)
    forms = [bench.step_form(t) for t in turns]
    assert forms == ["@search", "@allergens", "short", "recommend", "recommend"]
    assert bench.follows(turns, forms) == [
        ("short", "after checking another"),
        ("recommend", "its dish checked"),
        ("recommend", "unchecked, otherwise"),
    ]


def test_bench_personal_reads_the_forms_of_sft_dialogues(tmp_path):
    """`--data`: each recommendation of an SFT dialogue by the diner's verbosity, its form and
    whether its dish was checked before it (the short form with or without a leading word), read
    as the judge replays the dialogue."""
    bench = load_benchmark("bench_personal")

    def dialogue(verbosity, *turns):
        system = f"Concierge. Diner: verbosity={verbosity}, pace=relaxed, allergies=none."
        said = [{"role": "assistant", "content": t} for t in turns]
        return json.dumps({"messages": [{"role": "system", "content": system}, *said]})

    data = tmp_path / "sft.jsonl"
    data.write_text(
        dialogue("brief", f"@allergens {SAFE}", f"{SAFE}: 7$, 10 min.", "Green Curry: 9$, 9 min.")
        + "\n"
        + dialogue("detailed", "@allergens Tofu Satay", "I recommend Tofu Satay. It has tofu.")
        + "\n"
        + dialogue("brief", "@allergens Tofu Satay", "Try Tofu Satay: 9$, 10 min.")
        + "\n"
    )
    assert bench.data_follows(data) == {
        ("brief", "short", True): 2,  # SAFE, and Tofu Satay after its leading word
        ("brief", "short", False): 1,  # Green Curry, never checked
        ("detailed", "recommend", True): 1,
    }


def test_bench_personal_advantage_per_form_and_recommendation_drift():
    """What MAPO's local term pays each form: the turns of one abstract state normalised
    together, per local signal; a lone state pays nothing; the first recommendation apart."""
    bench = load_benchmark("bench_personal")
    assert bench.recommendation_drift(["opening", "short", "question", "recommend", "short"]) == (
        "short",
        ["recommend", "short"],
    )
    assert bench.recommendation_drift(["opening", "question"]) == (None, [])

    def step(key, f, mean, lost, t3, valid=True, group="brief"):
        return {
            "key": key,
            "groups": [group],
            "form": f,
            "reward": {"mean": mean, "violations": lost},
            "valid": {"mean": True, "violations": valid},
            "scores": {"T3": t3, "A1": 1.0},
            "weights": {"T3": 1.0, "A1": 3.0},
            "form_share": (t3 / 4, 1 if t3 > 0 else 2),  # T3's weight is a quarter
        }

    adv = bench.form_advantages(
        [
            step("k", "short", 1.0, 0.0, 1.0),
            step("k", "recommend", 0.5, -0.25, -1.0),
            step("lone", "opening", 0.9, 0.0, 1.0),
            step("k", "@search", 0.0, -1.0, 1.0, valid=False),  # masked in violations mode
        ]
    )
    # mean: rewards 1, 0.5, 0 in k (mean 0.5, sample std 0.5): +1, 0, −1
    assert adv["mean"][("brief", "short")] == pytest.approx(1.0, rel=1e-5)
    assert adv["mean"][("brief", "@search")] == pytest.approx(-1.0, rel=1e-5)
    assert adv["mean"][("brief", "opening")] == 0.0  # alone in its state
    # violations: the masked search leaves 0 and −0.25 (centred ±0.125, std 0.177): ±0.707
    assert adv["violations"][("brief", "short")] == pytest.approx(2**-0.5, rel=1e-4)
    assert ("brief", "@search") not in adv["violations"]
    # clauses: only T3 varies in k (+1, −1, +1 → z = +0.577, −1.155, +0.577, weighted 1/4),
    # A1 never does; rescaled to unit std over the four steps
    u = [0.577350 / 4, -1.154701 / 4, 0.0, 0.577350 / 4]
    sd = (sum(x * x for x in u) / 4 - (sum(u) / 4) ** 2) ** 0.5
    assert adv["clauses"][("brief", "recommend")] == pytest.approx(u[1] / sd, rel=1e-4)
    # mean|form: state m holds two short turns (form share +0.25, content +0.5 and −0.5) and
    # two long ones (−0.25; content 0.25, 0.75). The plain mean pays both forms 0; judged within
    # form, r' = 1, 0, −0.25, 0.25 (std 0.540): the short form +0.25 / 0.540, the long −0.25 / 0.540
    both = [
        step("m", "short", 0.75, 0.0, 1.0, group="detailed"),
        step("m", "short", -0.25, 0.0, 1.0, group="detailed"),
        step("m", "recommend", 0.0, 0.0, -1.0, group="detailed"),
        step("m", "recommend", 0.5, 0.0, -1.0, group="detailed"),
    ]
    adv = bench.form_advantages(both)
    assert adv["mean"][("detailed", "short")] == pytest.approx(0.0, abs=1e-6)
    sd = (0.875 / 3) ** 0.5
    assert adv["mean|form"][("detailed", "short")] == pytest.approx(0.25 / sd, rel=1e-4)
    assert adv["mean|form"][("detailed", "recommend")] == pytest.approx(-0.25 / sd, rel=1e-4)


def test_bench_form_history_rewrites_and_probes(tmp_path):
    """benchmarks/bench_form_history.py: the two rewrites invert each other, only the earlier
    recommendations are rewritten, and every (verbosity, variant) cell's shares add up to 1."""
    from kitchen.models import ModelSpec, load_model

    bench = load_benchmark("bench_form_history")
    short = "Pad Thai: 12$, 15 min. Order it?"
    long = "I recommend Pad Thai, 12 dollars, ready in 15 minutes. Order it?"
    assert bench.to_long(short) == long and bench.to_short(long) == short
    assert bench.to_long("Which cuisine?") == "Which cuisine?"
    assert [bench.answer_form(t) for t in (short, long, "@search thai")] == [
        "short",
        "long",
        "other",
    ]
    rows = [
        json.loads(line)
        for line in (paths.DATA / "sft" / "eval.jsonl").read_text().splitlines()[:40]
    ]
    ctxs = bench.contexts(rows, 2)
    assert len(ctxs) == 6 and {v for _, v, _ in ctxs} == set(bench.VARIANTS)
    (_, _, written), (_, _, longer), _ = ctxs[:3]
    changed = [a["content"] for a, b in zip(written, longer, strict=True) if a != b]
    assert changed and all(bench.SHORT.match(t) for t in changed)  # only short ones rewritten
    policy = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    shares = bench.probe(policy, rows, 1, 2)
    assert len(shares) == 3
    assert all(abs(sum(s.values()) - 1) < 1e-9 for s in shares.values())


def test_bench_red_lines_probe_asks_each_check_once_for_the_most_likely_turn(tmp_path, capsys):
    """`bench_red_lines.py --probe POLICY --temperature 0`: one answer per allergen check of an
    allergic diner, the policy's most likely turn — the same on every run; sampled, `answers`
    per check."""
    bench = load_benchmark("bench_red_lines")
    rows, checks = [], 0
    for row in read_jsonl(paths.DATA / "sft" / "eval.jsonl"):
        msgs = row["messages"]
        if not bench.allergies_in(msgs[0]["content"]):
            continue
        n = sum(m["role"] == "tool" and "; allergens: " in m["content"] for m in msgs[:-1])
        if n:
            rows.append(row)
            checks += n
        if len(rows) == 2:
            break
    dialogues = write_jsonl(tmp_path / "two.jsonl", rows)
    policy = str(paths.DATA / "models" / "policy-tiny")

    def probed(answers: int, temperature: float) -> str:
        bench.probe(policy, dialogues, answers, temperature=temperature)
        out = capsys.readouterr().out
        policy_part = out.split("the scripted agent")[0]
        asked = sum(int(n) for n in re.findall(r"found the dish [^(]+\((\d+)\)", policy_part))
        assert asked == checks * answers, out
        return out

    greedy = probed(1, 0.0)
    assert "its most likely turn" in greedy
    bench.probe(policy, dialogues, 3, temperature=0.0)  # the most likely turn is asked once
    assert capsys.readouterr().out == greedy
    assert "2 answers per check" in probed(2, 1.0)


@pytest.mark.parametrize(
    "message",
    [
        "I recommend Mochi Chai, 6 dollars, ready in 5 minutes. Shall I order it?",
        "I recommend Pad. It has rice noodles. It costs 12 dollars and arrives in 15 minutes.",
        "Mochi Chai: 6$, 5 min. Order it?",
        "Lovely. With sponge cake, sugar. 5 dollars, 5 minutes. It is vegetarian.",
        "Mochi Chai. 6 dollars, 5 minutes.",
        "Shall I order Mochi Chai for you?",
        "Order Mochi Chai?",
    ],
)
def test_a_message_offering_a_dish_the_menu_lacks_breaks_a3(concierge, message):
    """A garbled or made-up dish in any of the world's offer forms names no menu dish, yet tells
    the diner of a dish no tool returned: A3 is broken there, not only at the `@order` that may
    follow; the same form with the menu's dish (searched) passes."""
    review, traj, _ = run(concierge, ["@search thai", message])
    v = review.get(1, "A3")
    assert v.verdict == "violate" and "not on the menu" in v.reason, v
    real = re.sub(r"Mochi Chai|Pad|Lovely", SAFE, message)
    review, _, _ = run(concierge, ["@search thai", real])
    assert verdict(review, 1, "A3") == "pass", (real, review.get(1, "A3"))


def test_messages_that_offer_no_dish_by_name_are_not_read_as_inventions():
    """Questions, opening lines, cuisines and the menu's own names (any case) are not invented
    dishes; neither is any message of the scripted agents' SFT dialogues."""
    from kitchen.world import load_menu

    menu = load_menu()
    for text in [
        "Shall I order it for you?",
        "Order it?",
        "Which cuisine would you like?",
        "Lovely. Let's find your drink next.",
        "I recommend Thai, if you like spice.",
        f"I recommend {SAFE.lower()}, 7 dollars.",
        f"{SAFE}: 7$, 10 min. Order it?",
    ]:
        assert menu.invented(text) == [], text
    assert menu.invented("I recommend Pad, 9 dollars. Shall I order Pad for you?") == ["Pad"]
    messages = [
        m["content"]
        for row in read_jsonl(paths.DATA / "sft" / "eval.jsonl")
        for m in row["messages"]
        if m["role"] == "assistant" and not m["content"].startswith("@")
    ]
    assert len(messages) > 500
    assert [t for t in messages if menu.invented(t)] == []
