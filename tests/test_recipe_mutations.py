"""No recipe or flag may produce a silent garbage run: mutated inputs of `kitchen cook`,
`kitchen eval` and `kitchen sft` are either rejected with exit 2 and located problems, or run
and learn from something (the labels of `kitchen grm calibrate`: tests/test_labels.py).

Two layers, like the constitution's mutation test (tests/test_constitution.py):
- hypothesis mutates the shipped files (types, ranges, missing and unknown keys, NaN and
  infinity, huge values, empty lists, wrong paths) and runs every check a command makes before
  it loads a model: each mutation is accepted or rejected with problems naming the file and a
  line, never anything else;
- a small fixed sample of mutations, plus a few drawn by hypothesis, runs the command itself in
  a one-iteration budget on the shipped tiny models: exit 2 with located problems, or exit 0
  having trained on at least one turn.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import tempfile
from pathlib import Path

import polars as pl
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kitchen import cli, paths, sft
from kitchen.config import KitchenError
from kitchen.evaluate import eval_args
from kitchen.train import file_problems, load_recipe

TRAINING = ["tiny_mapo.yaml", "tiny_grpo.yaml", "gpu_qwen_qlora.yaml"]
BASES = {name: yaml.safe_load((paths.RECIPES / name).read_text()) for name in TRAINING}
SFT_BASE = yaml.safe_load((paths.RECIPES / "sft_tiny.yaml").read_text())

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.sampled_from([-1, 0, 1, 2, 10**9, 10**18, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "data/models/nope", "constitutions/nope.yaml", "/etc", "a/b", "fast"]),
    st.lists(st.integers(), max_size=3),
    st.just([]),
    st.just({}),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def paths_of(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths_of(v, prefix + (i,))


def mutate(doc, path, op, value):
    """`doc` with the value at `path` deleted, replaced, renamed to an unknown key, or (in a
    list) duplicated."""
    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = value
    elif op == "rename" and isinstance(parent, dict):
        parent[f"{key}_x"] = parent.pop(key)
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    return doc


ops = st.sampled_from(["delete", "replace", "replace", "rename", "duplicate"])


def assert_located(problems, path):
    """Every problem names `path`, a line in it, a field and a message."""
    assert problems
    for p in problems:
        assert p.path == str(path) and p.line is not None and p.where and p.message, str(p)


def located_lines(stderr: str, path) -> list[str]:
    """The problems `kitchen` printed for the file `path` (progress bars and library warnings
    aside): at least one, each `PATH:LINE: field: message`, none without a line, no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line.split("\r")[-1] for line in stderr.splitlines()]
    located = [x for x in lines if re.match(rf"{re.escape(str(path))}:\d+: \S+: \S", x)]
    unlocated = [x for x in lines if x.startswith((f"{path}: ", "kitchen: ", "recipe "))]
    assert located and not unlocated, stderr
    return located


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("mutations")


# --- kitchen cook -----------------------------------------------------------------------------


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), name=st.sampled_from(TRAINING), op=ops, value=junk)
def test_mutated_recipes_are_accepted_or_rejected_at_a_line(folder, data, name, op, value):
    """What `kitchen cook` checks before it loads a model (`load_recipe`, `file_problems`):
    every mutation of a shipped recipe is accepted, or rejected with problems that name the
    file, a line and a field — never an exception of another kind."""
    base = BASES[name]
    path = data.draw(st.sampled_from([p for p in paths_of(base) if p]))
    f = folder / "recipe.yaml"
    f.write_text(yaml.safe_dump(mutate(base, path, op, value)))
    try:
        recipe = load_recipe(f)
        problems = file_problems(recipe)
    except KitchenError as e:
        problems = e.problems
    if problems:
        assert_located(problems, f)


def small(doc: dict, name: str) -> dict:
    """A shipped recipe in a one-iteration budget: one job of K = 2 short episodes, reviewed
    by the rule judge, no evaluation."""
    doc = copy.deepcopy(doc) | {
        "name": name,
        "reward": {"reviewer": "judge"},
        "eval_every": 0,
        "checkpoint_every": 1,
        "samples_per_iteration": 0,
        "torch_threads": 1,
    }
    doc["policy"] = {"path": "data/models/policy-tiny", "lora": {"r": 4}}
    doc["rollout"] = {"k": 2, "max_turns": 3, "max_new_tokens": 40, "batch_size": 8}
    doc["train"] = doc["train"] | {"iterations": 1, "tasks_per_iteration": 1, "task_pool": 4}
    return doc


def cook(tmp_path, monkeypatch, capsys, doc: dict | str) -> tuple[int, str, Path]:
    """`kitchen cook` on `doc` (or YAML text) in-process, in a fresh folder under tmp_path with
    its own runs/: exit code, stderr, the recipe file."""
    here = Path(tempfile.mkdtemp(dir=tmp_path))
    monkeypatch.setattr(paths, "RUNS", here / "runs")
    f = here / "recipe.yaml"
    f.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    rc = cli.main(["cook", str(f)])
    return rc, capsys.readouterr().err, f


def trained_turns(recipe: Path, name: str) -> int:
    m = pl.read_parquet(recipe.parent / "runs" / name / "metrics.parquet")
    return int(m["train/step_samples"].sum())


def one_iteration(doc: dict) -> dict:
    """The one-iteration budget is the test's, not the mutation's (unless it broke the field)."""
    train = doc.get("train")
    if isinstance(train, dict) and type(train.get("iterations")) is int:
        train["iterations"] = 1 if train["iterations"] >= 1 else train["iterations"]
    return doc


def check_cook(tmp_path, monkeypatch, capsys, doc):
    rc, err, f = cook(tmp_path, monkeypatch, capsys, one_iteration(doc))
    if rc == 0:
        assert trained_turns(f, doc["name"]) >= 1
    else:
        assert rc == 2
        located_lines(err, f)
    return rc, err


SMALL = small(BASES["tiny_mapo.yaml"], "m")
COOK_CASES = {  # mutation of the small tiny_mapo → the field its problem must name (None: runs)
    "huge token budget": ((("rollout", "max_new_tokens"), "replace", 10**9), "rollout.max_new_tokens"),
    "NaN beta": ((("advantage", "overrides", "beta"), "replace", math.nan), "advantage.overrides.beta"),
    "alpha above 1, convex": (
        (("advantage", "overrides", "alpha", "alpha1"), "replace", 1.5),
        "advantage.overrides.alpha",
    ),
    "unknown override": ((("advantage", "overrides", "beta"), "rename", None), "advantage.overrides.beta_x"),
    "missing policy": ((("policy", "path"), "replace", "data/models/nope"), "policy.path"),
    "missing constitution": ((("constitution",), "replace", "constitutions/nope.yaml"), "constitution"),
    "one episode per task": ((("rollout", "k"), "replace", 1), "rollout.k"),
    "inf learning rate": ((("train", "lr"), "replace", math.inf), "train.lr"),
    "no name": ((("name",), "delete", None), "name"),
    "empty compare": ((("compare",), "replace", {}), None),
    "one turn": ((("rollout", "max_turns"), "replace", 1), None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(COOK_CASES))
def test_cook_on_a_mutated_recipe_exits_2_at_its_line_or_trains(
    tmp_path, monkeypatch, capsys, case
):
    """`kitchen cook` with a one-iteration budget: exit 2 with a located problem at the field
    the mutation broke (the issue's two cases among them), or exit 0 having trained."""
    (path, op, value), field = COOK_CASES[case]
    rc, err = check_cook(tmp_path, monkeypatch, capsys, mutate(SMALL, path, op, value))
    if field is None:
        assert rc == 0, err
    else:
        assert rc == 2 and f": {field}: " in err, err


def test_the_issue_cases_on_the_shipped_recipe_are_located(tmp_path, monkeypatch, capsys):
    """The two reproduced cases on recipes/tiny_mapo.yaml itself (its GRM, its 120-task pool):
    `max_new_tokens: 1000000000` stops before the first iteration at its line instead of
    logging compliance 1.0 for a run that trained on nothing; a NaN beta is located inside
    `advantage.overrides`, not dumped at line 1."""
    text = (paths.RECIPES / "tiny_mapo.yaml").read_text()
    big = text.replace("max_new_tokens: 40,", "max_new_tokens: 1000000000,")
    rc, err, f = cook(tmp_path, monkeypatch, capsys, big)
    (line,) = [x for x in located_lines(err, f) if ": rollout.max_new_tokens: " in x]
    assert rc == 2 and "train on nothing" in line
    assert "max_new_tokens: 1000000000" in big.splitlines()[int(line.split(":")[1]) - 1]
    assert not (f.parent / "runs" / "tiny-mapo" / "metrics.parquet").exists()
    rc, err, f = cook(tmp_path, monkeypatch, capsys, text.replace("beta: 0.02", "beta: .nan"))
    (line,) = located_lines(err, f)
    assert rc == 2 and ": advantage.overrides.beta: " in line
    assert "beta: .nan" in f.read_text().splitlines()[int(line.split(":")[1]) - 1]


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    op=ops,
    value=st.one_of(st.sampled_from([0, 1, 2, 3, -1, 0.5]), st.text(max_size=4)),
)
def test_cook_on_drawn_mutations_exits_2_or_trains(tmp_path, monkeypatch, capsys, data, op, value):
    """A few mutations drawn by hypothesis (small values: the run must stay short) run too."""
    path = data.draw(st.sampled_from([p for p in paths_of(SMALL) if p]))
    check_cook(tmp_path, monkeypatch, capsys, mutate(SMALL, path, op, value))


# --- kitchen eval -----------------------------------------------------------------------------

POLICY = "data/models/policy-tiny"
flags = {
    "tasks": st.one_of(st.none(), st.integers(-5, 20_000), st.sampled_from([0, 10**9])),
    "samples": st.one_of(st.none(), st.integers(-5, 300)),
    "seed": st.one_of(st.none(), st.integers(-(2**40), 2**40)),
    "baseline": st.one_of(st.none(), st.sampled_from([POLICY, "data/models/nope", "data", "", "README.md"])),
    "out": st.one_of(st.none(), st.sampled_from(["report.json", "nowhere/report.json", "."])),
}  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(policy=st.sampled_from([POLICY, "data/models/nope", "", "data", "README.md"]), **flags)
def test_eval_flags_are_usable_or_rejected_by_name(policy, tasks, samples, seed, baseline, out):
    """`kitchen eval`'s arguments are checked before a model loads: usable, or every problem is
    `kitchen eval: --flag: message`."""
    try:
        cfg = eval_args(policy, baseline=baseline, tasks=tasks, samples=samples, seed=seed, out=out)
    except KitchenError as e:
        assert e.problems
        for p in e.problems:
            assert p.path == "kitchen eval" and p.where.startswith("--") and p.message, str(p)
    else:
        assert cfg.tasks >= 1 and cfg.samples >= 1 and 0 <= cfg.seed < 2**32


def test_eval_with_accepted_flags_plays_episodes(tmp_path, capsys):
    """The accepted side runs: one held-out task, one sample, a report with one episode, and a
    progress bar of the episodes played."""
    out = tmp_path / "r.json"
    rc = cli.main(["eval", "--policy", POLICY, "--tasks", "1", "--samples", "1", "--out", str(out)])
    assert rc == 0 and '"episodes": 1' in out.read_text()
    assert "held-out episodes (policy)" in capsys.readouterr().err
    assert cli.main(["eval", "--policy", POLICY, "--tasks", "0"]) == 2
    assert "kitchen eval: --tasks: " in capsys.readouterr().err


# --- kitchen sft ------------------------------------------------------------------------------


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), op=ops, value=junk)
def test_mutated_sft_recipes_are_accepted_or_rejected_at_a_line(folder, data, op, value):
    """`kitchen sft`'s recipe checks (`sft.load_recipe`) on mutations of recipes/sft_tiny.yaml:
    accepted, or problems at the file's lines."""
    path = data.draw(st.sampled_from([p for p in paths_of(SFT_BASE) if p]))
    f = folder / "sft.yaml"
    doc = mutate(SFT_BASE, path, op, value)
    if isinstance(doc.get("output_dir"), str) and doc["output_dir"] == SFT_BASE["output_dir"]:
        doc["output_dir"] = str(folder / "sft-out")  # never the kit's own runs/sft_tiny
    f.write_text(yaml.safe_dump(doc))
    try:
        sft.load_recipe(f)
    except KitchenError as e:
        assert_located(e.problems, f)


def sft_doc(tmp_path) -> dict:
    """recipes/sft_tiny.yaml in a one-step budget on 16 dialogues of the shipped data."""
    from kitchen.files import read_jsonl, write_jsonl

    rows = list(itertools.islice(read_jsonl(paths.DATA / "sft" / "train.jsonl"), 16))
    write_jsonl(tmp_path / "train.jsonl", rows)
    doc = copy.deepcopy(SFT_BASE)
    doc["model"]["tiny"] |= {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    doc["model"]["tiny"] |= {"intermediate_size": 64, "max_positions": 1024}
    doc["model"]["tokenizer"] = {"vocab_size": 512}
    doc["data"] = {"train": str(tmp_path / "train.jsonl")}
    return doc | {"output_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 4,
                  "max_length": 1024, "save_every": 1, "log_every": 1}  # fmt: skip


SFT_CASES = {
    "assistant turns cut by max_length": ((("max_length",), "replace", 16), "max_length"),
    "a model too big to be tiny": ((("model", "tiny", "hidden_size"), "replace", 2**16), "model"),
    "learning rate of 1": ((("lr",), "replace", 1.0), "lr"),
    "no data": ((("data",), "replace", {}), "data.train"),
    "runs as given": ((("seed",), "replace", 7), None),
}


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_on_a_mutated_recipe_exits_2_at_its_line_or_trains(tmp_path, capsys, case):
    """`kitchen sft` on a one-step recipe: exit 2 with a located problem, or a finite loss and
    a model in final/."""
    (path, op, value), field = SFT_CASES[case]
    doc = mutate(sft_doc(tmp_path), path, op, value)
    f = tmp_path / "sft.yaml"
    f.write_text(yaml.safe_dump(doc))
    rc = cli.main(["sft", str(f)])
    err = capsys.readouterr().err
    if field is None:
        assert rc == 0, err
        assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    else:
        assert rc == 2 and f": {field}: " in err, err
        located_lines(err, f)
