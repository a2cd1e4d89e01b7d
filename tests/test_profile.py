"""Profiles and redaction: planted PII must appear in no output of the kit."""

from __future__ import annotations

from kitchen import paths
from kitchen.constitution import diff, personalize, render_text, to_frame
from kitchen.profile import DimensionValue, Profile, mask_text, pseudonym, redact
from kitchen.walkthrough import constitution_walkthrough

from .conftest import run_cli

PII = {
    "name": "Zelda Quarterman",
    "phone": "+44 7700 900123",
    "email": "zelda.q@example.org",
    "address": "221B Baker Street, London",
    "notes": "Reach me at zq@private.example or 07700-900-456.",
}


def planted() -> Profile:
    return Profile(
        id="zelda-q",
        **PII,
        dimensions={
            "verbosity": DimensionValue(value="detailed", confidence=0.9),
            "pace": "hurried",
            "diet": "vegetarian",
            "allergies": ["peanut"],
        },
    )


def assert_clean(text: str) -> None:
    low = text.lower()
    for field, value in PII.items():
        for fragment in [value, *value.split()] if field in ("name", "email") else [value]:
            assert fragment.lower() not in low, f"{field} leaked: {fragment!r}"
    assert "zelda-q" not in low, "raw profile id leaked"


def test_redact_drops_identifying_fields():
    r = redact(planted())
    dumped = r.model_dump_json()
    assert_clean(dumped)
    assert r.pseudonym.startswith("diner-") and r.value("pace") == "hurried"


def test_pii_inside_values_is_masked():
    """E-mails, phone numbers and the diner's own identifiers inside free text are masked."""
    p = Profile(
        id="u9",
        name="Zelda Quarterman",
        dimensions={"note": "mail zelda.q@example.org, call +1 212 555 0199, ask for Zelda"},
    )
    r = redact(p)
    text = r.dimensions["note"].value
    assert "[email]" in text and "[phone]" in text and "[pii]" in text
    assert "Zelda" not in text and r.masked == 3


def test_mask_text_leaves_prices_and_words_alone():
    text, n = mask_text("Pad Thai costs 12.50 and takes 20 minutes; Annabel likes it", ["Ann"])
    assert n == 0 and text.startswith("Pad Thai costs 12.50")


def test_pseudonyms_are_stable_and_salted(monkeypatch):
    assert pseudonym("abc") == pseudonym("abc") != pseudonym("abd")
    monkeypatch.setenv("KITCHEN_PSEUDONYM_SALT", "another-deployment")
    assert pseudonym("abc") != pseudonym("abc", salt="kitchen-default-salt")


def test_planted_pii_reaches_no_output(concierge, profiles, tmp_path):
    """Personal constitution (YAML/JSON/text), table, diff and the CLI carry no PII."""
    pc = personalize(concierge, planted())
    outputs = [
        pc.to_yaml(),
        pc.model_dump_json(),
        render_text(pc),
        str(to_frame(pc).to_dicts()),
        str(diff(pc, personalize(concierge, profiles[0]))),
    ]
    for out in outputs:
        assert_clean(out)
    f = tmp_path / "zelda.yaml"
    f.write_text(planted().model_dump_json())  # JSON is YAML
    for fmt in ("yaml", "text", "json"):
        res = run_cli(
            "constitution",
            "personalize",
            str(paths.DEFAULT_CONSTITUTION),
            "--profile",
            str(f),
            "--format",
            fmt,
        )
        assert res.returncode == 0, res.stderr
        assert_clean(res.stdout + res.stderr)


def test_walkthrough_prints_no_shipped_pii(profiles):
    text = constitution_walkthrough().lower()
    for p in profiles:
        for value in (p.name, p.phone, p.email, p.address, p.notes, p.id):
            if value:
                assert value.lower() not in text, value


def test_a_folder_of_profiles_that_cannot_work_is_a_located_error(tmp_path, monkeypatch):
    """Two files with one id (their pseudonyms would collide), an empty or missing folder, and a
    split naming an id no profile has are errors at their file and line, not crashes later."""
    import pytest
    import yaml

    from kitchen.config import KitchenError
    from kitchen.profile import load_profiles, split_profiles

    folder = tmp_path / "profiles"
    folder.mkdir()
    with pytest.raises(KitchenError, match="no \\*.yaml profiles"):
        load_profiles(folder)
    with pytest.raises(KitchenError, match="no such folder"):
        load_profiles(tmp_path / "nope")
    (folder / "a.yaml").write_text("id: same\ndimensions: {pace: hurried}\n")
    (folder / "b.yaml").write_text("# a copy\nid: same\n")
    with pytest.raises(KitchenError) as e:
        load_profiles(folder)
    (p,) = e.value.problems
    assert (p.path, p.line, p.where) == (str(folder / "b.yaml"), 2, "id") and "a.yaml" in p.message
    (folder / "b.yaml").write_text("id: other\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "splits.yaml").write_text(yaml.safe_dump({"train_profiles": ["same", "gone"]}))
    monkeypatch.setattr(paths, "DATA", data)
    with pytest.raises(KitchenError) as e:
        split_profiles("train", folder)
    (p,) = e.value.problems
    assert p.where == "train_profiles[1]" and "'gone'" in p.message
    with pytest.raises(KitchenError, match="no heldout profiles"):
        split_profiles("heldout", folder)
    (data / "splits.yaml").write_text(yaml.safe_dump({"train_profiles": ["other"]}))
    assert [x.id for x in split_profiles("train", folder)] == ["other"]


def test_a_variant_redraws_every_dimension_and_keeps_no_identifier(concierge):
    """`variant`: every declared dimension gets a value the constitution allows (tags: 0-3
    distinct values), a tag set in `avoid` is never drawn, the overrides stay, the PII goes,
    and the id names its origin."""
    import random

    from kitchen.profile import Profile, variant

    base = Profile(
        id="nadia",
        name="Nadia P",
        phone="+7 912 345 67 89",
        dimensions={"allergies": ["gluten", "dairy"], "verbosity": "detailed"},
        overrides={"T6": {"params": {"min_words": 16}}},
    )
    rng = random.Random(0)
    avoid = [frozenset({"peanut"}), frozenset({"gluten", "soy"})]
    seen = set()
    for _ in range(200):
        v = variant(base, concierge, rng, avoid)
        assert v.id.startswith("nadia~") and v.name is None and v.phone is None
        assert v.overrides == base.overrides
        assert set(v.dimensions) == set(concierge.dimensions)
        tags = v.dimensions["allergies"].value
        assert len(tags) == len(set(tags)) <= 3
        assert frozenset(tags) not in avoid
        for name, dim in concierge.dimensions.items():
            if dim.kind == "category":
                assert v.dimensions[name].value in dim.values
        seen.add(frozenset(tags))
    assert len(seen) > 40
