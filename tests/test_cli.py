"""The `kitchen` command line: exit codes, one line per problem, no tracebacks."""

from __future__ import annotations

import json

import pytest
import yaml

from kitchen import paths

from .conftest import run_cli

GOOD = str(paths.DEFAULT_CONSTITUTION)


def test_validate_ok():
    res = run_cli("constitution", "validate", GOOD)
    assert res.returncode == 0
    (line,) = res.stdout.strip().splitlines()
    assert line.startswith(f"{GOOD}: ok: concierge@") and "4 axioms, 10 theorems" in line


def test_validate_bad_file_gives_located_lines_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        paths.DEFAULT_CONSTITUTION.read_text()
        .replace("derives_from: [A1]", "derives_from: [A9]")
        .replace("applies_when: pace == hurried", "applies_when: mood == hurried")
    )
    res = run_cli("constitution", "validate", GOOD, str(bad))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    text = bad.read_text().splitlines()
    for line, needle in zip(lines, ("[A9]", "mood =="), strict=True):
        path, lineno, rest = line.split(":", 2)
        assert path == str(bad)
        assert needle in text[int(lineno) - 1], (line, text[int(lineno) - 1])
        assert rest.strip().split(":", 1)[1].strip()  # a message after `where:`
    assert res.stdout.count(": ok:") == 1  # the good file is still reported


def test_validate_garbage_inputs_never_traceback(tmp_path):
    cases = {
        "binary.yaml": b"\x00\xff\xfe garbage",
        "list.yaml": b"- a\n- b\n",
        "tabs.yaml": b"a:\n\t- b\n",
        "empty.yaml": b"",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    res = run_cli(
        "constitution",
        "validate",
        *[str(tmp_path / n) for n in cases],
        str(tmp_path / "missing.yaml"),
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == len(cases) + 1


def test_personalize_prints_yaml_with_version():
    res = run_cli(
        "constitution",
        "personalize",
        GOOD,
        "--profile",
        str(paths.PROFILES / "p01-amara-okafor.yaml"),
    )
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load(res.stdout)
    assert len(doc["version"]) == 12 and doc["constitution"] == "concierge"
    assert res.stdout.startswith(f"# personal constitution {doc['version']}")
    assert {c["id"] for c in doc["clauses"]} >= {"A1", "A2", "A3", "A4", "T3"}


def test_personalize_bad_profile_is_located(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(
        "id: x\ndimensions:\n  verbosity: chatty\n  pace: hurried\noverrides:\n  A1: {enabled: false}\n"
    )
    res = run_cli("constitution", "personalize", GOOD, "--profile", str(p))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{p}:3: dimensions.verbosity" in res.stderr
    assert f"{p}:6: overrides.A1" in res.stderr and "red line" in res.stderr


def test_schema_is_json():
    res = run_cli("constitution", "schema")
    assert res.returncode == 0
    s = json.loads(res.stdout)
    assert "axioms" in s["properties"] and "theorems" in s["properties"]


def test_help_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0 and "constitution" in res.stdout


def test_numbers_a_flag_cannot_use_are_usage_errors():
    """Values argparse would accept but the kit cannot use (0 dialogues, a share of NaN, 0
    iterations) are refused by argparse itself: exit 2, the flag named, no traceback."""
    for args, flag in (
        (["world", "sft-data", "--train", "0"], "--train"),
        (["world", "sft-data", "--long", "nan"], "--long"),
        (["world", "sft-data", "--long", "1.5"], "--long"),
        (["world", "sft-data", "--style-draw", "turn"], "--style-draw"),
        (["demo", "--iterations", "0"], "--iterations"),
        (["demo", "--eval-tasks", "-3"], "--eval-tasks"),
    ):
        res = run_cli(*args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr)
        assert f"argument {flag}" in res.stderr, res.stderr


def test_output_paths_that_cannot_be_written_are_located(tmp_path, capsys):
    """`--out` into a missing folder, or a file where a folder is needed: exit 2 naming it."""
    from kitchen import cli

    (tmp_path / "f").write_text("x")
    assert cli.main(["world", "sft-data", "--out", str(tmp_path / "f")]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "no" / "r.html")]) == 2
    assert f"--out {tmp_path / 'no' / 'r.html'}: no folder" in capsys.readouterr().err


def test_sft_data_style_drawn_per_course(tmp_path, capsys):
    """`kitchen world sft-data --style-draw course` writes the data and records the flag in the
    command that remakes it."""
    import json

    from kitchen import cli

    out = tmp_path / "sft"
    args = ["world", "sft-data", "--out", str(out), "--train", "6", "--eval", "2"]
    assert cli.main([*args, "--style-draw", "course"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert "--style-draw course --unsafe-checks 1 --variants 0.5" in stats["command"]
    assert stats["train"]["dialogues"] == 6
    assert cli.main(args) == 0
    command = json.loads((out / "stats.json").read_text())["command"]
    assert "--style-draw" not in command
    assert command.endswith("--unsafe-checks 1 --variants 0.5")  # the shipped data's defaults
    assert cli.main([*args, "--unsafe-checks", "0.25", "--variants", "0"]) == 0
    command = json.loads((out / "stats.json").read_text())["command"]
    assert command.endswith("--unsafe-checks 0.25 --variants 0")
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse: usage and the message, exit status 2
        cli.main([*args, "--unsafe-checks", "2"])
    assert "--unsafe-checks: must be a number in [0, 1], got 2" in capsys.readouterr().err


def test_demo_recipe_that_cannot_run_is_a_located_error(tmp_path, capsys):
    """`kitchen demo --recipe`: a missing file, or a recipe whose SFT policy is not there yet,
    exits 2 with a message naming it, before anything trains."""
    from kitchen import cli, paths

    assert cli.main(["demo", "--recipe", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    recipe = tmp_path / "mine.yaml"
    text = (paths.RECIPES / "tiny_mapo.yaml").read_text()
    recipe.write_text(text.replace("data/models/policy-tiny", str(tmp_path / "my-sft")))
    assert cli.main(["demo", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "policy.path" in err and "my-sft" in err and "Traceback" not in err
    assert not (paths.RUNS / "demo-mine").exists()
