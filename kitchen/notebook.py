"""Small helpers that let one notebook file serve three audiences.

The kit's notebooks are marimo files. The same file must also (a) run as a plain script in CI
with small defaults, and (b) run in Jupyter or Colab after `make ipynb`. marimo-only runtime
features misbehave outside the marimo editor (see NOTES.md): `mo.cli_args()` raises under pytest,
`mo.stop` silently skips gated cells in a script and raises under Jupyter, and
`mo.persistent_cache` fails under Jupyter. The helpers here keep those behind one call each and
degrade gracefully:

- `mode()` — "edit" / "run" (a person is looking), "script" / "test", or None (Jupyter).
- `arg(name, default)` — a `--name value` flag in script mode, `KITCHEN_NB_NAME` from the
  environment anywhere, else the default.
- `gate(button)` — True when the expensive cell below should run: the button was clicked, or
  nobody can click it (script, test, Jupyter). So script runs exercise every gated cell.
"""

from __future__ import annotations

import os
from typing import Any


def mode() -> str | None:
    """marimo's run mode, or None outside marimo (Jupyter, plain Python)."""
    try:
        import marimo as mo

        return mo.app_meta().mode
    except Exception:
        return None


def interactive() -> bool:
    """True when a person can click buttons (marimo edit or run mode)."""
    return mode() in ("edit", "run")


def arg(name: str, default: Any) -> Any:
    """A notebook parameter: `--name value` (script mode), env `KITCHEN_NB_<NAME>`, or default.

    The value is converted to the default's type (int, float, bool, str).
    """
    raw = os.environ.get(f"KITCHEN_NB_{name.upper()}")
    if raw is None and mode() == "script":
        try:
            import marimo as mo

            raw = mo.cli_args().get(name)
        except Exception:
            raw = None
    if raw is None:
        return default
    if isinstance(default, bool):
        return str(raw).lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return type(default)(raw) if default is not None else raw


def gate(button: Any) -> bool:
    """Whether a gated (expensive) cell should run: clicked, or nobody can click."""
    if not interactive():
        return True
    return bool(getattr(button, "value", False))
