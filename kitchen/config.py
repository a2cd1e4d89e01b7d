"""Declarative files: YAML into pydantic models, with errors that point at a file and a line.

Every config of the kit is a pydantic model next to the code that uses it; this module is how a
user's YAML reaches those models.

Every file a user writes for the kit — constitutions, profiles, recipes — is loaded here. The
promise to the user: a mistake in one of them gives `PATH:LINE: where: what is wrong and how to fix
it`, one line per problem, and never a Python traceback.

How: the YAML is parsed twice from the same text — once into plain data (`yaml.safe_load`'s
constructor) and once into PyYAML's node tree, which remembers where every key and item starts.
Walking the node tree gives a map from a field's location (`("theorems", 2, "derives_from")`) to
its line; pydantic's and our own errors carry such locations, so each one is mapped to a line.

Guards against hostile or accidental input: files over `MAX_BYTES`, nesting deeper than
`MAX_DEPTH`, anchors that expand beyond `MAX_NODES`, duplicate keys (PyYAML silently keeps the
last one), non-UTF-8 bytes and numbers that are not finite (`.nan`, `.inf`: no field of the kit
can use one, and a NaN slips past range checks) are all reported as problems, not crashes.

Checks that need more than one model (a preset and its overrides, a recipe and the model it
names) validate a piece of the file on its own and place the problems under that piece's
location (`pydantic_problems(..., prefix=...)`), so they read like every other problem.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

MAX_BYTES = 2_000_000
MAX_DEPTH = 48
MAX_NODES = 200_000

Loc = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for every user-facing config: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def admit_shorthand(*alternatives: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` for a `dict[str, Model]` field whose values may also be written short.

    Validators accept `min_words: 12` for `min_words: {default: 12}`; the exported JSON schema must
    accept it too, or editors would flag valid files.
    """

    def patch(schema: dict[str, Any]) -> None:
        schema["additionalProperties"] = {"anyOf": [schema["additionalProperties"], *alternatives]}

    return patch


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one input, printed as `path:line: where: message`."""

    path: str
    line: int | None
    where: str
    message: str

    def __str__(self) -> str:
        line = "" if self.line is None else f"{self.line}:"
        return f"{self.path}:{line} {self.where}: {self.message}"


class KitchenError(Exception):
    """A user mistake (bad file, bad argument). The CLI prints its problems and exits 2."""

    def __init__(self, problems: Sequence[Problem] | str):
        if isinstance(problems, str):
            problems = [Problem("kitchen", None, "input", problems)]
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def where(loc: Loc) -> str:
    """`("theorems", 2, "derives_from", 0)` → `theorems[2].derives_from[0]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


@dataclass
class Located:
    """Parsed YAML plus the line where every location starts."""

    data: Any
    path: str
    lines: dict[Loc, int] = field(default_factory=dict)

    def line_of(self, loc: Loc) -> int | None:
        """The line of `loc`, or of its nearest parent that has one."""
        loc = tuple(loc)
        while True:
            for key in (loc, tuple(str(p) if not isinstance(p, int) else p for p in loc)):
                if key in self.lines:
                    return self.lines[key]
            if not loc:
                return None
            loc = loc[:-1]

    def problem(self, loc: Loc, message: str) -> Problem:
        return Problem(self.path, self.line_of(loc), where(loc), message)


def _index_nodes(root: yaml.Node, path: str) -> tuple[dict[Loc, int], list[Problem]]:
    lines: dict[Loc, int] = {}
    problems: list[Problem] = []
    budget = [MAX_NODES]

    def walk(node: yaml.Node, loc: Loc, depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooBig(f"more than {MAX_NODES} values once anchors are expanded")
        if depth > MAX_DEPTH:
            raise _TooBig(f"nested more than {MAX_DEPTH} levels deep at {where(loc)}")
        lines.setdefault(loc, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                if key == "<<":  # merge key: its children belong to this mapping
                    walk(value_node, loc, depth + 1)
                    continue
                if key in seen:
                    problems.append(
                        Problem(
                            path,
                            key_node.start_mark.line + 1,
                            where(loc + (key,)),
                            f"duplicate key '{key}': YAML would keep only the last one; "
                            "remove or rename one of them",
                        )
                    )
                seen.add(key)
                lines[loc + (key,)] = key_node.start_mark.line + 1
                walk(value_node, loc + (key,), depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, loc + (i,), depth + 1)

    walk(root, (), 0)
    return lines, problems


class _TooBig(Exception):
    pass


def parse_yaml(text: str | bytes, path: str = "<string>") -> Located:
    """Parse YAML text into `Located`; every failure is a `KitchenError` naming `path`."""
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise KitchenError(
                [
                    Problem(
                        path,
                        None,
                        "file",
                        f"{len(text)} bytes is larger than the "
                        f"{MAX_BYTES}-byte limit for a config file",
                    )
                ]
            )
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KitchenError(
                [
                    Problem(
                        path,
                        None,
                        "file",
                        f"not UTF-8 text (bad byte at offset {e.start}); save the file as UTF-8",
                    )
                ]
            ) from None
    if len(text) > MAX_BYTES:
        raise KitchenError([Problem(path, None, "file", f"larger than the {MAX_BYTES}-byte limit")])
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            raise KitchenError(
                [
                    Problem(
                        path,
                        1,
                        "file",
                        "the file is empty; see "
                        "`kitchen constitution schema` for the expected fields",
                    )
                ]
            )
        lines, problems = _index_nodes(root, path)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        msg = " ".join(s for s in (e.context, e.problem) if s)
        raise KitchenError([Problem(path, line, "yaml", f"not valid YAML: {msg}")]) from None
    except yaml.YAMLError as e:
        raise KitchenError([Problem(path, None, "yaml", f"not valid YAML: {e}")]) from None
    except (_TooBig, RecursionError) as e:
        msg = str(e) if isinstance(e, _TooBig) else "nested too deeply to parse"
        raise KitchenError([Problem(path, None, "file", f"{msg}; flatten the document")]) from None
    if problems:
        raise KitchenError(problems)
    return Located(data, path, lines)


def read_yaml(path: str | os.PathLike) -> Located:
    """Read and parse a YAML file (see `parse_yaml`)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise KitchenError([Problem(str(p), None, "file", "is a folder; give a YAML file")])
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise KitchenError(
                [
                    Problem(
                        str(p),
                        None,
                        "file",
                        f"{size} bytes is larger than the {MAX_BYTES}-byte limit for a config file",
                    )
                ]
            )
        raw = p.read_bytes()
    except FileNotFoundError:
        raise KitchenError([Problem(str(p), None, "file", "no such file")]) from None
    except PermissionError:
        raise KitchenError([Problem(str(p), None, "file", "permission denied")]) from None
    return parse_yaml(raw, str(p))


def _known_fields(model: type[BaseModel], loc: Loc) -> list[str]:
    """Best effort: the field names allowed at `loc` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(str(part)) or next(
                (f for f in current.model_fields.values() if f.alias == part), None
            )
            if info is None:
                return []
            current = info.annotation
        else:
            args = [a for a in getattr(current, "__args__", ()) if a is not type(None)]
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            current = models[0] if models else (args[-1] if args else None)
            if (
                isinstance(current, type)
                and issubclass(current, BaseModel)
                and str(part) in current.model_fields
            ):
                current = current.model_fields[str(part)].annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or name for name, f in current.model_fields.items()]
    return []


def pydantic_problems(
    err: ValidationError, doc: Located, model: type[BaseModel], prefix: Loc = ()
) -> list[Problem]:
    """Turn a pydantic `ValidationError` into located, human problems.

    `prefix` is where in `doc` the validated data sits, when `model` validated a piece of the file
    (e.g. `("advantage", "overrides")` for the fields a preset's overrides change)."""
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and "[" in p))  # drop union tags
        kind = e["type"]
        if kind == "extra_forbidden":
            known = _known_fields(model, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            fix = (
                f"did you mean '{hint[0]}'?"
                if hint
                else (f"known fields: {', '.join(known)}" if known else "remove it")
            )
            msg = f"unknown field '{loc[-1]}'; {fix}"
        elif kind == "missing":
            msg = f"missing required field '{loc[-1]}'"
        elif kind.startswith("value_error"):
            msg = str(e["msg"]).removeprefix("Value error, ")
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
            if len(shown) > 60:
                shown = shown[:57] + "..."
            msg = f"{e['msg']} (got {shown})"
        out.append(doc.problem(prefix + loc, msg))
    return out


def non_finite(data: Any, loc: Loc = ()) -> list[Loc]:
    """Locations of the NaN and infinite numbers in parsed YAML (`.nan`, `.inf`, `-.inf`)."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [loc]
    if isinstance(data, dict):
        return [x for k, v in data.items() for x in non_finite(v, loc + (k,))]
    if isinstance(data, list):
        return [x for i, v in enumerate(data) for x in non_finite(v, loc + (i,))]
    return []


def validate_doc(model: type[M], doc: Located) -> M:
    """Validate parsed YAML against `model`; raise `KitchenError` with located problems."""
    if not isinstance(doc.data, dict):
        raise KitchenError(
            [
                doc.problem(
                    (),
                    f"expected a mapping of fields at the top level, got a "
                    f"{type(doc.data).__name__}",
                )
            ]
        )
    bad = non_finite(doc.data)
    if bad:
        raise KitchenError(
            [
                doc.problem(loc, "not a finite number (NaN or infinity); give a plain number")
                for loc in bad
            ]
        )
    try:
        return model.model_validate(doc.data)
    except ValidationError as err:
        raise KitchenError(pydantic_problems(err, doc, model)) from None
    except RecursionError:
        raise KitchenError([doc.problem((), "nested too deeply to validate")]) from None


def load_model(model: type[M], path: str | os.PathLike) -> M:
    """Read a YAML file into `model`; errors name file, line and field."""
    return validate_doc(model, read_yaml(path))
