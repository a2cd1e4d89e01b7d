"""Every notebook in a real browser: served by `marimo run`, opened in headless Chromium.

What a newcomer meets, checked the way they meet it. Each notebook is served with
`marimo run NB.py --headless --port P --no-token` and opened at 1400 × 1000 px in Debian's
Chromium (driven by selenium through Debian's chromedriver). Once no cell is running, the page
must show:

- no error: no traceback in the server's log (run mode hides a failed cell's output, the log
  keeps it), no error output in the page, no error in the browser's console;
- at least the charts the notebook promises on its first screen (a vega-embed canvas or svg);
- no horizontal overflow: `document.scrollingElement.scrollWidth <= window.innerWidth`, and no
  cell wider than its column (a second column off-screen) — long lines wrap or scroll inside
  their own box;
- moving one control (a slider step, the next dropdown option) changes an output of another
  cell;
- where a button starts the notebook's main work, clicking it finishes at the notebook's small
  defaults with its charts drawn, and a training chart appears while the work still runs and
  stays on screen (02, 05, 06, 07: "live means live").

A screenshot of each page, scrolled to its main result, goes to `build/screens/NN_name.png` (the
README's notebook tour shows them, copied to `docs/screens/`); a page that fails leaves
`NN_name.failed.png`. A last test opens `marimo edit notebooks/05_mapo.py` and finds its outputs
there without a click (the project's marimo configuration).

`make test-browser` installs what it needs (chromium, chromium-driver, selenium) and sets
`KITCHEN_BROWSER=1`; `.ci/run` runs it after `make test`. Without that variable the test is
skipped (it serves every notebook: a few minutes). The notebooks run with `KITCHEN_NB_SMALL=1`,
their script-sized defaults, so the page is the real one and the work is small.
`KITCHEN_NB_SMALL=0 make test-browser` runs them at a person's defaults instead; the seconds each
page and button took are written to `build/screens/timings.txt` either way (speed is measured
there, never asserted).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.skipif(
    os.environ.get("KITCHEN_BROWSER") != "1",
    reason="the real-browser test runs under `make test-browser` (CI: after make test)",
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1400, 1000
SCREENS = ROOT / "build" / "screens"
MARIMO = Path(sys.executable).with_name("marimo")


@dataclass(frozen=True)
class Click:
    """A run button to press (by the start of its label); its work runs at the small defaults."""

    label: str
    live: bool = False  # a chart appears while the work is still running
    optional: bool = False  # the page may not show it (06: no training when a policy exists)


@dataclass(frozen=True)
class Page:
    """What one notebook promises in the browser."""

    name: str
    charts: int  # charts on the page once it is idle, before any click
    control: str  # label of the control to move
    clicks: tuple[Click, ...] = ()
    charts_after: int = 0  # charts on the page after the clicks
    timeout: float = 300.0  # seconds until idle, for opening and for each click
    env: tuple[tuple[str, str], ...] = ()  # more notebook settings (KITCHEN_NB_<NAME>)


PAGES = [
    Page("00_should_you_rl.py", charts=3, control="plateau threshold (gain from doubling)",
         clicks=(Click("Play the SFT policy"),), charts_after=4),
    Page("01_constitution.py", charts=2, control="diner"),
    Page("02_cold_start.py", charts=1, control="diner", clicks=(Click("Train", live=True),),
         charts_after=2),
    Page("03_grm.py", charts=1, control="dialogue", env=(("KITCHEN_NB_N", "12"),)),
    Page("04_credit_assignment.py", charts=2, control="horizon H (turns)",
         clicks=(Click("Train every preset"),), charts_after=5),
    Page("05_mapo.py", charts=0, control="α start", clicks=(Click("train", live=True),),
         charts_after=3),
    Page("06_evaluate.py", charts=0, control="held-out tasks",
         clicks=(Click("Train a small MAPO policy", live=True, optional=True), Click("evaluate")),
         charts_after=1),
    Page("07_scale_up.py", charts=0, control="TRL steps",
         clicks=(Click("Train with TRL", live=True),), charts_after=2),
]  # fmt: skip


# -------------------------------------------------------------------------------------------
# serving and driving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(name: str, log: Path, env: dict[str, str] | None = None, command: str = "run"):
    """`marimo run NB --headless` (or `marimo edit`) on a free port; yields its url. The
    server's output (where a failed cell's traceback goes in run mode) is written to `log`.
    The notebook runs with one torch thread and its small defaults (`KITCHEN_NB_SMALL=1`) unless
    the caller's environment says `KITCHEN_NB_SMALL=0` (a person's defaults: timings only)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | (env or {})
    env.setdefault("KITCHEN_NB_SMALL", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(MARIMO), command, f"notebooks/{name}", "--headless", "--port", str(port)]
            + ["--no-token"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url, timeout=2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(
                            f"marimo run {name} did not start:\n{log.read_text()}"
                        ) from None
                    time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def driver():
    """One headless Chromium for the whole module, with a fresh profile. The flags keep it off
    the network it cannot reach here (updates, sync, QUIC, background requests)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed and apt-get could not "
            "install them (see build/apt-browser.log): `make test-browser` installs them"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="`make test-browser` installs it")
    from selenium.webdriver.chrome.service import Service

    (SCREENS / "timings.txt").unlink(missing_ok=True)
    for old in SCREENS.glob("*.failed.png"):
        old.unlink()
    profile = tempfile.mkdtemp(prefix="kitchen-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_script_timeout(30)
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


# State of the page, read in one script: whether a cell runs (marimo's loading indicator, or an
# output marked loading), the charts drawn, and a fingerprint of every cell's output.
STATE_JS = """
const app = document.getElementById('App');
const cells = [...document.querySelectorAll('.marimo-cell')];
function shadowText(root) {
  let t = '';
  for (const el of root.querySelectorAll('*')) {
    if (el.shadowRoot) t += el.shadowRoot.textContent + shadowText(el.shadowRoot);
  }
  return t;
}
function charts(root) {
  // vega-embed draws on a canvas (or an svg); charts inside mo.vstack & co live in shadow roots
  let found = [...root.querySelectorAll('.vega-embed canvas, .vega-embed svg.marks')]
    .filter(c => c.getBoundingClientRect().width > 0);
  for (const el of root.querySelectorAll('*')) {
    if (el.shadowRoot) found = found.concat(charts(el.shadowRoot));
  }
  return found;
}
return {
  connection: app ? app.dataset.connectionState : null,
  running: document.querySelectorAll(
    '[data-testid=loading-indicator], .marimo-output-loading').length,
  charts: charts(document).length,
  cells: cells.map(c => ({
    id: c.dataset.cellId,
    text: c.innerText + shadowText(c),
    charts: charts(c).map(x => x.tagName === 'CANVAS' ? x.toDataURL().length + ':' +
      x.toDataURL().slice(-200) : x.outerHTML.length).join(','),
  })),
};
"""

LAYOUT_JS = """
const app = document.getElementById('App');
const wide = [...document.querySelectorAll('.output-area')]
  .filter(o => o.scrollWidth > o.clientWidth + 1)
  .map(o => o.id + ' ' + o.scrollWidth + '>' + o.clientWidth);
const right = app.getBoundingClientRect().right;
const off = [...document.querySelectorAll('.output-area *')]
  .filter(e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.right > right + 1; })
  .slice(0, 5).map(e => e.tagName + '.' + (e.className || '') + ' right=' +
                     Math.round(e.getBoundingClientRect().right));
return {
  page: [document.scrollingElement.scrollWidth, window.innerWidth],
  app: [app.scrollWidth, app.clientWidth],
  wide: wide,
  off: off,
};
"""

ERROR_JS = """
return [...document.querySelectorAll(
  '.marimo-error, [data-testid=marimo-error], .output-area .traceback, .stderr')]
  .map(e => e.innerText.slice(0, 300));
"""


def state(d) -> dict:
    return d.execute_script(STATE_JS)


def fingerprint(st: dict) -> dict[str, str]:
    return {
        c["id"]: hashlib.sha1((c["text"] + c["charts"]).encode()).hexdigest() for c in st["cells"]
    }


def first_output(d, timeout: float) -> float:
    """Seconds until the page shows its first cell output (the first screen)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if d.execute_script("return document.querySelectorAll('.output-area').length"):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"nothing shown after {timeout:.0f} s")


def record(name: str, what: str, seconds: float) -> None:
    """Timings of the run, one line each, in build/screens/timings.txt (a record, not a test)."""
    SCREENS.mkdir(parents=True, exist_ok=True)
    with (SCREENS / "timings.txt").open("a") as f:
        f.write(f"{name}\t{what}\t{seconds:.1f} s\n")


def wait_idle(d, timeout: float, quiet: float = 3.0, on_poll=None) -> dict:
    """Poll until the kernel is connected, no cell runs and the outputs stay unchanged for
    `quiet` seconds; `on_poll(state)` sees every poll (the live-chart check)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        st = state(d)
        if on_poll:
            on_poll(st)
        fp = fingerprint(st)
        busy = st["connection"] != "OPEN" or st["running"] or not st["cells"]
        if busy or fp != last:
            last, since = fp, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return st
        time.sleep(0.5)
    raise AssertionError(f"still running after {timeout:.0f} s")


FIND_CONTROL_JS = """
const [label, kinds, prefix] = arguments;
for (const host of document.querySelectorAll('marimo-ui-element')) {
  const el = host.firstElementChild;
  if (!el || !el.shadowRoot || !kinds.includes(el.tagName.toLowerCase())) continue;
  const lab = el.shadowRoot.querySelector('label, button');
  const text = lab ? lab.textContent.trim() : null;
  if (text !== null && (prefix ? text.startsWith(label) : text === label)) {
    const cell = host.closest('.marimo-cell');
    const target = el.shadowRoot.querySelector(
      '[role=slider], select, button, input');
    target.scrollIntoView({block: 'center'});
    return [cell ? cell.dataset.cellId : null, target];
  }
}
return null;
"""


def find_control(d, label: str, kinds: tuple[str, ...], prefix: bool = False, need=True):
    found = d.execute_script(FIND_CONTROL_JS, label, list(kinds), prefix)
    assert found or not need, f"no control labelled {label!r} on the page"
    return found


def move(d, label: str) -> str:
    """Move the control labelled `label` one step (a slider's right arrow, a dropdown's next
    option, a number's step up); returns the id of the control's own cell."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    cell, el = find_control(d, label, ("marimo-slider", "marimo-dropdown", "marimo-number"))
    tag = el.tag_name.lower()
    if tag == "select":
        sel = Select(el)
        options = sel.options
        now = next(i for i, o in enumerate(options) if o.is_selected())
        sel.select_by_index((now + 1) % len(options))
    elif tag == "input":
        el.send_keys(Keys.ARROW_UP)
        el.send_keys(Keys.ENTER)
    else:
        el.send_keys(Keys.ARROW_RIGHT)
    return cell


def click(d, label: str, optional: bool = False) -> str | None:
    """Press the run button whose label starts with `label`; the id of its cell (None: an
    optional button the page does not show)."""
    found = find_control(d, label, ("marimo-button",), prefix=True, need=not optional)
    if not found:
        return None
    cell, el = found
    el.click()
    return cell


def console_errors(d) -> list[str]:
    return [
        e["message"]
        for e in d.get_log("browser")
        if e["level"] == "SEVERE" and "favicon" not in e["message"]
    ]


def server_errors(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    found = []
    for m in re.finditer(r"Traceback \(most recent call last\):.*?(?=\n\S|\Z)\n[^\n]*", text, re.S):
        found.append(m.group(0)[-1500:])
    found += [line for line in text.splitlines() if re.match(r"\[E \d", line)]
    return found


def check_clean(d, log: Path, when: str) -> None:
    errors = server_errors(log)
    assert not errors, f"{when}: a cell failed (server log {log}):\n" + "\n".join(errors)
    shown = d.execute_script(ERROR_JS)
    assert not shown, f"{when}: error output in the page: {shown}"
    console = console_errors(d)
    assert not console, f"{when}: errors in the browser console: {console}"


def check_layout(d, when: str) -> None:
    lay = d.execute_script(LAYOUT_JS)
    page_w, inner_w = lay["page"]
    assert page_w <= inner_w, f"{when}: the page is {page_w} px wide in a {inner_w} px window"
    assert lay["app"][0] <= lay["app"][1] + 1, f"{when}: the notebook overflows: {lay['app']}"
    assert not lay["wide"], f"{when}: cells wider than their column: {lay['wide']}"
    assert not lay["off"], f"{when}: content right of the notebook's edge: {lay['off']}"


@contextlib.contextmanager
def _shot_on_failure(d, name: str):
    """A failed page still leaves its screenshot (`NN_name.failed.png`), to see what went wrong."""
    try:
        yield
    except BaseException:
        SCREENS.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):
            d.save_screenshot(str(SCREENS / (Path(name).stem + ".failed.png")))
        raise


def result_cell(st: dict, start: str | None) -> str | None:
    """The cell a screenshot shows: the first with a chart at or below `start` (the last button
    pressed), else the first with a chart on the page."""
    ids = [c["id"] for c in st["cells"]]
    begin = ids.index(start) if start in ids else 0
    drawn = [c["id"] for c in st["cells"][begin:] if c["charts"]]
    return drawn[0] if drawn else start


def screenshot(d, name: str, cell: str | None) -> Path:
    """The page at 1400 px, scrolled to `cell` (the notebook's main result) when given."""
    if cell:
        d.execute_script(
            "document.getElementById('cell-' + arguments[0])?.scrollIntoView({block: 'start'});",
            cell,
        )
        time.sleep(0.5)
    SCREENS.mkdir(parents=True, exist_ok=True)
    path = SCREENS / (Path(name).stem + ".png")
    d.save_screenshot(str(path))
    return path


# -------------------------------------------------------------------------------------------
# the test


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_notebook_in_the_browser(page: Page, driver, tmp_path):
    """The notebook opens without errors, draws its charts, fits 1400 px, reacts to a control,
    and (where it has one) its main button's work finishes with a live chart on the way."""
    log = tmp_path / "marimo.log"
    with serve(page.name, log, dict(page.env)) as url, _shot_on_failure(driver, page.name):
        driver.get(url)
        driver.get_log("browser")  # start the console log afresh for this page
        t0 = time.monotonic()
        record(page.name, "first output", first_output(driver, page.timeout))
        st = wait_idle(driver, page.timeout)
        opened = time.monotonic() - t0
        record(page.name, "idle after opening", opened)
        check_clean(driver, log, f"{page.name} on open ({opened:.0f} s)")
        assert st["charts"] >= page.charts, (
            f"{page.name}: {st['charts']} charts drawn, {page.charts} promised"
        )
        check_layout(driver, f"{page.name} on open")

        before = fingerprint(st)
        own = move(driver, page.control)
        deadline = time.monotonic() + 120
        changed: list[str] = []
        while time.monotonic() < deadline and not changed:
            st = wait_idle(driver, page.timeout)
            after = fingerprint(st)
            changed = [c for c in after if c != own and after[c] != before.get(c)]
        check_clean(driver, log, f"{page.name} after moving {page.control!r}")
        assert changed, f"{page.name}: moving {page.control!r} changed no other cell's output"

        shot_cell = None
        for c in page.clicks:
            seen_live: list[bool] = []  # while running, from the first new chart on: still there?
            drawn = st["charts"]

            def watch(s, drawn=drawn, seen_live=seen_live):
                if s["running"] and (seen_live or s["charts"] > drawn):
                    seen_live.append(s["charts"] > drawn)

            cell = click(driver, c.label, c.optional)
            if cell is None:
                continue
            shot_cell = cell
            t1 = time.monotonic()
            st = wait_idle(driver, page.timeout, on_poll=watch)
            took = time.monotonic() - t1
            record(page.name, f"{c.label!r} done", took)
            check_clean(driver, log, f"{page.name} after {c.label!r} ({took:.0f} s)")
            if c.live:
                assert seen_live, f"{page.name}: no chart was drawn while {c.label!r} ran"
                # a live chart stays on screen (transformers' own notebook table used to
                # replace it at every step: shown in 29 of 125 polls of an 80-step SFT run)
                kept = sum(seen_live) / len(seen_live)
                assert kept >= 0.8, f"{page.name}: the live chart was shown {kept:.0%} of the time"
            check_layout(driver, f"{page.name} after {c.label!r}")
        if page.clicks:
            assert st["charts"] >= page.charts_after, (
                f"{page.name}: {st['charts']} charts after the clicks, {page.charts_after} promised"
            )
        screenshot(driver, page.name, result_cell(st, shot_cell))


def test_marimo_edit_shows_outputs_on_open(driver, tmp_path):
    """`marimo edit notebooks/05_mapo.py` on a fresh clone runs the notebook when it opens (the
    project's `[tool.marimo.runtime] auto_instantiate = true`): the recipe line below the knobs
    is there without a click, and no cell failed."""
    log = tmp_path / "marimo-edit.log"
    with serve("05_mapo.py", log, command="edit") as url:
        driver.get(url)
        deadline = time.monotonic() + 180
        text = ""
        while time.monotonic() < deadline and "The recipe:" not in text:
            time.sleep(1)
            text = driver.execute_script(
                "return [...document.querySelectorAll('.output-area')]"
                ".map(o => o.innerText).join('\\n')"
            )
        assert "The recipe:" in text, "marimo edit opened 05_mapo.py without running it"
        assert not server_errors(log), server_errors(log)
