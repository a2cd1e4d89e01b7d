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
- `arg(name, default)` — a `--name value` flag when the notebook runs as a script
  (`python notebooks/NN.py --name value`), `KITCHEN_NB_NAME` from the environment anywhere, else
  the default. The flags of another program that runs the notebook (pytest calling `app.run()`)
  are not the notebook's.
- `small()` — whether to use the small defaults: nobody can click (script, test, Jupyter), or
  `KITCHEN_NB_SMALL=1` (the browser test serves the real page with the script's sizes).
- `gate(button)` — True when the expensive cell below should run: the button was clicked, or
  nobody can click it (script, test, Jupyter). So script and Jupyter runs exercise every gated
  cell. Use it instead of `mo.stop`.
- `show(obj)` — replace the running cell's output (a live chart during training) below its
  progress bars: marimo's `mo.output.replace_at_index` in the editor, a replaced display in
  Jupyter, nothing in a script.
- `progress(iterable, title)` — marimo's progress bar in marimo, tqdm elsewhere.
- `trainer_progress(title)` — while open, a transformers `Trainer` (TRL's too) built inside shows
  marimo's progress bar (steps done, the last loss) instead of transformers' own notebook table,
  which would replace the cell's live chart at every step. Elsewhere transformers' own bar.
- `spinner(title)` — marimo's spinner with a title (work whose length is not known up front).
- `log_callback(fn)` — a transformers `TrainerCallback` that hands every logged row to `fn` (a
  live chart of a TRL run).
- `rounded(rows, digits)` — a polars frame with its floats rounded for people (0.15, not
  0.15000000000000002; float32 values such as 0.699999988 read 0.7).
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
4. `trainer_progress` swaps transformers' `trainer.DEFAULT_PROGRESS_CALLBACK` (a module global
   that `Trainer.__init__` reads) while its block is open, because the kit's trainers are built
   inside kit functions (`kitchen.sft.run_sft`) that a notebook cannot hand a callback list to.
   transformers picks its notebook table whenever marimo is imported, and that table redraws the
   cell's whole output at every step, so a live chart flickered away between logged steps
   (notebook 02, 80 SFT steps in headless Chromium: the chart was on screen in 29 of 125 polls
   while training; with `trainer_progress`, 110 of 117 — all but those before the first log).

Where the kit's notebooks share layout rules (columns that shrink, long lines that wrap), they
live in `notebooks/kitchen.css`, which `pyproject.toml` hands to marimo (`[tool.marimo.display]
custom_css`) with `auto_instantiate = true`, so `marimo edit` runs a notebook when it opens.
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


def _run_as_script() -> bool:
    """The notebook file itself is the program (`python notebooks/NN.py --flag v`): then the
    command line's flags are the notebook's. Under pytest or any other program that calls
    `app.run()`, marimo also reports mode "script" and `mo.cli_args()` would hand the notebook
    that program's own flags (`-k test_05` as the parameter `k`)."""
    if mode() != "script" or not sys.argv or not sys.argv[0].endswith(".py"):
        return False
    try:
        import marimo as mo

        here = mo.notebook_dir()
    except Exception:
        return False
    return here is not None and Path(sys.argv[0]).resolve().parent == Path(here).resolve()


def arg(name: str, default: Any) -> Any:
    """A notebook parameter: `--name value` (the notebook run as a script), env
    `KITCHEN_NB_<NAME>`, or default.

    The value is converted to the default's type (int, float, bool, str).
    """
    raw = os.environ.get(f"KITCHEN_NB_{name.upper()}")
    if raw is None and _run_as_script():
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


def small() -> bool:
    """Whether the notebook should use its small defaults (the script's sizes): nobody can click
    (script, test, Jupyter), or `KITCHEN_NB_SMALL=1` is set (the browser test and CI serve the
    real page with small work behind its buttons)."""
    flag = os.environ.get("KITCHEN_NB_SMALL", "").lower() in ("1", "true", "yes", "on")
    return flag or not interactive()


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


# Progress bars of `progress` and `trainer_progress` open in the running cell: `show` puts its
# object below them (marimo stacks a cell's outputs; a bar is appended first).
_open_bars = 0


def show(obj: Any) -> None:
    """Show `obj` as the running cell's output (e.g. a chart redrawn every iteration), below the
    cell's open progress bars.

    marimo editor: `mo.output.replace_at_index` (`mo.output.replace` when no bar is open).
    Jupyter: the cell's output is cleared and `obj` displayed. A script: nothing (nobody is
    watching; the cell's last expression is its output).
    """
    if interactive():
        import marimo as mo

        if _open_bars:
            mo.output.replace_at_index(obj, _open_bars)
        else:
            mo.output.replace(obj)
    elif mode() is None and _in_ipython():
        from IPython.display import clear_output, display

        clear_output(wait=True)
        display(obj)


@contextlib.contextmanager
def _bar_open() -> Iterator[None]:
    global _open_bars
    _open_bars += 1
    try:
        yield
    finally:
        _open_bars -= 1


def progress(
    iterable: Iterable[T], title: str = "", total: int | None = None, subtitle: str = ""
) -> Iterator[T]:
    """A progress bar over `iterable` that says what is being done (`title`, `subtitle`) and
    how far it is: marimo's inside marimo, tqdm's elsewhere."""
    if mode() is not None:
        import marimo as mo

        with _bar_open():
            yield from mo.status.progress_bar(
                iterable, title=title or None, subtitle=subtitle or None, total=total
            )
        return
    from tqdm.auto import tqdm

    yield from tqdm(iterable, desc=title or None, total=total)


@contextlib.contextmanager
def trainer_progress(title: str) -> Iterator[None]:
    """`with notebook.trainer_progress("SFT steps"):` around building and training a
    transformers `Trainer` (TRL's trainers too): in the marimo editor the trainer's progress is
    marimo's bar — `title`, steps done out of `max_steps`, the last logged loss — instead of
    transformers' notebook table, which redraws the whole cell output at every step and so
    hides a live chart drawn by `show`. Elsewhere transformers' own progress bar is kept."""
    if not interactive():
        yield
        return
    import marimo as mo
    import transformers.trainer as hf_trainer
    from transformers import TrainerCallback

    bars = contextlib.ExitStack()  # closed when the block ends, even if training raised

    class MarimoProgress(TrainerCallback):
        bar: Any = None

        def on_train_begin(self, args, state, control, **kw):
            total = max(int(state.max_steps), 1)
            self.bar = bars.enter_context(
                mo.status.progress_bar(total=total, title=title, subtitle="starting")
            )
            bars.enter_context(_bar_open())

        def on_step_end(self, args, state, control, **kw):
            if self.bar is not None:
                self.bar.update(increment=1, subtitle=f"step {state.global_step}")

        def on_log(self, args, state, control, logs=None, **kw):
            if self.bar is not None and logs and "loss" in logs:
                self.bar.update(
                    increment=0, subtitle=f"step {state.global_step} · loss {logs['loss']:.3f}"
                )

    before = hf_trainer.DEFAULT_PROGRESS_CALLBACK
    hf_trainer.DEFAULT_PROGRESS_CALLBACK = MarimoProgress
    try:
        with bars:
            yield
    finally:
        hf_trainer.DEFAULT_PROGRESS_CALLBACK = before


def spinner(title: str, subtitle: str = "") -> contextlib.AbstractContextManager:
    """`with notebook.spinner("Playing 40 dialogues"):` — marimo's spinner saying what runs, for
    work whose progress cannot be counted from outside; a no-op outside marimo."""
    if interactive():
        import marimo as mo

        return mo.status.spinner(title=title, subtitle=subtitle or None)
    return contextlib.nullcontext()


def log_callback(fn: Callable[[dict[str, Any]], None]) -> Any:
    """A transformers `TrainerCallback` that calls `fn(row)` with every row the trainer logs,
    its `step` included: `trainer.add_callback(notebook.log_callback(draw))` draws a live chart
    of a Trainer the notebook did not build itself (TRL's `GRPOTrainer`)."""
    from transformers import TrainerCallback

    class LogRows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                fn(dict(logs) | {"step": state.global_step})

    return LogRows()


def rounded(rows: Any, digits: int = 3) -> Any:
    """`rows` (a polars frame, or rows as dicts) as a polars frame whose float columns are
    rounded to `digits` decimals: tables are for people (0.15, not 0.15000000000000002)."""
    import polars as pl
    import polars.selectors as cs

    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows, infer_schema_length=None)
    return frame.with_columns(cs.float().round(digits))


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
