"""The constitution DSL: axioms, theorems derived from them, and personalisation per user.

The reward rests on a two-layer rule system (docs/method.md#constitution):

- **axioms** — a few global red lines (safety, privacy, honesty). The same for every user;
  personalisation may never change them.
- **theorems** — scenario rules derived from one or more axioms (`derives_from`), so every verdict
  the reward model gives can be traced to a principle. A theorem may apply only to some users
  (`applies_when: verbosity == brief`) and may take parameters from the profile
  (`max_words` from verbosity).

`personalize(constitution, profile)` instantiates the theorems for one user into a
`PersonalConstitution`: axioms unchanged, parameters filled from the (redacted) profile, and a
dimension whose confidence is below `confidence_threshold` falling back to the clause's default —
the method's guard against amplifying profile noise (docs/method.md#personalisation). It is
deterministic and versioned by a content hash; `PersonalizationCache` caches it per (constitution
version, profile), and a changed profile replaces exactly its own entry (cache and version per
user, regenerate only when the profile changes).

Departures from the method (docs/method.md#constitution):
1. Conditions are conjunctions of tests on *category* dimensions (`==`, `!=`, `in`, `not in`,
   joined by `and`). That keeps "can these two theorems hold at once?" exactly decidable, which is
   what conflict detection needs; richer logic would make it a SAT problem.
2. Contradictions are detected for `min_<q>` / `max_<q>` parameter pairs (e.g. `min_words` 50 with
   `max_words` 10) over every profile both theorems can apply to, fallbacks included. Other kinds
   of contradiction between free-text rules cannot be decided mechanically.
3. A dimension may set `fallback: false`: for allergies, ignoring a low-confidence value is less
   safe than honouring it, so such a value is used whatever its confidence.
4. Users may switch a theorem off or set its parameters (`overrides` in the profile) — never an
   axiom's: that raises an error instead of silently weakening a red line.
5. A theorem may not outweigh the axioms it derives from (axioms weigh more:
   docs/method.md#rewards).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import string
from collections import OrderedDict
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from kitchen.config import (
    KitchenError,
    Loc,
    Located,
    Problem,
    StrictModel,
    admit_shorthand,
    parse_yaml,
    read_yaml,
    validate_doc,
    where,
)
from kitchen.profile import Profile, RedactedProfile, redact

if TYPE_CHECKING:
    import polars as pl

ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$"
Scalar = int | float | str | bool
FORBIDDEN_THEOREM_KEYS = ("overrides", "replaces", "disables", "supersedes")


def _replace(schema: dict[str, Any], new: dict[str, Any]) -> None:
    """For `json_schema_extra`: swap a field's generated schema for one that admits shorthands."""
    keep = {k: schema[k] for k in ("description", "title", "default") if k in schema}
    schema.clear()
    schema.update(keep | new)


class Category(StrEnum):
    """What kind of red line an axiom draws."""

    safety = "safety"
    privacy = "privacy"
    honesty = "honesty"
    respect = "respect"
    fairness = "fairness"
    legality = "legality"
    other = "other"


class Dimension(StrictModel):
    """A profile dimension the constitution understands (e.g. verbosity)."""

    kind: Literal["category", "tags", "number"] = Field(
        "category",
        description="category: one value from `values`; tags: a list of values (e.g. allergies); "
        "number: a number in [min, max]. Default category.",
    )
    values: list[str] = Field(
        default_factory=list, description="Allowed values (category and tags dimensions)."
    )
    min: float | None = Field(None, description="Smallest allowed value (number dimensions).")
    max: float | None = Field(None, description="Largest allowed value (number dimensions).")
    default: Scalar | list[str] | None = Field(
        None,
        description="Value used when a profile lacks this dimension or is unsure of it. "
        "Required for category dimensions; tags default to [] and numbers to `min`.",
    )
    fallback: bool = Field(
        True,
        description="Fall back to the default when confidence is below the threshold. Set "
        "false where ignoring a doubtful value is unsafe (allergies). Default true.",
    )
    description: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Dimension:
        if self.kind in ("category", "tags") and not self.values:
            raise ValueError(f"a {self.kind} dimension needs `values`: the list of allowed values")
        if self.kind == "category" and self.default not in self.values:
            raise ValueError(f"default {self.default!r} must be one of its values {self.values}")
        if self.kind == "tags":
            self.default = list(self.default or [])
            bad = [v for v in self.default if v not in self.values]
            if bad:
                raise ValueError(f"default tags {bad} are not among its values {self.values}")
        if self.kind == "number":
            if self.min is None or self.max is None or self.min > self.max:
                raise ValueError("a number dimension needs `min` <= `max`")
            if self.default is None:
                self.default = self.min
        return self

    def domain(self) -> list[Any]:
        """Values a condition or parameter map can see (numbers: their range's ends and default)."""
        if self.kind == "number":
            return sorted({self.min, self.max, self.default})
        return list(self.values)


_TEST_RE = re.compile(
    r"^\s*(?P<dim>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>==|!=|\bnot\s+in\b|\bin\b)\s*(?P<rhs>.+?)\s*$"
)


class Test(StrictModel):
    """One test of a condition: `dimension` is (or, negated, is not) one of `values`."""

    dimension: str
    values: list[str] = Field(min_length=1)
    negate: bool = False

    def holds(self, value: Any) -> bool:
        return (str(value) in self.values) != self.negate

    def __str__(self) -> str:
        if len(self.values) == 1:
            return f"{self.dimension} {'!=' if self.negate else '=='} {self.values[0]}"
        return f"{self.dimension} {'not in' if self.negate else 'in'} [{', '.join(self.values)}]"


def parse_condition(text: str) -> list[Test]:
    """`"verbosity == brief and pace in [hurried]"` → two `Test`s (a conjunction)."""
    tests = []
    for part in re.split(r"\band\b", text):
        m = _TEST_RE.match(part)
        if not m:
            raise ValueError(
                f"cannot read condition {part.strip()!r}: write tests like `verbosity == brief`, "
                "`pace != hurried` or `verbosity in [brief, normal]`, joined by `and`"
            )
        op, rhs = " ".join(m["op"].split()), m["rhs"].strip()
        if op in ("in", "not in"):
            if not (rhs.startswith("[") and rhs.endswith("]")):
                raise ValueError(f"`{op}` needs a list like [brief, normal], got {rhs!r}")
            values = [v.strip().strip("'\"") for v in rhs[1:-1].split(",") if v.strip()]
        else:
            values = [rhs.strip("'\"")]
        tests.append(Test(dimension=m["dim"], values=values, negate=op in ("!=", "not in")))
    return tests


class Param(StrictModel):
    """A theorem parameter: a default, optionally filled from a profile dimension."""

    default: Scalar = Field(description="Value used when no profile value applies.")
    from_: str | None = Field(
        None, alias="from", description="Profile dimension that fills this parameter."
    )
    map: dict[str, Scalar] | None = Field(
        None,
        description="Dimension value → parameter value (category dimensions). Values not "
        "listed use the default. Without a map, the dimension's value is used as is.",
    )
    description: str = ""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return v if isinstance(v, dict) else {"default": v}


class Axiom(StrictModel):
    """A global red line: the same for every user, never personalised."""

    id: str = Field(pattern=ID_PATTERN, description="Short id cited by verdicts, e.g. A1.")
    text: str = Field(min_length=3, max_length=1000)
    weight: float = Field(3.0, gt=0, le=10, description="Weight in the local reward. Default 3.")
    category: Category = Field(description="safety, privacy, honesty, respect, fairness, ...")

    @model_validator(mode="before")
    @classmethod
    def _no_personal_fields(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in ("applies_when", "params", "derives_from"):
                if key in v:
                    raise ValueError(
                        f"axioms cannot have `{key}`: they apply to every user unchanged; "
                        "put this rule in a theorem that derives from the axiom"
                    )
        return v


class Theorem(StrictModel):
    """A scenario rule derived from axioms, optionally conditional and parameterised."""

    id: str = Field(pattern=ID_PATTERN, description="Short id cited by verdicts, e.g. T3.")
    text: str = Field(
        min_length=3,
        max_length=1000,
        description="The rule; `{param}` placeholders are filled per user, e.g. "
        "'Keep each message within {max_words} words.'",
    )
    weight: float = Field(1.0, gt=0, le=10, description="Weight in the local reward. Default 1.")
    derives_from: list[str] = Field(
        min_length=1, description="Axiom (or theorem) ids this rule follows from. Required."
    )
    applies_when: list[Test] = Field(
        default_factory=list,
        description="Condition on category dimensions, e.g. 'verbosity == brief'. Empty: always.",
        json_schema_extra=lambda s: _replace(
            s,
            {
                "anyOf": [
                    {"type": "string", "examples": ["verbosity == brief and pace in [hurried]"]},
                    {
                        "type": "object",
                        "additionalProperties": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "string"}},
                            ]
                        },
                    },
                    {
                        "type": "array",
                        "items": {"anyOf": [{"type": "string"}, {"type": "object"}]},
                    },
                ]
            },
        ),
    )
    params: dict[str, Param] = Field(
        default_factory=dict,
        description="Parameters by name: a plain default (`min_words: 12`) or a `Param`.",
        json_schema_extra=admit_shorthand({"type": ["string", "number", "boolean"]}),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_axiom_override(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in FORBIDDEN_THEOREM_KEYS:
                if key in v:
                    raise ValueError(
                        f"theorems cannot `{key}` anything: axioms are red lines and a theorem "
                        f"may only refine them; remove `{key}` and narrow the theorem's "
                        "`applies_when` instead"
                    )
        return v

    @field_validator("applies_when", mode="before")
    @classmethod
    def _parse_condition(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return parse_condition(v)
        if isinstance(v, dict) and "dimension" not in v:
            return [
                {"dimension": k, "values": x if isinstance(x, list) else [x]} for k, x in v.items()
            ]
        if isinstance(v, list):
            return [t for x in v for t in (parse_condition(x) if isinstance(x, str) else [x])]
        return v

    def condition_text(self) -> str:
        return " and ".join(str(t) for t in self.applies_when) or "always"


class Constitution(StrictModel):
    """A whole constitution: dimensions it understands, axioms and theorems."""

    name: str = Field(min_length=1, max_length=100)
    description: str = ""
    revision: str = Field("1", description="Authors' label. The real version is a content hash.")
    confidence_threshold: float = Field(
        0.6,
        ge=0,
        le=1,
        description="Profile values less sure than this fall back to clause "
        "defaults (docs/method.md#personalisation: guard against profile noise). Default 0.6.",
    )
    dimensions: dict[str, Dimension] = Field(default_factory=dict)
    axioms: list[Axiom] = Field(min_length=1)
    theorems: list[Theorem] = Field(default_factory=list)

    @property
    def version(self) -> str:
        """Content hash of the constitution (12 hex digits): any edit gives a new version."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def clause_ids(self) -> list[str]:
        return [a.id for a in self.axioms] + [t.id for t in self.theorems]

    def clause(self, clause_id: str) -> Axiom | Theorem:
        for c in itertools.chain(self.axioms, self.theorems):
            if c.id == clause_id:
                return c
        raise KeyError(f"no clause {clause_id!r} in constitution {self.name!r}")

    def roots(self, clause_id: str) -> list[str]:
        """The axiom ids a clause traces back to (itself, for an axiom)."""
        axioms = {a.id for a in self.axioms}
        theorems = {t.id: t for t in self.theorems}
        out, stack, seen = [], [clause_id], set()
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            if c in axioms:
                out.append(c)
            elif c in theorems:
                stack.extend(theorems[c].derives_from)
        return sorted(out)


# ---------------------------------------------------------------------------------------------
# Checks that need the whole constitution (pydantic checks each field on its own).


def check(c: Constitution) -> list[tuple[Loc, str]]:
    """Every cross-field problem of `c`, each as (location, message with how to fix it)."""
    out: list[tuple[Loc, str]] = []
    seen: dict[str, Loc] = {}
    for kind, clauses in (("axioms", c.axioms), ("theorems", c.theorems)):
        for i, cl in enumerate(clauses):
            if cl.id in seen:
                out.append(
                    (
                        (kind, i, "id"),
                        f"duplicate id '{cl.id}' (also at {where(seen[cl.id])}); "
                        "give every clause its own id",
                    )
                )
            else:
                seen[cl.id] = (kind, i)
    axioms = {a.id: a for a in c.axioms}
    theorems = {t.id: t for t in c.theorems}
    for i, t in enumerate(c.theorems):
        loc = ("theorems", i)
        for j, ref in enumerate(t.derives_from):
            if ref not in axioms and ref not in theorems:
                out.append(
                    (
                        loc + ("derives_from", j),
                        f"unknown clause '{ref}'; derive from one of {', '.join(c.clause_ids)}",
                    )
                )
            elif ref == t.id:
                out.append((loc + ("derives_from", j), "a theorem cannot derive from itself"))
        out += _check_condition(c, t, loc)
        out += _check_params(c, t, loc)
        for name in sorted(_placeholders(t.text) - set(t.params)):
            out.append(
                (
                    loc + ("text",),
                    f"placeholder {{{name}}} has no parameter; add "
                    f"`params: {{{name}: <default>}}` or remove it from the text",
                )
            )
        for root in c.roots(t.id):
            if t.weight > axioms[root].weight:
                out.append(
                    (
                        loc + ("weight",),
                        f"weight {t.weight} exceeds axiom {root}'s weight "
                        f"{axioms[root].weight}; axioms weigh at least as much as their theorems",
                    )
                )
    out += _check_cycles(c)
    if not out:  # conflict detection assumes every reference resolves
        out += _check_conflicts(c)
    return out


def _placeholders(text: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(text) if f}
    except ValueError:
        return set()


def _check_condition(c: Constitution, t: Theorem, loc: Loc) -> list[tuple[Loc, str]]:
    out = []
    for k, test in enumerate(t.applies_when):
        tloc = loc + ("applies_when", k)
        dim = c.dimensions.get(test.dimension)
        if dim is None:
            out.append(
                (
                    tloc,
                    f"condition on unknown dimension '{test.dimension}'; declare it under "
                    f"`dimensions:` or use one of {', '.join(c.dimensions) or '(none declared)'}",
                )
            )
        elif dim.kind != "category":
            out.append(
                (
                    tloc,
                    f"conditions work on category dimensions only; "
                    f"'{test.dimension}' is a {dim.kind} dimension",
                )
            )
        else:
            for v in test.values:
                if v not in dim.values:
                    out.append(
                        (
                            tloc,
                            f"'{v}' is not a value of '{test.dimension}'; "
                            f"use one of {', '.join(dim.values)}",
                        )
                    )
    return out


def _check_params(c: Constitution, t: Theorem, loc: Loc) -> list[tuple[Loc, str]]:
    out = []
    for name, p in t.params.items():
        ploc = loc + ("params", name)
        if p.from_ is None:
            if p.map:
                out.append((ploc + ("map",), "a `map` needs `from: <dimension>`"))
            continue
        dim = c.dimensions.get(p.from_)
        if dim is None:
            out.append(
                (
                    ploc + ("from",),
                    f"parameter bound to unknown dimension '{p.from_}'; "
                    f"use one of {', '.join(c.dimensions) or '(none declared)'}",
                )
            )
            continue
        for key in p.map or {}:
            if dim.kind == "number" or key not in dim.values:
                out.append(
                    (
                        ploc + ("map", key),
                        f"'{key}' is not a value of '{p.from_}'; "
                        f"use one of {', '.join(map(str, dim.domain()))}",
                    )
                )
        if dim.kind == "tags":
            out.append(
                (
                    ploc + ("from",),
                    f"'{p.from_}' is a tags dimension; parameters can be "
                    "filled from category or number dimensions",
                )
            )
    return out


def _check_cycles(c: Constitution) -> list[tuple[Loc, str]]:
    theorems = {t.id: (i, t) for i, t in enumerate(c.theorems)}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    out = []

    def visit(tid: str, path: list[str]) -> None:
        state[tid] = 1
        for ref in theorems[tid][1].derives_from:
            if ref not in theorems:
                continue
            if state.get(ref) == 1:
                cycle = path[path.index(ref) :] + [ref] if ref in path else [tid, ref]
                out.append(
                    (
                        ("theorems", theorems[ref][0], "derives_from"),
                        f"derivation cycle {' -> '.join(cycle)}; every chain must end at an axiom",
                    )
                )
            elif ref not in state:
                visit(ref, path + [ref])
        state[tid] = 2

    for tid in theorems:
        if tid not in state:
            visit(tid, [tid])
    return out


_FALLBACK = object()  # a dimension too uncertain to use: conditions see the default, params too


def _check_conflicts(c: Constitution) -> list[tuple[Loc, str]]:
    """min_<q> > max_<q> for some profile where both theorems apply."""
    out = []
    bounds = [
        (i, t, name[4:], name[:3])
        for i, t in enumerate(c.theorems)
        for name in t.params
        if name[:4] in ("min_", "max_")
    ]
    for (_i, a, qa, ka), (j, b, qb, kb) in itertools.product(bounds, bounds):
        if qa != qb or ka != "min" or kb != "max":
            continue
        pa, pb = a.params[f"min_{qa}"], b.params[f"max_{qb}"]
        dims = sorted(
            {x.dimension for x in a.applies_when + b.applies_when}
            | {p.from_ for p in (pa, pb) if p.from_ in c.dimensions}
        )
        domains = [
            c.dimensions[d].domain() + ([_FALLBACK] if c.dimensions[d].fallback else [])
            for d in dims
            if d in c.dimensions
        ]
        for combo in itertools.product(*domains):
            values = dict(zip(dims, combo, strict=False))
            if not (_applies(c, a, values) and _applies(c, b, values)):
                continue
            lo, hi = _resolve(pa, values), _resolve(pb, values)
            if _num(lo) is not None and _num(hi) is not None and _num(lo) > _num(hi):
                shown = (
                    ", ".join(
                        f"{d}={'(low confidence)' if v is _FALLBACK else v}"
                        for d, v in values.items()
                    )
                    or "every profile"
                )
                out.append(
                    (
                        ("theorems", j, "params", f"max_{qb}"),
                        f"conflicts with {a.id}: min_{qa}={lo} > max_{qb}={hi} when {shown}; "
                        "change a bound or make the conditions exclusive",
                    )
                )
                break
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _same_kind(value: Any, default: Any) -> bool:
    if _num(default) is not None:
        return _num(value) is not None
    return type(value) is type(default)


def _effective(c: Constitution, dim: str, v: Any) -> Any:
    return c.dimensions[dim].default if v is _FALLBACK else v


def _applies(c: Constitution, t: Theorem, values: dict[str, Any]) -> bool:
    return all(
        x.holds(_effective(c, x.dimension, values.get(x.dimension, _FALLBACK)))
        for x in t.applies_when
    )


def _resolve(p: Param, values: dict[str, Any]) -> Scalar:
    v = values.get(p.from_, _FALLBACK) if p.from_ else _FALLBACK
    if v is _FALLBACK:
        return p.default
    if p.map is not None:
        return p.map.get(str(v), p.default)
    return v


# ---------------------------------------------------------------------------------------------
# Loading


def from_doc(doc: Located) -> Constitution:
    """Validate parsed YAML as a constitution; `KitchenError` lists every located problem."""
    c = validate_doc(Constitution, doc)
    problems = check(c)
    if problems:
        raise KitchenError([doc.problem(loc, msg) for loc, msg in problems])
    return c


def load_constitution(path: str | os.PathLike) -> Constitution:
    """Load and fully check a constitution YAML file."""
    return from_doc(read_yaml(path))


def parse_constitution(text: str, path: str = "<string>") -> Constitution:
    """Load and fully check a constitution from YAML text."""
    return from_doc(parse_yaml(text, path))


# ---------------------------------------------------------------------------------------------
# Personalisation


class PersonalClause(BaseModel):
    """One clause as it applies to one user."""

    id: str
    kind: Literal["axiom", "theorem"]
    text: str = Field(description="The rule with this user's parameters filled in.")
    weight: float
    category: str = Field(description="The axiom's category (for a theorem: its roots').")
    derives_from: list[str] = Field(default_factory=list)
    roots: list[str] = Field(default_factory=list, description="Axioms it traces back to.")
    params: dict[str, Scalar] = Field(default_factory=dict)
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="Where each parameter came from: default, profile, fallback or override.",
    )


class Fallback(BaseModel):
    """A dimension the personalisation did not trust (or did not have)."""

    dimension: str
    used: Any
    reason: str


class PersonalConstitution(BaseModel):
    """A constitution instantiated for one (redacted) profile."""

    constitution: str
    constitution_version: str
    profile: str = Field(description="The profile's pseudonym (never its raw id).")
    profile_hash: str
    version: str = Field(description="Hash of (constitution version, redacted profile).")
    confidence_threshold: float
    dimensions: dict[str, Any] = Field(
        description="Effective dimension values used (after fallbacks)."
    )
    clauses: list[PersonalClause]
    inactive: list[str] = Field(
        default_factory=list,
        description="Theorems whose condition does not hold, or switched off by the user.",
    )
    fallbacks: list[Fallback] = Field(default_factory=list)

    def clause(self, clause_id: str) -> PersonalClause:
        for cl in self.clauses:
            if cl.id == clause_id:
                return cl
        raise KeyError(
            f"clause {clause_id!r} is not active in personal constitution {self.version}"
        )

    @property
    def ids(self) -> list[str]:
        return [cl.id for cl in self.clauses]

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def check_profile(c: Constitution, profile: Profile | RedactedProfile) -> list[tuple[Loc, str]]:
    """Problems of a profile against a constitution: unknown dimensions, bad values, axiom overrides."""
    import difflib

    out: list[tuple[Loc, str]] = []
    for name, dv in profile.dimensions.items():
        loc: Loc = ("dimensions", name)
        dim = c.dimensions.get(name)
        if dim is None:
            close = difflib.get_close_matches(name, list(c.dimensions), n=1)
            hint = (
                f"did you mean '{close[0]}'?"
                if close
                else f"known: {', '.join(c.dimensions) or '(none)'}"
            )
            out.append((loc, f"constitution '{c.name}' has no dimension '{name}'; {hint}"))
            continue
        v = dv.value
        if dim.kind == "category" and (not isinstance(v, str) or v not in dim.values):
            out.append(
                (
                    loc + ("value",),
                    f"{v!r} is not a value of '{name}'; use one of {', '.join(dim.values)}",
                )
            )
        elif dim.kind == "tags":
            bad = [x for x in (v if isinstance(v, list) else [v]) if x not in dim.values]
            if not isinstance(v, list) or bad:
                out.append(
                    (
                        loc + ("value",),
                        f"'{name}' takes a list of {', '.join(dim.values)}; not {bad or v!r}",
                    )
                )
        elif dim.kind == "number" and (_num(v) is None or not dim.min <= float(v) <= dim.max):
            out.append(
                (loc + ("value",), f"'{name}' takes a number in [{dim.min}, {dim.max}], got {v!r}")
            )
    theorems = {t.id: t for t in c.theorems}
    for cid, ov in profile.overrides.items():
        loc = ("overrides", cid)
        if cid in {a.id for a in c.axioms}:
            out.append(
                (
                    loc,
                    f"'{cid}' is an axiom: a red line that no profile may override; "
                    "remove this override",
                )
            )
        elif cid not in theorems:
            out.append((loc, f"unknown theorem '{cid}'; use one of {', '.join(theorems)}"))
        else:
            for p in ov.params:
                if p not in theorems[cid].params:
                    out.append(
                        (
                            loc + ("params", p),
                            f"theorem {cid} has no parameter '{p}'; "
                            f"it has {', '.join(theorems[cid].params) or 'none'}",
                        )
                    )
                elif not _same_kind(ov.params[p], theorems[cid].params[p].default):
                    default = theorems[cid].params[p].default
                    out.append(
                        (
                            loc + ("params", p),
                            f"{ov.params[p]!r} does not fit parameter '{p}' of {cid}; "
                            f"give a {type(default).__name__} like its default {default!r}",
                        )
                    )
    return out


def personalize(c: Constitution, profile: Profile | RedactedProfile) -> PersonalConstitution:
    """Instantiate `c` for one profile (redacted first, so no PII can reach the result).

    Axioms are copied unchanged. Each dimension's effective value is the profile's when its
    confidence reaches `c.confidence_threshold` (or the dimension has `fallback: false`), else the
    dimension's default, and the fallback is recorded. Theorems whose condition fails on the
    effective values are listed as inactive; the others get their parameters from the map, the
    user's override, or their default — every source recorded.
    """
    rp = redact(profile) if isinstance(profile, Profile) else profile
    problems = check_profile(c, rp)
    if problems:
        raise KitchenError(
            [Problem(f"profile {rp.pseudonym}", None, where(loc), msg) for loc, msg in problems]
        )
    effective: dict[str, Any] = {}
    trusted: dict[str, bool] = {}
    fallbacks = []
    for name, dim in c.dimensions.items():
        dv = rp.dimensions.get(name)
        if dv is None:
            effective[name], trusted[name] = dim.default, False
            fallbacks.append(Fallback(dimension=name, used=dim.default, reason="not in profile"))
        elif dv.confidence < c.confidence_threshold and dim.fallback:
            effective[name], trusted[name] = dim.default, False
            fallbacks.append(
                Fallback(
                    dimension=name,
                    used=dim.default,
                    reason=f"confidence {dv.confidence:.2f} < threshold {c.confidence_threshold:.2f}",
                )
            )
        else:
            effective[name], trusted[name] = dv.value, True

    clauses = [
        PersonalClause(
            id=a.id,
            kind="axiom",
            text=a.text,
            weight=a.weight,
            category=a.category.value,
            roots=[a.id],
        )
        for a in c.axioms
    ]
    inactive = []
    categories = {a.id: a.category.value for a in c.axioms}
    for t in c.theorems:
        ov = rp.overrides.get(t.id)
        if (ov is not None and not ov.enabled) or not all(
            x.holds(effective[x.dimension]) for x in t.applies_when
        ):
            inactive.append(t.id)
            continue
        params, sources = {}, {}
        for name, p in t.params.items():
            if ov is not None and name in ov.params:
                params[name], sources[name] = ov.params[name], "override"
            elif p.from_ and trusted.get(p.from_):
                params[name] = _resolve(p, {p.from_: effective[p.from_]})
                sources[name] = f"profile:{p.from_}={effective[p.from_]}"
            elif p.from_:
                params[name], sources[name] = p.default, f"fallback:{p.from_}"
            else:
                params[name], sources[name] = p.default, "default"
        roots = c.roots(t.id)
        clauses.append(
            PersonalClause(
                id=t.id,
                kind="theorem",
                text=t.text.format(**params),
                weight=t.weight,
                category=_category(c, t, categories),
                derives_from=list(t.derives_from),
                roots=roots,
                params=params,
                sources=sources,
            )
        )
    cv = c.version
    ph = rp.hash
    return PersonalConstitution(
        constitution=c.name,
        constitution_version=cv,
        profile=rp.pseudonym,
        profile_hash=ph,
        version=hashlib.sha256(f"{cv}:{ph}".encode()).hexdigest()[:12],
        confidence_threshold=c.confidence_threshold,
        dimensions=effective,
        clauses=clauses,
        inactive=inactive,
        fallbacks=fallbacks,
    )


def _category(c: Constitution, t: Theorem, categories: dict[str, str]) -> str:
    """A theorem's category is that of the axiom behind its first parent."""
    roots = c.roots(t.derives_from[0])
    return categories[roots[0]] if roots else "other"


class PersonalizationCache:
    """Personal constitutions cached per (constitution version, profile), in memory and optionally on disk.

    The key is (constitution version, pseudonym); the entry remembers the profile hash it was built
    from. A changed profile (same pseudonym, new hash) replaces exactly that entry; an edited
    constitution has a new version, so its entries are new keys.
    """

    def __init__(self, maxsize: int = 4096, folder: str | os.PathLike | None = None):
        self.maxsize = maxsize
        self.folder = Path(folder) if folder else None
        self._entries: OrderedDict[tuple[str, str], PersonalConstitution] = OrderedDict()
        self.hits = self.misses = self.invalidations = 0

    def get(self, c: Constitution, profile: Profile | RedactedProfile) -> PersonalConstitution:
        rp = redact(profile) if isinstance(profile, Profile) else profile
        key = (c.version, rp.pseudonym)
        pc = self._entries.get(key) or self._read_disk(key)
        if pc is not None and pc.profile_hash == rp.hash:
            self.hits += 1
            self._entries[key] = pc
            self._entries.move_to_end(key)
            return pc
        if pc is not None:
            self.invalidations += 1
        self.misses += 1
        pc = personalize(c, rp)
        self._entries[key] = pc
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        if self.folder:
            from kitchen.files import atomic_write_text

            atomic_write_text(self._disk_path(key), pc.model_dump_json())
        return pc

    def _disk_path(self, key: tuple[str, str]) -> Path:
        return self.folder / f"{key[0]}-{key[1]}.json"

    def _read_disk(self, key: tuple[str, str]) -> PersonalConstitution | None:
        if not self.folder or not self._disk_path(key).exists():
            return None
        try:
            return PersonalConstitution.model_validate_json(self._disk_path(key).read_text())
        except ValueError:  # a corrupt cache file is a miss, not a crash
            return None

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------------
# Rendering


def render_text(pc: PersonalConstitution) -> str:
    """The personal constitution as plain text for a reward-model prompt; each clause cites its id."""
    lines = [f"Personal constitution {pc.version} ({pc.constitution}@{pc.constitution_version})"]
    lines.append("Axioms (red lines, the same for every diner):")
    lines += [
        f"[{cl.id}] {cl.category}, weight {cl.weight:g}: {cl.text}"
        for cl in pc.clauses
        if cl.kind == "axiom"
    ]
    lines.append("Theorems (for this diner):")
    lines += [
        f"[{cl.id}] from {', '.join(cl.derives_from)}, weight {cl.weight:g}: {cl.text}"
        for cl in pc.clauses
        if cl.kind == "theorem"
    ]
    return "\n".join(lines)


def to_frame(pc: PersonalConstitution) -> pl.DataFrame:
    """One row per active clause (polars; imported here, not at module import)."""
    import polars as pl

    return pl.DataFrame(
        [
            {
                "id": cl.id,
                "kind": cl.kind,
                "category": cl.category,
                "weight": cl.weight,
                "derives_from": ", ".join(cl.derives_from),
                "text": cl.text,
                "params": json.dumps(cl.params, sort_keys=True),
                "sources": ", ".join(f"{k}<-{v}" for k, v in cl.sources.items()),
            }
            for cl in pc.clauses
        ],
        schema={
            "id": pl.String,
            "kind": pl.String,
            "category": pl.String,
            "weight": pl.Float64,
            "derives_from": pl.String,
            "text": pl.String,
            "params": pl.String,
            "sources": pl.String,
        },
    )


def diff(a: PersonalConstitution, b: PersonalConstitution) -> list[dict[str, Any]]:
    """What differs between two personal constitutions, clause by clause.

    Returns rows `{clause, field, a, b}`; `field` is `active`, `text`, `weight` or `param:<name>`.
    """
    rows: list[dict[str, Any]] = []
    ca, cb = {c.id: c for c in a.clauses}, {c.id: c for c in b.clauses}
    order = list(
        dict.fromkeys(
            [c.id for c in a.clauses] + [c.id for c in b.clauses] + a.inactive + b.inactive
        )
    )
    for cid in order:
        x, y = ca.get(cid), cb.get(cid)
        if (x is None) != (y is None):
            rows.append({"clause": cid, "field": "active", "a": x is not None, "b": y is not None})
            continue
        if x is None:
            continue
        for name in sorted(set(x.params) | set(y.params)):
            if x.params.get(name) != y.params.get(name):
                rows.append(
                    {
                        "clause": cid,
                        "field": f"param:{name}",
                        "a": x.params.get(name),
                        "b": y.params.get(name),
                    }
                )
        if x.weight != y.weight:
            rows.append({"clause": cid, "field": "weight", "a": x.weight, "b": y.weight})
        if x.text != y.text:
            rows.append({"clause": cid, "field": "text", "a": x.text, "b": y.text})
    return rows


def render_diff(a: PersonalConstitution, b: PersonalConstitution) -> str:
    """`diff` as readable lines (`T3 param:max_words: 15 -> 70`)."""
    rows = diff(a, b)
    if not rows:
        return f"{a.profile} and {b.profile}: no difference"
    return "\n".join(f"{r['clause']} {r['field']}: {r['a']} -> {r['b']}" for r in rows)


def derivation_edges(c: Constitution) -> list[tuple[str, str]]:
    """(parent, child) edges of the axiom → theorem derivation graph."""
    return [(p, t.id) for t in c.theorems for p in t.derives_from]


def schema(kind: Literal["constitution", "profile"] = "constitution") -> dict[str, Any]:
    """JSON schema for constitution or profile YAML (for editor completion)."""
    model = Constitution if kind == "constitution" else Profile
    s = model.model_json_schema(by_alias=True)
    s["title"] = f"kitchen {kind}"
    return s


def personalize_all(
    c: Constitution,
    profiles: Iterable[Profile | RedactedProfile],
    cache: PersonalizationCache | None = None,
) -> list[PersonalConstitution]:
    """Personalise for many profiles through one cache."""
    cache = cache or PersonalizationCache()
    return [cache.get(c, p) for p in profiles]
