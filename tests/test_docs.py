"""docs/: every metric the loop writes is in the glossary; the troubleshooting guide names real
metrics and real recipe fields; docs/method.md has its stable anchors, every citation of it points
at one, and no file sends a reader to a document outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kitchen import paths
from kitchen.train import Recipe, Run

from .conftest import ROOT

DOCS = ROOT / "docs"
PER_CLAUSE = re.compile(r"^(clause|judge|eval)/[A-Z][0-9]+_pass_rate$")
NAME = re.compile(r"`([a-z_]+(?:/[A-Za-z0-9_<>]+)?)`")


def documented(path) -> set[str]:
    """Backticked metric names in a doc (`clause/<id>_pass_rate` stands for every clause)."""
    return set(NAME.findall(path.read_text()))


def pattern(key: str) -> str:
    """A metric key as the glossary writes it: clause ids become `<id>`."""
    return (
        re.sub(r"/[A-Z][0-9]+_pass_rate$", "/<id>_pass_rate", key) if PER_CLAUSE.match(key) else key
    )


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> set[str]:
    """The metric keys of one iteration that switches on every optional metric: the GRM as
    reviewer (a fresh adapter on the tiny policy's base, most clauses cascaded to the rule judge:
    `grm/*` and the reward gap), β > 0
    (`kl/mean`), buffer history in the gradient (`is/*`), α > 0 and < 1 (local and global terms),
    and an evaluation (`eval/*`)."""
    policy = str(paths.DATA / "models" / "policy-tiny")
    recipe = Recipe.model_validate(
        {
            "name": "docs-metrics",
            "seed": 1,
            "policy": {"path": policy, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
            # an untrained adapter writes no parsable verdicts: the judge decides most clauses
            "grm": {
                "model": policy,
                "adapter": "grm",
                "max_new_tokens": 16,
                "batch_size": 8,
                "cascade": ["A1", "A2", "A3", "A4", "T1", "T2", "T3", "T4", "T5"],
            },
            "reward": {"reviewer": "grm"},
            "rollout": {"k": 2, "max_turns": 3, "max_new_tokens": 24},
            "advantage": {
                "preset": "mapo",
                "overrides": {"beta": 0.02, "replay_in_gradient": True, "state_key": "abstract"},
            },
            "train": {"iterations": 1, "tasks_per_iteration": 2, "task_pool": 8},
            "eval": {"tasks": 2, "samples": 1},
            "eval_every": 1,
            "samples_per_iteration": 0,
            "torch_threads": 1,
        }
    )
    run = Run(recipe, tmp_path_factory.mktemp("run"), progress=False)
    m = run.step() | run.evaluate()
    return set(m)


def test_every_emitted_metric_is_documented(emitted):
    """docs/metrics.md names every key the loop writes (per-clause keys as `<ns>/<id>_pass_rate`)."""
    missing = sorted({pattern(k) for k in emitted} - documented(DOCS / "metrics.md"))
    assert not missing, f"undocumented metrics: {missing} — add them to docs/metrics.md"


def test_the_iteration_switched_every_family_on(emitted):
    """The fixture really exercised the optional metrics (else the check above proves little)."""
    for prefix in ("grm/", "kl/", "is/", "adv/local", "adv/global", "eval/", "clause/", "judge/"):
        assert any(k.startswith(prefix) for k in emitted), prefix
    assert "reward/gap_grm_minus_judge" in emitted


def test_troubleshooting_names_real_metrics_and_knobs():
    """Every metric the troubleshooting guide cites is in the glossary; every recipe field it
    cites (`section.field`) exists in the recipe's JSON schema, or in the GRM or constitution
    schema for `grm.*` / constitution fields."""
    from kitchen.constitution import schema as constitution_schema
    from kitchen.train import recipe_schema

    text = (DOCS / "troubleshooting.md").read_text()
    glossary = documented(DOCS / "metrics.md")
    cited = {m for m in NAME.findall(text) if "/" in m}
    assert cited and cited <= glossary, sorted(cited - glossary)
    schema = recipe_schema()
    defs = schema.get("$defs", {})

    def has(path: list[str]) -> bool:
        node = schema
        for part in path:
            props = node.get("properties", {})
            if part not in props:
                return False
            node = props[part]
            ref = node.get("$ref") or next(
                (x.get("$ref") for x in node.get("anyOf", []) if "$ref" in x), None
            )
            if ref:
                node = defs[ref.split("/")[-1]]
        return True

    knobs = re.findall(
        r"`((?:train|rollout|buffer|reward|grm|policy|advantage)\.[a-z_.0-9]+)`", text
    )
    assert knobs
    for knob in knobs:
        parts = knob.split(".")
        if parts[:2] == ["advantage", "overrides"]:  # fields of AdvantageConfig
            from kitchen.mapo import AdvantageConfig

            assert parts[2] in AdvantageConfig.model_fields, knob
        else:
            assert has(parts), knob
    for field in re.findall(r"constitution field `([a-z_]+)`", text):
        assert field in str(constitution_schema("constitution")), field


# --------------------------------------------------------------------------------------------
# docs/method.md: stable anchors, citations that resolve, no documents outside the repository
# --------------------------------------------------------------------------------------------

METHOD = DOCS / "method.md"
ANCHORS = (
    "should-you-rl",
    "constitution",
    "personalisation",
    "privacy",
    "cold-start",
    "grm",
    "grm-training",
    "grm-calibration",
    "reward-hacking",
    "rewards",
    "credit-assignment",
    "mapo",
    "replay-buffer",
    "policy-update",
    "peers",
    "long-horizon",
    "validation",
    "guard",
    "scaling",
    "faq",
)
ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
# `docs/method.md#<anchor>` anywhere, `method.md#<anchor>` in docs/, `](#<anchor>)` in method.md
CITATION = re.compile(r"(?:\bmethod\.md|\]\()#([A-Za-z0-9_-]+)")
# where citations live: every text file a reader of the repository opens
CITING = (
    "kitchen/**/*.py",
    "docs/**/*.md",
    "notebooks/**/*.py",
    "tests/**/*.py",
    "benchmarks/**/*.py",
    "recipes/**/*.yaml",
    "recipes/**/*.sh",
    "recipes/**/*.md",
    "README.md",
    "constitutions/**/*.yaml",
    "data/**/*.yaml",
    "data/schema/*.json",
)
# references to documents a user of the kit does not have (they lived outside the repository)
OUTSIDE = re.compile(
    r"(?i:\bseeds?\s+00[01]\b|\bthe\s+seeds\b|\bseeds'|\bdepartures from the seed\b)"
    r"|\bDESIGN(?:\.md)?\b|\bSTYLE(?:\.md)?\s*§|\bNOTES\.md\b"
)


def files(patterns) -> list:
    """The repository files matching `patterns` (globs relative to the root), each once."""
    found = {p for pat in patterns for p in ROOT.glob(pat) if p.is_file()}
    return sorted(found)


def method_anchors() -> list[str]:
    return ANCHOR.findall(METHOD.read_text())


def test_method_has_every_stable_anchor_once_before_a_heading():
    """docs/method.md defines each listed anchor exactly once, as `<a id>` right before a heading
    (so rewording a heading never breaks a citation)."""
    lines = METHOD.read_text().splitlines()
    found = method_anchors()
    missing = [a for a in ANCHORS if a not in found]
    assert not missing, f"docs/method.md lacks anchors {missing}"
    twice = sorted({a for a in found if found.count(a) > 1})
    assert not twice, f"anchors defined twice: {twice}"
    for i, line in enumerate(lines):
        if ANCHOR.fullmatch(line.strip()):
            after = lines[i + 1] if i + 1 < len(lines) else ""
            assert after.startswith("## "), f"docs/method.md:{i + 1}: anchor not before a heading"


def test_every_method_citation_points_at_an_anchor():
    """Every `docs/method.md#<anchor>` (and `method.md#...` in docs/, `(#...)` inside method.md)
    names an anchor that docs/method.md defines."""
    anchors = set(method_anchors())
    scanned = files(CITING)
    assert METHOD in scanned and (ROOT / "README.md") in scanned
    bad, cited = [], set()
    for path in scanned:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in CITATION.finditer(line):
                if m.group(0).startswith("](") and path != METHOD:
                    continue  # a same-page link in another document
                cited.add(m.group(1))
                if m.group(1) not in anchors:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: #{m.group(1)}")
    assert not bad, "citations of unknown anchors:\n" + "\n".join(bad)
    assert {"constitution", "validation", "mapo"} <= cited  # the scan really found citations


def outside_citations(paths_) -> list[str]:
    """`file:line: text` of every reference to a document outside the repository."""
    hits = []
    for path in paths_:
        if path == Path(__file__).resolve():
            continue  # this file spells the patterns out
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return hits


def test_the_outside_pattern_catches_each_kind_of_citation():
    """The pattern is not vacuous: each old citation style matches, ordinary words do not."""
    for text in (
        "Seed 000 (step 4) asks",
        "seed 001 §9.3",
        "Departures from the seeds:",
        "the seeds' MAPO",
        "Departures from the seed, and",
        "DESIGN §1",
        "(DESIGN.md §4)",
        "STYLE §7",
        "(NOTES.md)",
    ):
        assert OUTSIDE.search(text), text
    for text in ("same task, diner and seed", "seed=0", "the design of the loop", "20 seeds"):
        assert not OUTSIDE.search(text), text


def test_no_file_cites_a_document_outside_the_repository():
    """No file of the kit — code, docs, notebooks, tests, recipes, data, the README — sends a
    reader to a document outside the repository (the old design notes and source write-ups):
    docs/method.md tells the method in our words."""
    checked = files(CITING)
    assert len(checked) > 100  # the whole repository, not a handful of files
    hits = outside_citations(checked)
    assert not hits, "cite docs/method.md#<anchor> instead:\n" + "\n".join(hits)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = path.read_text()
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return set(ANCHOR.findall(text)) | {slug(h) for h in headings}


def broken_links(paths_) -> list[str]:
    """`file:line: link` of every relative Markdown link whose file or anchor does not exist."""
    bad = []
    for path in paths_:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue  # a web address or mailto:
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{n}"
                if not dest.exists():
                    bad.append(f"{where}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                    bad.append(f"{where}: {target} (no such anchor)")
    return bad


def test_every_link_in_the_readme_and_docs_leads_somewhere(tmp_path):
    """Every relative link in README.md and docs/*.md names a file of the repository and, where
    it names an anchor in a Markdown file, an anchor that file defines (`<a id>` or a heading);
    the checker itself flags a missing file and a missing anchor."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    assert DOCS / "results.md" in pages
    bad = broken_links(pages)
    assert not bad, "\n".join(bad)
    page = tmp_path / "page.md"
    page.write_text("## A heading\n[ok](#a-heading) [gone](nowhere.md) [lost](#no-heading)\n")
    assert [line.split(": ", 1)[1] for line in broken_links([page])] == [
        "nowhere.md (no such file)",
        "#no-heading (no such anchor)",
    ]
