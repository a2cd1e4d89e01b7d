"""docs/: every metric the loop writes is in the glossary; the troubleshooting guide names real
metrics and real recipe fields."""

from __future__ import annotations

import re

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
