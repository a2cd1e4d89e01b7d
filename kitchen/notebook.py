"""Small helpers that let one notebook file serve three audiences, and its Jupyter export.

The kit's notebooks are marimo files, one stage each. The same file must also (a) run as a plain
script in CI with small defaults, and (b) run in Jupyter or Colab after `make ipynb`. marimo-only
runtime features misbehave outside the marimo editor (measured in scripts and under an ipykernel
with marimo 0.25): `mo.cli_args()` raises under pytest and in Jupyter; `mo.stop` silently skips
gated cells in a script and raises `MarimoStopError` in Jupyter; `mo.persistent_cache` raises and
`@mo.cache` fails at definition in Jupyter (no app context); `mo.output.replace` shows nothing
there. UI elements (`mo.ui.slider`, `run_button`, …) do work outside marimo: they hold their
initial value, and `mo.md`, `mo.vstack`, `mo.callout` render as HTML.

So a notebook calls the helpers here instead, and each degrades gracefully:

- `mode()` — "edit" / "run" (a person is looking), "script" / "test", or None (Jupyter, plain
  Python).
- `interactive()` — True only where a person can click (marimo edit or run).
- `arg(name, default)` — a `--name value` flag in script mode, `KITCHEN_NB_NAME` from the
  environment anywhere, else the default.
- `gate(button)` — True when the expensive cell below should run: the button was clicked, or
  nobody can click it (script, test, Jupyter). So script and Jupyter runs exercise every gated
  cell. Use it instead of `mo.stop`.
- `show(obj)` — replace the running cell's output (a live chart during training): marimo's
  `mo.output.replace` in the editor, a replaced display in Jupyter, nothing in a script.
- `progress(iterable, title)` — marimo's progress bar in marimo, tqdm elsewhere.
- `cache(fn)` — `@mo.cache` inside marimo, `functools.cache` elsewhere (arguments must be
  hashable either way).
- `persistent_cache(name)` — `mo.persistent_cache` in the marimo editor, a no-op elsewhere.

`export(out_dir)` writes every notebook as a `.ipynb` (`marimo export ipynb`, top-down order,
no outputs) with what Jupyter, Colab and nbval need filled in: a kernelspec, execution counts, a
first markdown cell on how to set the kit up, and a set-up cell that runs from the kit's folder
(as `python notebooks/NN.py` does). `python -m kitchen.notebook export build/ipynb` is
`make ipynb`; CI runs the exported notebooks with `pytest --nbval-lax` (tests/test_ipynb.py).

It implements the kit's notebook conventions (a notebook per stage, runnable as a script,
expensive cells behind a button) for three runtimes. Departures from marimo's own idioms, and why:
1. `gate(button)` instead of `mo.stop(not button.value)`: `mo.stop` skips the gated cell *and
   everything below it* in a script (so CI would test nothing) and raises in Jupyter.
2. Outside the marimo editor nobody can click, so controls keep their defaults and gated cells
   run at once: a Jupyter user gets the script's small defaults, not a reactive notebook.
3. The export keeps the file's order (`--sort top-down`) rather than marimo's default topological
   order, which would put the imports above the title; the kit's notebooks define names before
   use, and the nbval run checks that they still do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def show(obj: Any) -> None:
    """Replace the running cell's output with `obj` (e.g. a chart redrawn every iteration).

    marimo editor: `mo.output.replace`. Jupyter: the cell's output is cleared and `obj`
    displayed. A script: nothing (nobody is watching; the cell's last expression is its output).
    """
    if interactive():
        import marimo as mo

        mo.output.replace(obj)
    elif mode() is None and _in_ipython():
        from IPython.display import clear_output, display

        clear_output(wait=True)
        display(obj)


def progress(iterable: Iterable[T], title: str = "", total: int | None = None) -> Iterator[T]:
    """A progress bar over `iterable`: marimo's inside marimo, tqdm's elsewhere."""
    if mode() is not None:
        import marimo as mo

        yield from mo.status.progress_bar(iterable, title=title or None, total=total)
        return
    from tqdm.auto import tqdm

    yield from tqdm(iterable, desc=title or None, total=total)


def cache(fn: Callable[..., T]) -> Callable[..., T]:
    """Memoise `fn` on its arguments: `@mo.cache` inside marimo (it also survives re-runs of the
    defining cell), `functools.cache` elsewhere — where `@mo.cache` fails (no app context)."""
    if mode() is not None:
        import marimo as mo

        return mo.cache(fn)
    return functools.cache(fn)


def persistent_cache(name: str) -> contextlib.AbstractContextManager:
    """`with notebook.persistent_cache("name"):` — marimo's disk cache of the block's results in
    the marimo editor; a no-op elsewhere (scripts and Jupyter recompute)."""
    if interactive():
        import marimo as mo

        return mo.persistent_cache(name=name)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Jupyter / Colab export


def _colab_note(name: str, repo_url: str | None) -> str:
    where = f"`{repo_url}`" if repo_url else "put its URL in the `git clone` line"
    return f"""\
**Jupyter and Colab.** This is `notebooks/{name}` of the kitchen kit, exported by `make ipynb`
(`python -m kitchen.notebook export build/ipynb`). The original is a reactive marimo notebook:
`marimo edit notebooks/{name}` gives live controls.

**Set up.** *Jupyter*, on a machine with a checkout of the kit: run `make install` there, then use
the kit's `.venv` as the kernel (e.g. `.venv/bin/jupyter lab`). *Colab*: uncomment the three
lines at the top of the next cell and run it once: it clones the kit's repository ({where})
with its shipped data and installs it (`pip install -e .`; Colab's own torch is kept).

**Controls** (sliders, dropdowns, buttons) are shown but re-run nothing here: cells use their
default values — the same small defaults as `python notebooks/{name}` — and every cell behind a
button runs straight away. To change a value, edit it in the code, or set the environment
variable `KITCHEN_NB_<NAME>` that `notebook.arg("<name>", …)` reads before starting the kernel."""


def _setup_cell(name: str, repo_url: str | None) -> str:
    url = repo_url or "<kitchen repository URL>"
    return f"""\
# Colab: uncomment these three lines and run this cell once.
# !git clone --depth 1 {url} kitchen
# %cd kitchen
# %pip install -q -e .
import os

from kitchen import paths

os.chdir(paths.HOME)  # run from the kit's folder, as `python notebooks/{name}` does"""


KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def finish_ipynb(nb: dict[str, Any], name: str, repo_url: str | None = None) -> dict[str, Any]:
    """Make `marimo export ipynb` output ready for Jupyter, Colab and nbval: prepend the set-up
    note and cell, fill in the kernelspec and execution counts 1, 2, … (nbval refuses notebooks
    whose counts are null), and clear any outputs."""
    note = {"cell_type": "markdown", "metadata": {}, "source": _colab_note(name, repo_url)}
    setup = {
        "cell_type": "code",
        "metadata": {},
        "source": _setup_cell(name, repo_url),
        "outputs": [],
        "execution_count": None,
    }
    nb["cells"] = [note, setup, *nb["cells"]]
    count = 0
    for i, cell in enumerate(nb["cells"]):
        cell.setdefault("id", f"kitchen-{i:03d}")
        if cell["cell_type"] == "code":
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = []
    nb["metadata"]["kernelspec"] = dict(KERNELSPEC)
    nb["metadata"].setdefault("language_info", {"name": "python"})
    return nb


def export(
    out_dir: str | os.PathLike,
    notebooks: Sequence[str | os.PathLike] | None = None,
    *,
    repo_url: str | None = None,
) -> list[Path]:
    """Export marimo notebooks (default: every `notebooks/NN_*.py`) to `out_dir/NN_*.ipynb`.

    Cells are kept in file order (`--sort top-down`: the prose reads as written); `mo.md` cells
    become markdown cells. `repo_url` (default: env `KITCHEN_REPO_URL`) goes into the Colab
    set-up lines. Returns the written paths.
    """
    from kitchen import paths

    repo_url = repo_url or os.environ.get("KITCHEN_REPO_URL")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sources = (
        [Path(p) for p in notebooks]
        if notebooks
        else sorted((paths.HOME / "notebooks").glob("[0-9][0-9]_*.py"))
    )
    written = []
    for src in sources:
        dst = out / (src.stem + ".ipynb")
        res = subprocess.run(
            [sys.executable, "-m", "marimo", "export", "ipynb", str(src)]
            + ["--sort", "top-down", "-f", "-o", str(dst)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0 or not dst.exists():
            raise RuntimeError(f"marimo export ipynb {src} failed:\n{res.stderr[-2000:]}")
        nb = finish_ipynb(json.loads(dst.read_text()), src.name, repo_url)
        dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(dst)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kitchen.notebook export OUT_DIR [NOTEBOOK ...]`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kitchen.notebook")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export", help="export marimo notebooks to .ipynb for Jupyter and Colab")
    p.add_argument("out_dir", help="output folder, e.g. build/ipynb")
    p.add_argument("notebooks", nargs="*", help="notebooks (default: every notebooks/NN_*.py)")
    p.add_argument("--repo-url", default=None, help="repository URL for the Colab set-up cell")
    args = ap.parse_args(argv)
    for path in export(args.out_dir, args.notebooks or None, repo_url=args.repo_url):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
