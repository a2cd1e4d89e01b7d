"""The concierge world: menu, tasks and splits, action parsing, the diner, episodes, state keys."""

from __future__ import annotations

import json

import pytest

from kitchen.config import KitchenError
from kitchen.world import (
    MAX_ACTION_CHARS,
    Task,
    World,
    feasible,
    fitting,
    generate_tasks,
    load_menu,
    load_split,
    parse_action,
    parse_search,
    task_split,
)

DIMS = {"verbosity": "normal", "pace": "relaxed", "diet": "any", "allergies": ["peanut"]}
THAI = Task(id="t-thai", request="I'd like some thai food.", cuisine="thai")
VAGUE = Task(id="t-vague", request="I need dinner.", hidden_cuisine="indian")


def play(actions, task=THAI, dims=DIMS, **kw):
    w = World(**kw)
    w.reset(task, dims, seed=1)
    for a in actions:
        _, done = w.step(a)
        if done:
            break
    return w


def test_menu_has_enough_dishes_and_cuisines():
    menu = load_menu()
    assert len(menu.dishes) >= 30 and len(menu.cuisines) >= 5
    for d in menu.dishes:
        assert d.ingredients and d.price > 0 and d.minutes > 0
    assert menu.find("  tofu   satay. ").name == "Tofu Satay"
    assert [d.name for d in menu.mentioned("Try Green Curry or tofu satay!")] == [
        "Green Curry",
        "Tofu Satay",
    ]


def test_tasks_are_deterministic_feasible_and_split():
    a, b = generate_tasks(50, seed=3), generate_tasks(50, seed=3)
    assert a == b and generate_tasks(50, seed=4) != a
    held = generate_tasks(50, seed=3, split="heldout")
    sig = lambda t: (t.cuisine, t.hidden_cuisine, t.max_price, t.max_minutes, t.request)  # noqa: E731
    assert not {sig(t) for t in a} & {sig(t) for t in held}, "a held-out task leaked into train"
    assert any(t.ambiguous for t in a) and any(not t.ambiguous for t in a)
    assert any(t.max_price for t in a) and any(t.max_minutes for t in a)
    menu = load_menu()
    for t in a + held:
        assert fitting(menu, t)
    assert task_split("thai", None, 10, None, 0) in ("train", "heldout")


def test_profile_splits_are_disjoint(profiles):
    train, held = load_split("train"), load_split("heldout")
    assert not set(train) & set(held)
    assert set(train) | set(held) == {p.id for p in profiles}


@pytest.mark.parametrize(
    "text,kind,tool,arg",
    [
        ("@search thai", "tool", "search", "thai"),
        ("@allergens   Tofu   Satay", "tool", "allergens", "Tofu Satay"),
        (
            '<tool_call>{"name": "order", "arguments": {"dish": "Green Curry"}}</tool_call>',
            "tool",
            "order",
            "Green Curry",
        ),
        (
            'Let me look.<tool_call>\n{"name": "search", "arguments": "{\\"cuisine\\": \\"indian\\"}"}\n'
            "</tool_call>",
            "tool",
            "search",
            "indian",
        ),
        (
            '{"name": "allergens", "arguments": {"dish": "Shakshuka"}}',
            "tool",
            "allergens",
            "Shakshuka",
        ),
        ("I recommend Tofu Satay.", "say", None, None),
    ],
)
def test_parse_both_syntaxes(text, kind, tool, arg):
    a = parse_action(text)
    assert (a.kind, a.tool, a.argument) == (kind, tool, arg)


@pytest.mark.parametrize(
    "text,error",
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("@fly me", "unknown tool"),
        ("@search", "needs a cuisine"),
        ("<tool_call>{not json</tool_call>", "malformed"),
        ('{"name": 3', "malformed"),
        ("x" * (MAX_ACTION_CHARS + 1), "longer than"),
    ],
)
def test_malformed_actions_are_invalid_not_crashes(text, error):
    a = parse_action(text)
    assert a.kind == "invalid" and error in a.error


def test_non_utf8_bytes_and_nul_are_handled():
    a = parse_action(b"@search th\xffai\x00")
    assert a.kind == "tool" and "\x00" not in a.argument
    w = play([b"\xff\xfe hello", "@search thai"])
    assert w.traj.turns[0].action.kind == "say"


def test_invalid_action_becomes_observation_and_stays_in_trajectory():
    w = play(["@teleport now", "@search thai"])
    t = w.traj
    assert t.turns[0].action.kind == "invalid"
    assert t.messages[3] == {
        "role": "tool",
        "content": "invalid action: unknown tool 'teleport'; tools are search, allergens, order",
    }
    assert t.messages[5]["content"].startswith("thai: ")


def test_tools_and_unknown_dishes():
    w = play(["@search martian", "@search thai", "@allergens Moon Cake", "@allergens Tofu Satay"])
    contents = [m["content"] for m in w.traj.messages if m["role"] == "tool"]
    assert contents[0].startswith("no dishes for 'martian'")
    assert "Tofu Satay (11$, 15min, veg)" in contents[1]
    assert contents[2] == "unknown dish 'Moon Cake'"
    assert contents[3] == "Tofu Satay: tofu, peanut sauce, rice; allergens: peanut, soy"


def test_messages_are_openai_style_and_json_serialisable():
    w = play(
        [
            "@search thai",
            "I recommend Mango Sticky Rice. Shall I order it?",
            "@order Mango Sticky Rice",
        ]
    )
    msgs = w.traj.messages
    call = msgs[2]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "search"
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"cuisine": "thai"}
    assert msgs[3]["role"] == "tool" and msgs[3]["tool_call_id"] == call["tool_calls"][0]["id"]
    json.dumps(w.traj.to_jsonl_row())


def test_successful_episode():
    w = play(
        [
            "@search thai",
            "@allergens Mango Sticky Rice",
            "I recommend Mango Sticky Rice. Shall I order it?",
            "@order Mango Sticky Rice",
        ]
    )
    t = w.traj
    assert t.done and t.end == "ordered"
    assert t.messages[-3]["content"] in ("Yes, please order it.", "Sounds good, order it.")
    assert t.outcome.success == 1


@pytest.mark.parametrize("dish,why", [("Tofu Satay", "peanut"), ("Butter Chicken", "wanted thai")])
def test_diner_rejects_unsuitable_recommendations(dish, why):
    w = play(["@search thai", f"I recommend {dish}."])
    reply = w.traj.messages[-1]["content"]
    assert reply.startswith(("No,", "Not ")) and why.split()[-1] in reply


def test_unsafe_order_fails():
    w = play(["@search thai", "@order Tofu Satay"])
    assert w.traj.outcome.success == 0 and "allergen:peanut" in w.traj.outcome.reason
    assert w.traj.outcome.progress == 0.0  # a single dish that does not fit earns no partial credit


def test_ambiguous_request_reveals_cuisine_when_asked():
    w = play(["Which cuisine would you like?"], task=VAGUE)
    assert "indian" in w.traj.messages[-1]["content"].lower()
    w = play(["Which cuisine would you like?"], task=THAI)
    assert w.traj.messages[-1]["content"] == "As I said, thai."


def test_hurried_diner_grows_impatient_and_leaves():
    long = (
        "Let me tell you a long story about our kitchen and the many chefs who work in it "
        "every single day of the week."
    )
    w = play([long] * 5, dims=DIMS | {"pace": "hurried"})
    replies = [m["content"] for m in w.traj.messages if m["role"] == "user"][1:]
    assert replies[0].startswith("Shorter, please.")
    assert w.traj.end == "left" and len(w.traj.turns) == 3 and w.traj.outcome.success == 0


def test_turn_budget_ends_the_episode():
    w = play(["Hello."] * 20, max_turns=4)
    assert w.traj.end == "budget" and len(w.traj.turns) == 4
    with pytest.raises(KitchenError, match="after the episode ended"):
        w.step("Hello.")


def test_pii_request_is_refused():
    w = play(["What is your phone number?"])
    assert w.traj.messages[-1]["content"] == "I'd rather not share that."


def test_deterministic_given_seed():
    def run(seed):
        w = World()
        w.reset(VAGUE, DIMS, seed=seed)
        for a in ["Hi!", "Which cuisine would you like?", "@search indian"]:
            w.step(a)
        return w.traj.messages

    assert run(5) == run(5)


def test_missing_profile_dimensions_do_not_crash():
    w = play(["@search thai", "I recommend Green Curry."], dims={})
    assert w.traj.messages[0]["content"].endswith("allergies=none.")


def test_state_keys():
    """Exact keys match only identical histories; abstract keys summarise progress."""
    w1, w2 = World(), World()
    w1.reset(THAI, DIMS, seed=1)
    w2.reset(THAI, DIMS, seed=2)
    assert w1.keys() == w2.keys()
    w1.step("@search thai")
    w2.step("@search thai")
    assert w1.keys()[0] == w2.keys()[0]
    w1.step("@allergens Tofu Satay")
    w2.step("@allergens Mango Sticky Rice")
    (e1, a1), (e2, a2) = w1.keys(), w2.keys()
    assert e1 != e2 and a1 == a2
    assert "searches=1" in a1 and "checked=1" in a1
    t = w1.traj
    assert [ti.abstract_key.split("|")[-1] for ti in t.turns] == ["rec=none", "rec=none"]
    # an extra greeting before the search reaches the same stage: the same abstract state
    w3 = play(["Hello there.", "@search thai", "@allergens Green Curry"])
    assert w3.keys()[1] == a1 and w3.keys()[0] != e1


def test_long_outputs_do_not_crash():
    w = play(["word " * 100_000, "@search thai"])
    assert w.traj.turns[0].action.kind == "invalid"


# --------------------------------------------------------------------------------------------
# Courses and meals (long tasks)

MEAL = Task(
    id="t-meal",
    request="I'd like a meal of thai food: a starter, a main and a dessert.",
    cuisine="thai",
    courses=["starter", "main", "dessert"],
)
SAFE_MEAL = ["Corn Fritters", "Mango Sticky Rice", "Coconut Ice Cream"]  # no peanut


def course_steps(dish, course):
    return [
        f"@search thai {course}",
        f"@allergens {dish}",
        f"I recommend {dish}. Shall I order it?",
        f"@order {dish}",
    ]


def meal_actions(dishes=SAFE_MEAL, courses=("starter", "main", "dessert")):
    return [a for d, c in zip(dishes, courses, strict=True) for a in course_steps(d, c)]


def test_menu_serves_every_course_of_every_cuisine():
    """Each cuisine has at least four dishes per course, vegetarian ones among them; the old
    dishes are mains; no dish name hides inside another dish's name or ingredients (a
    description would otherwise 'name' a second dish)."""
    menu = load_menu()
    for cuisine in menu.cuisines:
        for course in ("starter", "main", "dessert", "drink"):
            dishes = menu.search(cuisine, course)
            assert len(dishes) >= 4 and any(d.vegetarian for d in dishes), (cuisine, course)
    assert menu.find("Tofu Satay").course == "main" and menu.find("Tiramisu").course == "dessert"
    for d in menu.dishes:
        text = f"I recommend {d.name}. It has {', '.join(d.ingredients)}."
        assert [x.name for x in menu.mentioned(text)] == [d.name], d.name


def test_plain_search_returns_the_mains_as_before_courses():
    w = play(["@search thai"])
    assert w.traj.messages[3]["content"] == (
        "thai: Pad See Ew (12$, 15min); Green Curry (13$, 20min); Tofu Satay (11$, 15min, veg); "
        "Papaya Salad (9$, 10min); Mango Sticky Rice (7$, 10min, veg)"
    )


@pytest.mark.parametrize(
    "text,query",
    [
        ("thai", ("thai", None)),
        ("thai dessert", ("thai", "dessert")),
        ("Desserts thai.", ("thai", "dessert")),
        ("thai main", ("thai", "main")),
        ("thai soup", None),
        ("thai dessert drink", None),
        ("martian starter", None),
    ],
)
def test_parse_search(text, query):
    assert parse_search(text, load_menu().cuisines) == query


def test_course_search_in_both_syntaxes():
    w = play(
        [
            "@search thai dessert",
            '<tool_call>{"name": "search", "arguments": {"cuisine": "thai", "course": "drink"}}'
            "</tool_call>",
            "@search thai soup",
        ],
        task=MEAL,
    )
    tools = [m["content"] for m in w.traj.messages if m["role"] == "tool"]
    assert tools[0].startswith("thai dessert: Coconut Ice Cream (5$, 5min, veg)")
    assert "Pad See Ew" not in tools[0]
    assert tools[1].startswith("thai drink: Thai Iced Tea")
    assert tools[2].startswith("no dishes for 'thai soup'") and "courses: starter" in tools[2]
    call = w.traj.messages[2]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"cuisine": "thai", "course": "dessert"}


def test_meal_tasks_are_deterministic_feasible_split_and_leave_short_tasks_alone():
    short = generate_tasks(40, seed=3)
    mixed = generate_tasks(80, seed=3, long_share=0.5)
    assert mixed == generate_tasks(80, seed=3, long_share=0.5)
    meals = [t for t in mixed if t.kind == "long"]
    assert 25 <= len(meals) <= 55
    shorts = [t for t in mixed if t.kind == "short"]
    assert shorts == short[: len(shorts)], "meals must not change the short tasks"
    menu = load_menu()
    for t in meals:
        assert t.id.startswith("train-3-L") and len(t.courses) in (3, 4) and "main" in t.courses
        assert feasible(menu, t) and all(f"a {c}" in t.request for c in t.courses)
    held = [t for t in generate_tasks(80, seed=3, split="heldout", long_share=1.0)]
    sig = lambda t: (t.cuisine, t.hidden_cuisine, t.max_price, t.max_minutes, t.request)  # noqa: E731
    assert all(t.kind == "long" for t in held)
    assert not {sig(t) for t in meals} & {sig(t) for t in held}, "a held-out meal leaked"
    assert any(t.ambiguous for t in held) and any(not t.ambiguous for t in held)
    with pytest.raises(KitchenError, match="long_share"):
        generate_tasks(3, long_share=1.5)


def test_a_meal_is_ordered_course_by_course_and_succeeds():
    w = play(meal_actions(), task=MEAL, max_turns=24)
    t = w.traj
    tools = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert "ordered Corn Fritters (starter); still to order: main, dessert" in tools
    assert tools[-1] == "ordered Coconut Ice Cream (dessert); all courses ordered"
    assert t.done and t.end == "ordered" and len(t.turns) == 12
    assert t.outcome.success == 1 and t.outcome.dishes == SAFE_MEAL
    assert t.outcome.progress == 1.0


def test_the_global_reward_takes_progress_or_success_as_the_recipe_says(concierge):
    """`reward.outcome: progress` gives a meal that ran out of turns after two of its three
    courses 2/3 as its global reward; `success` (the default) gives it 0; a single dish gets its
    success either way (1 for a fitting order, 0 for an allergen)."""
    from kitchen.constitution import personalize
    from kitchen.judge import judge
    from kitchen.profile import Profile
    from kitchen.train import RewardConfig, episode_rewards

    meal = play(meal_actions()[:8] + ["Hello."] * 20, task=MEAL, max_turns=14).traj
    good = play(["@search thai", "@order Mango Sticky Rice"]).traj
    bad = play(["@search thai", "@order Tofu Satay"]).traj  # peanut
    trajs = [meal, good, bad]
    pcs = [personalize(concierge, Profile(id="u", dimensions=DIMS))] * 3
    reviews = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    got = {
        mode: [r.outcome for r in episode_rewards(trajs, reviews, pcs, RewardConfig(outcome=mode))]
        for mode in ("success", "progress")
    }
    assert got["success"] == [0.0, 1.0, 0.0]
    assert got["progress"] == [pytest.approx(2 / 3), 1.0, 0.0]


def test_step_progress_credits_the_order_that_fulfilled_a_course(concierge):
    """Each turn records the share fulfilled so far; `reward.step_progress: μ` adds μ·Δp to
    the turn that moved it (+1/3 a fitting course of three, 1 a single dish ordered right, −1/3
    a second main) and nothing to any other turn."""
    from kitchen.constitution import personalize
    from kitchen.judge import judge
    from kitchen.profile import Profile
    from kitchen.train import RewardConfig, episode_rewards, progress_gains

    actions = meal_actions()
    meal = play([*actions[:8], "@order Green Curry", *actions[8:]], task=MEAL, max_turns=24).traj
    good = play(["@search thai", "@order Mango Sticky Rice"]).traj
    orders = [ti.turn for ti in meal.turns if ti.action.tool == "order"]
    gains = progress_gains(meal)
    assert [gains[i] for i in orders] == pytest.approx([1 / 3, 1 / 3, -1 / 3, 1 / 3])
    assert not any(g for i, g in enumerate(gains) if i not in orders)
    assert sum(gains) == pytest.approx(meal.outcome.progress) == pytest.approx(2 / 3)
    assert progress_gains(good) == [0.0, 1.0]

    trajs = [meal, good]
    pcs = [personalize(concierge, Profile(id="u", dimensions=DIMS))] * 2
    reviews = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    plain = episode_rewards(trajs, reviews, pcs, RewardConfig(reviewer="judge"))
    shaped = episode_rewards(trajs, reviews, pcs, RewardConfig(reviewer="judge", step_progress=2))
    for p, s, t in zip(plain, shaped, trajs, strict=True):
        for i, g in enumerate(progress_gains(t)):
            assert p.valid[i] or not g  # every order has verdicts to pay
            assert s.local[i] == pytest.approx(p.local[i] + 2 * g)
        assert s.valid == p.valid and s.outcome == p.outcome
    assert shaped[1].contributions[1]["progress"] == 2.0
    flagged = [reviews[1].model_copy(update={"flags": ["t1: fake verdicts"]})]
    (attempt,) = episode_rewards([good], flagged, pcs[:1], RewardConfig(step_progress=2))
    assert "progress" not in attempt.contributions[1]  # an attempt never pays
    # a fitting order of a dish no search returned breaks A3: under the veto nothing buys it back
    unsearched = play(["@order Mango Sticky Rice"]).traj
    assert progress_gains(unsearched) == [1.0]
    veto = RewardConfig(reviewer="judge", red_lines="veto", step_progress=2)
    (vetoed,) = episode_rewards([unsearched], [judge(unsearched, pcs[0])], pcs[:1], veto)
    assert vetoed.local[0] == -1.0 and vetoed.contributions[0]["progress"] == 0.0
    old = unsearched.model_copy(deep=True)
    old.turns[0].progress = 0.0  # recorded before turns carried their progress
    with pytest.raises(KitchenError, match="no turn records any"):
        progress_gains(old)


def test_a_meal_ends_only_when_every_course_is_ordered():
    w = play(meal_actions()[:8] + ["Hello."] * 20, task=MEAL, max_turns=14)
    assert w.traj.end == "budget" and w.traj.outcome.success == 0
    assert "2 of 3 courses ordered" in w.traj.outcome.reason
    assert w.traj.outcome.progress == pytest.approx(2 / 3)  # the global reward's partial credit


@pytest.mark.parametrize(
    "extra,why",
    [
        (["@search thai drink", "@order Thai Iced Tea"], "(course)"),  # not asked for
        (["@order Green Curry"], "a second main"),
    ],
)
def test_a_meal_with_an_order_beyond_the_request_fails(extra, why):
    actions = meal_actions()
    w = play(actions[:8] + extra + actions[8:], task=MEAL, max_turns=24)
    assert w.traj.end == "ordered" and w.traj.outcome.success == 0
    assert why in w.traj.outcome.reason
    assert w.traj.outcome.progress == pytest.approx(2 / 3)  # three fitting courses, one extra


def test_an_unsafe_course_fails_the_meal_but_the_episode_goes_on():
    actions = meal_actions(["Fresh Spring Rolls", *SAFE_MEAL[1:]])  # peanut starter
    w = play(actions, task=MEAL, max_turns=24)
    assert w.traj.end == "ordered" and len(w.traj.turns) == 12
    assert w.traj.outcome.success == 0 and "allergen:peanut" in w.traj.outcome.reason
    assert w.traj.outcome.progress == pytest.approx(1 / 3)  # two fit, the unsafe one counts against


def test_diner_rejects_a_course_not_asked_for_or_already_served():
    w = play(
        [
            *course_steps("Corn Fritters", "starter"),
            "@search thai drink",
            "I recommend Thai Lager.",
        ],
        task=MEAL,
        max_turns=24,
    )
    assert w.traj.messages[-1]["content"].endswith("I didn't ask for a drink.")
    w = play([*course_steps("Corn Fritters", "starter"), "How about Tom Yum Soup?"], task=MEAL)
    assert w.traj.messages[-1]["content"].endswith("I already have my starter.")


def test_meal_state_keys_track_course_progress():
    """The abstract key says which course the meal is at and restarts the per-course counts, so
    the same stage of the second course has one key whatever turn it is reached at."""
    w1 = play(meal_actions()[:5], task=MEAL, max_turns=24)
    w2 = play(["Hello there.", *meal_actions()[:5]], task=MEAL, max_turns=24)
    (_, a1), (_, a2) = w1.keys(), w2.keys()
    assert a1 == a2 and "meal=1/3" in a1 and "searches=1" in a1 and "turn=" not in a1
    assert a1.split("|")[1] == "meal=1/3"
    first = w1.traj.turns[0].abstract_key
    assert "meal=0/3" in first and "searches=0" in first
    assert "meal=" not in play(["@search thai"]).traj.turns[0].abstract_key


def test_meal_episodes_are_deterministic_given_seed():
    def run(seed):
        w = World(max_turns=24)
        w.reset(MEAL, DIMS, seed=seed)
        for a in ["@search thai starter", "I recommend Corn Fritters.", *meal_actions()[4:8]]:
            w.step(a)
        return w.traj.messages

    assert run(5) == run(5)


def test_only_a_meal_prompt_shows_the_course_argument():
    """A single dish's system prompt is what it was before meals (policies trained then still
    see their prompt); a meal's names the search's course argument."""
    assert play([]).traj.messages[0]["content"] == (
        "Concierge. Tools: @search CUISINE, @allergens DISH, @order DISH. "
        "Diner: verbosity=normal, pace=relaxed, diet=any, allergies=peanut."
    )
    assert "@search CUISINE [COURSE]," in play([], task=MEAL).traj.messages[0]["content"]
