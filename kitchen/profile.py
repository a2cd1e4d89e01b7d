"""Diner profiles, and the redaction that keeps personal identifiers out of everything else.

A profile is what the kit knows about one user (docs/method.md#personalisation): preference
*dimensions* — each a value with a confidence in [0, 1] — and identifying fields (name, phone,
email, address, free-text notes) that are PII. Personal constitutions rest on profile data that
must be de-identified before use (docs/method.md#privacy); here that is one function, `redact`,
and nothing downstream (personal constitutions, prompts, logs, metric tables, checkpoints) ever
takes a raw `Profile`: they take the `RedactedProfile` it returns.

Departures from the method (docs/method.md#privacy):
1. The method does not say how to de-identify. We drop the identifying fields, replace the profile
   id with a keyed-hash pseudonym (stable across runs, so caches and logs still line up; set
   `KITCHEN_PSEUDONYM_SALT` to make it unlinkable to other deployments), and mask e-mail addresses,
   phone numbers and the diner's own identifiers wherever they appear inside free-text values.
2. Free-text notes are dropped whole rather than scrubbed: a note is exactly where unstructured
   personal detail hides, and nothing in the method needs it.

Profiles are files users write: every mistake in one is a located `PATH:LINE: field: message`
(`kitchen.config`), and so is a folder of them that cannot work — no profile at all, two files
with one id (their personal constitutions and pseudonyms would collide), or a split in
`data/splits.yaml` that names no profile (`split_profiles`): a run or an evaluation on it would
have no diner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator, model_validator

from kitchen.config import (
    KitchenError,
    Problem,
    StrictModel,
    admit_shorthand,
    read_yaml,
    validate_doc,
)

PII_FIELDS = ("name", "phone", "email", "address", "notes")
DEFAULT_SALT = "kitchen-default-salt"

EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
# 7+ digits, optionally with a leading + and separators: catches phone numbers, not prices.
PHONE_RE = re.compile(r"\+?\d[\d\s().-]{5,}\d")

Value = str | float | int | bool | list[str]


class DimensionValue(StrictModel):
    """One preference dimension of a profile: a value and how sure we are of it."""

    value: Value = Field(description="The preference (a category, a number, or a list of tags).")
    confidence: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="How sure the profile is of this value, in [0, 1]. Default 1.0 (stated by "
        "the user). Values below the constitution's threshold fall back to the clause default.",
    )


class ClauseOverride(StrictModel):
    """A user's explicit choice about one theorem (never an axiom: those are red lines)."""

    enabled: bool = Field(True, description="False turns the theorem off for this user.")
    params: dict[str, Value] = Field(
        default_factory=dict, description="Parameter values the user chose, e.g. max_words: 40."
    )


class Profile(StrictModel):
    """What the kit knows about one diner. Fields in `PII_FIELDS` are personal identifiers."""

    id: str = Field(min_length=1, max_length=200, description="The profile's own id (may be PII).")
    name: str | None = Field(None, description="PII. Never leaves this object; see `redact`.")
    phone: str | None = Field(None, description="PII.")
    email: str | None = Field(None, description="PII.")
    address: str | None = Field(None, description="PII.")
    notes: str | None = Field(None, description="PII: free text, dropped by `redact`.")
    dimensions: dict[str, DimensionValue] = Field(
        default_factory=dict,
        description="Preference dimensions. `verbosity: brief` is short for "
        "`verbosity: {value: brief, confidence: 1.0}`.",
        json_schema_extra=admit_shorthand(
            {"type": ["string", "number", "boolean"]},
            {"type": "array", "items": {"type": "string"}},
        ),
    )
    overrides: dict[str, ClauseOverride] = Field(
        default_factory=dict, description="Per-theorem choices of this user, by clause id."
    )

    @field_validator("dimensions", mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {
                k: (x if isinstance(x, dict | DimensionValue) else {"value": x})
                for k, x in v.items()
            }
        return v

    def redacted(self, salt: str | None = None) -> RedactedProfile:
        return redact(self, salt)


class RedactedProfile(StrictModel):
    """A profile with every personal identifier removed or masked; safe to log and prompt with."""

    pseudonym: str = Field(description="Keyed hash of the profile id: stable, not reversible.")
    dimensions: dict[str, DimensionValue] = Field(default_factory=dict)
    overrides: dict[str, ClauseOverride] = Field(default_factory=dict)
    masked: int = Field(0, description="How many PII fragments were masked inside values.")

    @model_validator(mode="after")
    def _no_raw_ids(self) -> RedactedProfile:
        if not self.pseudonym.startswith("diner-"):
            raise ValueError("pseudonym must come from redact(); build RedactedProfile with it")
        return self

    @property
    def hash(self) -> str:
        """Content hash of the redacted profile (12 hex digits)."""
        blob = json.dumps(self.model_dump(mode="json", exclude={"masked"}), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def value(self, dim: str, default: Any = None) -> Any:
        return self.dimensions[dim].value if dim in self.dimensions else default


def pseudonym(profile_id: str, salt: str | None = None) -> str:
    """Stable pseudonym for a profile id: HMAC-SHA256 keyed by the salt, 10 hex digits."""
    key = (salt or os.environ.get("KITCHEN_PSEUDONYM_SALT") or DEFAULT_SALT).encode()
    return "diner-" + hmac.new(key, profile_id.encode(), hashlib.sha256).hexdigest()[:10]


def mask_text(text: str, identifiers: list[str] = ()) -> tuple[str, int]:
    """Mask e-mails, phone numbers and the given identifiers in `text`; returns (text, count)."""
    count = 0

    def sub(pattern: re.Pattern, token: str, s: str) -> str:
        nonlocal count
        s, n = pattern.subn(token, s)
        count += n
        return s

    text = sub(EMAIL_RE, "[email]", text)
    text = sub(PHONE_RE, "[phone]", text)
    for ident in sorted(
        {i for i in identifiers if i and len(i.strip()) >= 3}, key=len, reverse=True
    ):
        text = sub(
            re.compile(rf"(?<!\w){re.escape(ident.strip())}(?!\w)", re.IGNORECASE), "[pii]", text
        )
    return text, count


def redact(profile: Profile, salt: str | None = None) -> RedactedProfile:
    """Remove or pseudonymise every personal identifier of `profile`.

    Identifying fields are dropped, the id becomes a pseudonym, and PII found inside string values
    (e-mails, phone numbers, the diner's own name/phone/e-mail/address/id) is masked.
    """
    idents = [
        profile.id,
        profile.name or "",
        profile.phone or "",
        profile.email or "",
        profile.address or "",
    ]
    idents += (profile.name or "").split()  # first and last names on their own
    masked = 0

    def clean(v: Value) -> Value:
        nonlocal masked
        if isinstance(v, str):
            v, n = mask_text(v, idents)
            masked += n
        elif isinstance(v, list):
            v = [clean(x) for x in v]
        return v

    dims = {
        k: DimensionValue(value=clean(d.value), confidence=d.confidence)
        for k, d in profile.dimensions.items()
    }
    overrides = {
        k: ClauseOverride(enabled=o.enabled, params={p: clean(x) for p, x in o.params.items()})
        for k, o in profile.overrides.items()
    }
    return RedactedProfile(
        pseudonym=pseudonym(profile.id, salt), dimensions=dims, overrides=overrides, masked=masked
    )


def load_profile(path: str | os.PathLike) -> Profile:
    """Load one profile YAML file (errors name file, line and field)."""
    return validate_doc(Profile, read_yaml(path))


def load_profiles(folder: str | os.PathLike) -> list[Profile]:
    """Load every `*.yaml` profile in `folder`, sorted by file name. A missing or empty folder
    and an id used by two files are errors; every problem of every file is reported at once."""
    from pathlib import Path

    folder = Path(folder)
    if not folder.is_dir():
        raise KitchenError([Problem(str(folder), None, "folder", "no such folder of profiles")])
    out: list[Profile] = []
    problems: list[Problem] = []
    first: dict[str, Path] = {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            doc = read_yaml(path)
            profile = validate_doc(Profile, doc)
        except KitchenError as e:
            problems += e.problems
            continue
        if profile.id in first:
            problems.append(
                doc.problem(
                    ("id",),
                    f"id {profile.id!r} is also the id of {first[profile.id].name}; "
                    "every profile needs its own id",
                )
            )
            continue
        first[profile.id] = path
        out.append(profile)
    if problems:
        raise KitchenError(problems)
    if not out:
        raise KitchenError(
            [Problem(str(folder), None, "folder", "no *.yaml profiles in it; add one per diner")]
        )
    return out


def split_profiles(split: str, folder: str | os.PathLike | None = None) -> list[Profile]:
    """The profiles of one split of `data/splits.yaml` (`train` or `heldout`), in file order.
    A split that is missing or empty, or names an id no profile has, is a located error."""
    from kitchen import paths

    splits = paths.DATA / "splits.yaml"
    doc = read_yaml(splits)
    key = f"{split}_profiles"
    ids = doc.data.get(key) if isinstance(doc.data, dict) else None
    if not isinstance(ids, list) or not ids:
        raise KitchenError(
            [
                doc.problem(
                    (key,),
                    f"no {split} profiles: give `{key}: [id, ...]` (ids of {paths.PROFILES})",
                )
            ]
        )
    profiles = {p.id: p for p in load_profiles(folder or paths.PROFILES)}
    unknown = [i for i in ids if i not in profiles]
    if unknown:
        raise KitchenError(
            [
                doc.problem(
                    (key, ids.index(u)), f"no profile has id {u!r}; known: {', '.join(profiles)}"
                )
                for u in unknown
            ]
        )
    return [p for p in profiles.values() if p.id in ids]


#: How many tags (e.g. allergies) a synthetic diner holds: 0, 1, 2 or 3, with these weights.
TAG_COUNTS = (0.3, 0.35, 0.25, 0.1)


def variant(
    profile: Profile,
    constitution: Any,
    rng: Any,
    avoid: Sequence[frozenset[str]] = (),
) -> Profile:
    """A synthetic diner drawn around `profile`: every dimension the constitution declares is
    redrawn (a category uniformly from its values, a tag list of 0–3 distinct values with
    weights `TAG_COUNTS`, a number uniformly in its range), the overrides are kept, identifiers
    are dropped and the id says where it came from (`<id>~<8 hex>`). Tag lists in `avoid` are
    never drawn (pass the held-out diners' allergy sets, so that a reviewer trained on variants
    still meets those combinations first at evaluation).

    Why (docs/method.md#grm-training): eighteen training diners hold only three two-allergy
    combinations, and a reviewer trained on them learns the combinations, not to read the list
    (the tiny GRM wrote `avoid gluten` for a gluten-and-soy diner and missed its soy dishes)."""
    banned = set(avoid)
    dims: dict[str, DimensionValue] = {}
    for name, dim in constitution.dimensions.items():
        if dim.kind == "category":
            value: Any = rng.choice(dim.values)
        elif dim.kind == "tags":
            while True:
                k = rng.choices(range(len(TAG_COUNTS)), weights=TAG_COUNTS)[0]
                value = sorted(rng.sample(dim.values, min(k, len(dim.values))))
                if frozenset(value) not in banned:
                    break
        else:
            value = rng.uniform(dim.min, dim.max)
        dims[name] = DimensionValue(value=value)
    return Profile(
        id=f"{profile.id}~{rng.getrandbits(32):08x}",
        dimensions=dims,
        overrides=profile.overrides,
    )
