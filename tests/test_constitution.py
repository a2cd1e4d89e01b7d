"""The constitution DSL: validation with exact locations, personalisation, caching, rendering."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kitchen import paths
from kitchen.config import KitchenError
from kitchen.constitution import (
    PersonalizationCache,
    derivation_edges,
    diff,
    parse_condition,
    parse_constitution,
    personalize,
    render_diff,
    render_text,
    schema,
    to_frame,
)
from kitchen.profile import ClauseOverride, DimensionValue, Profile

BASE = """\
name: t
dimensions:
  verbosity: {values: [brief, normal, detailed], default: normal}
  pace: {values: [hurried, relaxed], default: relaxed}
  budget: {kind: number, min: 5, max: 50}
axioms:
  - id: A1
    category: safety
    text: Never do harm.
  - id: A2
    category: respect
    weight: 2
    text: Respect the user's time.
theorems:
  - id: T1
    derives_from: [A2]
    text: Keep messages within {max_words} words.
    params:
      max_words: {default: 30, from: verbosity, map: {brief: 10, detailed: 80}}
  - id: T2
    derives_from: [A2]
    applies_when: pace == hurried
    text: Lead with the answer.
"""


def problems(text: str) -> list:
    with pytest.raises(KitchenError) as e:
        parse_constitution(text, "c.yaml")
    return e.value.problems


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_base_is_valid():
    c = parse_constitution(BASE)
    assert c.clause_ids == ["A1", "A2", "T1", "T2"]
    assert derivation_edges(c) == [("A2", "T1"), ("A2", "T2")]


def test_shipped_constitution_meets_the_issue(concierge):
    """>= 3 axioms, >= 5 theorems, all derived from axioms, >= 2 parameterised by the profile."""
    assert len(concierge.axioms) >= 3 and len(concierge.theorems) >= 5
    assert all(concierge.roots(t.id) for t in concierge.theorems)
    profile_params = [
        t for t in concierge.theorems if t.applies_when or any(p.from_ for p in t.params.values())
    ]
    assert len(profile_params) >= 2


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("  - id: T2", "  - id: T1", "duplicate id 'T1'"),
        (
            "derives_from: [A2]\n    applies",
            "derives_from: [A9]\n    applies",
            "unknown clause 'A9'",
        ),
        ("pace == hurried", "mood == grumpy", "unknown dimension 'mood'"),
        ("pace == hurried", "pace == sleepy", "'sleepy' is not a value of 'pace'"),
        ("from: verbosity", "from: verbosty", "unknown dimension 'verbosty'"),
        ("brief: 10", "terse: 10", "'terse' is not a value of 'verbosity'"),
        ("weight: 2", "weight: 20", "less than or equal to 10"),
        ("Lead with the answer.", "Lead with {tone}.", "placeholder {tone}"),
        ("pace == hurried", "budget == 5", "category dimensions only"),
    ],
)
def test_each_problem_is_reported_at_its_line(old, new, expect):
    """Every kind of mistake is reported at the line of the edited field, with a fix."""
    text = BASE.replace(old, new, 1)
    assert text != BASE
    edited_line = BASE[: BASE.index(old)].count("\n") + 1
    found = problems(text)
    matching = [p for p in found if expect in p.message]
    assert matching, [str(p) for p in found]
    p = matching[0]
    assert p.path == "c.yaml" and p.line == edited_line, (str(p), edited_line)
    assert str(p).startswith(f"c.yaml:{edited_line}: ")


def test_unknown_field_suggests_spelling():
    (p,) = problems(BASE.replace("applies_when:", "applies_wen:"))
    assert "unknown field 'applies_wen'" in p.message and "applies_when" in p.message
    assert p.line == line_of(BASE, "applies_when")


def test_missing_field_and_wrong_type():
    text = BASE.replace("    category: safety\n", "", 1).replace("weight: 2", "weight: heavy")
    found = {p.message.split(" (")[0] for p in problems(text)}
    assert "missing required field 'category'" in found
    assert any("valid number" in m for m in found)


def test_theorem_needs_derivation():
    (p,) = problems(BASE.replace("    derives_from: [A2]\n    applies_when", "    applies_when"))
    assert "derives_from" in p.where and "missing" in p.message


def test_derivation_cycle():
    text = BASE.replace(
        "derives_from: [A2]\n    applies_when", "derives_from: [T3]\n    applies_when"
    )
    text += "  - id: T3\n    derives_from: [T2]\n    text: Loop.\n"
    found = problems(text)
    assert any("derivation cycle" in p.message for p in found), [str(p) for p in found]


def test_theorem_cannot_override_axiom():
    text = BASE.replace("  - id: T2\n", "  - id: T2\n    overrides: A1\n")
    (p,) = problems(text)
    assert "axioms are red lines" in p.message and p.where.startswith("theorems[1]")


def test_axiom_cannot_be_conditional():
    text = BASE.replace(
        "    category: safety\n", "    category: safety\n    applies_when: pace == hurried\n"
    )
    (p,) = problems(text)
    assert "apply to every user" in p.message


def test_theorem_may_not_outweigh_its_axiom():
    text = BASE.replace(
        "    text: Lead with the answer.", "    weight: 5\n    text: Lead with the answer."
    )
    (p,) = problems(text)
    assert "exceeds axiom A2" in p.message


def test_contradicting_bounds_are_a_conflict():
    """min_words 50 under a condition that can hold with max_words 10 is a conflict."""
    text = BASE + (
        "  - id: T3\n    derives_from: [A2]\n    applies_when: pace == hurried\n"
        "    text: Explain in at least {min_words} words.\n    params: {min_words: 50}\n"
    )
    found = problems(text)
    assert any(
        "conflicts with T3" in p.message and "verbosity=brief" in p.message for p in found
    ), [str(p) for p in found]


def test_exclusive_conditions_do_not_conflict():
    """The same bounds are fine when the conditions can never hold together."""
    text = BASE + (
        "  - id: T3\n    derives_from: [A2]\n    applies_when: verbosity == detailed\n"
        "    text: Explain in at least {min_words} words.\n    params: {min_words: 50}\n"
    )
    c = parse_constitution(text)
    assert "T3" in c.clause_ids


def test_condition_syntax():
    tests = parse_condition("verbosity in [brief, normal] and pace != hurried")
    assert [str(t) for t in tests] == ["verbosity in [brief, normal]", "pace != hurried"]
    assert tests[0].holds("brief") and not tests[0].holds("detailed")
    assert tests[1].holds("relaxed") and not tests[1].holds("hurried")
    with pytest.raises(ValueError, match="cannot read condition"):
        parse_condition("verbosity is brief")


# --- personalisation --------------------------------------------------------------------------


def prof(**dims) -> Profile:
    return Profile(
        id="u1",
        name="Ada Lovelace",
        email="ada@example.com",
        dimensions={
            k: v if isinstance(v, DimensionValue) else DimensionValue(value=v)
            for k, v in dims.items()
        },
    )


def test_personalize_fills_parameters_and_conditions():
    c = parse_constitution(BASE)
    pc = personalize(c, prof(verbosity="brief", pace="hurried"))
    assert pc.clause("T1").params == {"max_words": 10}
    assert pc.clause("T1").text == "Keep messages within 10 words."
    assert pc.clause("T1").sources["max_words"] == "profile:verbosity=brief"
    assert "T2" in pc.ids and pc.inactive == []
    relaxed = personalize(c, prof(verbosity="normal", pace="relaxed"))
    assert relaxed.clause("T1").params == {"max_words": 30}  # not in the map: the default
    assert relaxed.inactive == ["T2"]


def test_axioms_are_never_changed(concierge, profiles):
    """Every personal constitution carries every axiom with its exact text and weight."""
    for p in profiles:
        pc = personalize(concierge, p)
        for a in concierge.axioms:
            cl = pc.clause(a.id)
            assert (cl.text, cl.weight, cl.kind) == (a.text, a.weight, "axiom")


def test_low_confidence_falls_back_and_is_recorded():
    c = parse_constitution(BASE)
    pc = personalize(
        c,
        prof(
            verbosity=DimensionValue(value="brief", confidence=0.3),
            pace=DimensionValue(value="hurried", confidence=0.2),
        ),
    )
    assert pc.clause("T1").params == {"max_words": 30}
    assert pc.clause("T1").sources["max_words"] == "fallback:verbosity"
    assert "T2" in pc.inactive  # the condition is read on the fallback value (relaxed)
    reasons = {f.dimension: f.reason for f in pc.fallbacks}
    assert "confidence 0.30 < threshold 0.60" in reasons["verbosity"]


def test_safety_dimension_never_falls_back(concierge):
    """allergies has `fallback: false`: a doubtful allergy is still honoured."""
    p = prof(allergies=DimensionValue(value=["peanut"], confidence=0.1))
    pc = personalize(concierge, p)
    assert pc.dimensions["allergies"] == ["peanut"]
    assert "allergies" not in {f.dimension for f in pc.fallbacks}


def test_user_override_of_theorem_and_refusal_for_axiom():
    c = parse_constitution(BASE)
    p = prof(verbosity="brief")
    p.overrides = {"T1": ClauseOverride(params={"max_words": 15})}
    pc = personalize(c, p)
    assert (
        pc.clause("T1").params["max_words"] == 15
        and pc.clause("T1").sources["max_words"] == "override"
    )
    p.overrides = {"T1": ClauseOverride(enabled=False)}
    assert "T1" in personalize(c, p).inactive
    p.overrides = {"A1": ClauseOverride(enabled=False)}
    with pytest.raises(KitchenError, match="axiom: a red line that no profile may override"):
        personalize(c, p)


def test_profile_values_are_checked():
    c = parse_constitution(BASE)
    with pytest.raises(KitchenError, match="did you mean 'verbosity'"):
        personalize(c, prof(verbosty="brief"))
    with pytest.raises(KitchenError, match="'chatty' is not a value of 'verbosity'"):
        personalize(c, prof(verbosity="chatty"))
    with pytest.raises(KitchenError, match=r"number in \[5.0, 50.0\]"):
        personalize(c, prof(budget=500))


def test_profile_missing_dimensions_uses_defaults(concierge):
    pc = personalize(concierge, Profile(id="x"))
    assert pc.dimensions == {
        "verbosity": "normal",
        "pace": "relaxed",
        "diet": "any",
        "allergies": [],
    }
    assert {f.dimension for f in pc.fallbacks} == {"verbosity", "pace", "diet", "allergies"}


def test_version_is_deterministic_and_content_hashed(concierge, profiles):
    a1, a2 = personalize(concierge, profiles[0]), personalize(concierge, profiles[0])
    assert a1 == a2 and a1.version == a2.version
    assert personalize(concierge, profiles[1]).version != a1.version
    edited = parse_constitution(
        paths.DEFAULT_CONSTITUTION.read_text().replace("brief: 12", "brief: 11")
    )
    assert edited.version != concierge.version
    assert personalize(edited, profiles[0]).version != a1.version


def test_cache_invalidates_exactly_the_changed_profile(concierge, profiles, tmp_path):
    cache = PersonalizationCache(folder=tmp_path)
    first = [cache.get(concierge, p) for p in profiles[:3]]
    assert (cache.misses, cache.hits) == (3, 0)
    changed = profiles[1].model_copy(
        update={"dimensions": profiles[1].dimensions | {"verbosity": DimensionValue(value="brief")}}
    )
    again = [cache.get(concierge, p) for p in (profiles[0], changed, profiles[2])]
    assert (cache.misses, cache.hits, cache.invalidations) == (4, 2, 1)
    assert again[0] is first[0] and again[2] is first[2]
    assert again[1].version != first[1].version
    # a fresh cache over the same folder reads the entries back from disk
    disk = PersonalizationCache(folder=tmp_path)
    assert disk.get(concierge, profiles[0]) == first[0] and disk.hits == 1


def test_render_text_cites_every_clause(concierge, profiles):
    pc = personalize(concierge, profiles[0])
    text = render_text(pc)
    for cl in pc.clauses:
        assert f"[{cl.id}]" in text and cl.text in text
    for tid in pc.inactive:
        assert f"[{tid}]" not in text


def test_frame_and_diff(concierge, profiles):
    by_id = {p.id: p for p in profiles}
    a = personalize(concierge, by_id["amara-okafor"])  # brief, hurried
    b = personalize(concierge, by_id["bruno-salas"])  # detailed, relaxed, vegetarian
    frame = to_frame(a)
    assert frame.height == len(a.clauses) and set(frame["id"]) == set(a.ids)
    rows = diff(a, b)
    assert {"clause": "T3", "field": "param:max_words", "a": 12, "b": 60} in rows
    assert {"clause": "T4", "field": "active", "a": True, "b": False} in rows
    assert {"clause": "T7", "field": "active", "a": False, "b": True} in rows
    assert not any(r["clause"].startswith("A") for r in rows)
    assert "T3 param:max_words: 12 -> 60" in render_diff(a, b)
    assert diff(a, a) == []


def test_exported_schema_files_are_current():
    """data/schema/*.json must match the models (regenerate with `make schema`)."""
    for kind in ("constitution", "profile"):
        on_disk = json.loads((paths.DATA / "schema" / f"{kind}.schema.json").read_text())
        assert on_disk == schema(kind), f"run `make schema` to refresh {kind}.schema.json"


def test_schema_accepts_the_shipped_files(profiles):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(yaml.safe_load(paths.DEFAULT_CONSTITUTION.read_text()), schema())
    for f in sorted(paths.PROFILES.glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(f.read_text()), schema("profile"))


# --- property-based: mutated inputs load or raise KitchenError, never anything else ----------

BASE_DOC = yaml.safe_load(paths.DEFAULT_CONSTITUTION.read_text())

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(BASE_DOC) if p]


def _mutate(doc, path, op, value):
    import copy

    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = value
    elif op == "rename" and isinstance(parent, dict):
        parent[f"{key}_x"] = parent.pop(key)
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    return doc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(ALL_PATHS),
    op=st.sampled_from(["delete", "replace", "rename", "duplicate"]),
    value=junk,
)
def test_mutated_constitutions_load_or_raise_kitchen_error(path, op, value):
    doc = _mutate(BASE_DOC, path, op, value)
    text = yaml.safe_dump(doc)
    try:
        parse_constitution(text, "m.yaml")
    except KitchenError as e:
        assert e.problems and all(p.path == "m.yaml" and p.message for p in e.problems)


PROFILE_DOC = yaml.safe_load((paths.PROFILES / "p14-nadia-petrova.yaml").read_text())
PROFILE_PATHS = [p for p in _paths(PROFILE_DOC) if p]


@settings(max_examples=150, deadline=None)
@given(
    path=st.sampled_from(PROFILE_PATHS),
    op=st.sampled_from(["delete", "replace", "rename", "duplicate"]),
    value=junk,
)
def test_mutated_profiles_load_or_raise_kitchen_error(concierge, path, op, value):
    from kitchen.config import parse_yaml, validate_doc

    doc = _mutate(PROFILE_DOC, path, op, value)
    try:
        profile = validate_doc(Profile, parse_yaml(yaml.safe_dump(doc), "p.yaml"))
        personalize(concierge, profile)
    except KitchenError as e:
        assert e.problems and all(p.message for p in e.problems)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(text):
    try:
        parse_constitution(text)
    except KitchenError:
        pass
