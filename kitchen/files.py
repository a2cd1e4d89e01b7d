"""Files that survive a crash: atomic writes and JSONL.

The kit's standard is that nothing is lost: runs resume after a kill (`kitchen.train`), caches
and shipped data are never half-written.

A run is killed at the worst moment sooner or later. Every file the kit writes goes through
`atomic_write_*`: the bytes land in a temporary file next to the target, are flushed to disk,
and replace the target in one `os.replace` — so a reader sees the old file or the new one, never
half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kitchen.config import KitchenError, Problem


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, _default_mode(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _default_mode(path: Path) -> int:
    """Keep an existing file's mode; new files get 0o666 minus the umask, like `open()`."""
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict], *, append: bool = False) -> Path:
    """Write rows as JSON lines. `append=True` rewrites the old lines plus the new ones atomically."""
    path = Path(path)
    old = path.read_bytes() if append and path.exists() else b""
    new = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    return atomic_write_bytes(path, old + new)


def jsonl_rows(
    path: str | os.PathLike, problems: list[Problem] | None = None
) -> Iterator[tuple[int, dict]]:
    """`(line number, object)` for every non-empty line of a JSONL file.

    A line that is not a JSON object is a `Problem` naming the file and the line: raised at once
    (`problems` None), or appended to `problems` and skipped — so a reader can report every bad
    line of a file at once.
    """
    path = Path(path)
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
                why = (
                    None
                    if isinstance(row, dict)
                    else f"expected a JSON object, got a {type(row).__name__}"
                )
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                why = f"not valid JSON ({e})"
            if why is not None:
                problem = Problem(str(path), n, "line", f"{why}; one JSON object per line")
                if problems is None:
                    raise KitchenError([problem]) from None
                problems.append(problem)
                continue
            yield n, row


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Yield one dict per non-empty line; a bad line raises `KitchenError` naming file and line."""
    for _, row in jsonl_rows(path):
        yield row
