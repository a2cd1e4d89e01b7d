"""Human labels (`kitchen.grmdata.load_labels`, the labels `kitchen grm calibrate` reads):
every malformed row is a located problem, a label that could never count is an error, and
mutated folders load or raise `KitchenError`, never anything else."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kitchen.config import KitchenError
from kitchen.grmdata import HumanLabel, load_labels, save_label
from kitchen.scripted import episodes

EPISODE = episodes(1, seed=3)[0]


@pytest.fixture
def labels(tmp_path):
    """A labels folder as notebook 03 writes it: one trajectory, two labels."""
    traj, pc = EPISODE
    for turn, verdict in ((0, "pass"), (1, "violate")):
        save_label(tmp_path, HumanLabel(trajectory=traj.id, turn=turn, clause=pc.ids[0], verdict=verdict), traj, pc)  # fmt: skip
    return tmp_path


def test_a_labels_folder_loads_and_a_missing_one_is_empty(labels, tmp_path):
    ls = load_labels(labels)
    traj, pc = EPISODE
    assert len(ls.labels) == 2 and ls.for_trajectory(traj.id)[(1, pc.ids[0])] == "violate"
    assert load_labels(tmp_path / "none").labels == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(KitchenError, match="is a file"):
        load_labels(tmp_path / "file")


def test_bad_rows_are_located_and_reported_together(labels):
    """Each problem names the file, the line and the field: bad JSON, a non-object, a field
    out of range, and labels that would silently never count (unknown trajectory, a turn the
    trajectory lacks, a clause its personal constitution lacks)."""
    traj, pc = EPISODE
    rows = [
        '{"trajectory": "nope", "turn": 0, "clause": "A1", "verdict": "pass"}',
        json.dumps({"trajectory": traj.id, "turn": -1, "clause": "A1", "verdict": "ok"}),
        json.dumps({"trajectory": traj.id, "turn": 99, "clause": "A1", "verdict": "pass"}),
        json.dumps({"trajectory": traj.id, "turn": 0, "clause": "Z9", "verdict": "pass"}),
        "[1, 2]",
        "not json",
    ]
    with (labels / "labels.jsonl").open("a") as f:
        f.write("\n".join(rows) + "\n")
    with pytest.raises(KitchenError) as e:
        load_labels(labels)
    got = [(p.line, p.where) for p in e.value.problems]
    assert got == [
        (3, "trajectory"),
        (4, "turn"),
        (4, "verdict"),
        (5, "turn"),
        (6, "clause"),
        (7, "line"),
        (8, "line"),
    ]
    assert all(p.path == str(labels / "labels.jsonl") for p in e.value.problems)
    assert not any("validation error" in p.message for p in e.value.problems)


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.just({}),
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    which=st.sampled_from(["labels.jsonl", "trajectories.jsonl"]),
    key=st.sampled_from(["trajectory", "turn", "clause", "verdict", "constitution", "annotator"]),
    op=st.sampled_from(["replace", "delete"]),
    value=junk,
)
def test_mutated_label_rows_load_or_raise_located_problems(labels, which, key, op, value):
    path = labels / which
    original = path.read_text()
    rows = [json.loads(line) for line in original.splitlines()]
    row = copy.deepcopy(rows[0])
    if op == "delete":
        row.pop(key, None)
    else:
        row[key] = value
    path.write_text("\n".join(json.dumps(r) for r in [row, *rows[1:]]) + "\n")
    try:
        load_labels(labels)
    except KitchenError as e:
        files = {str(labels / "labels.jsonl"), str(labels / "trajectories.jsonl")}
        assert e.problems and all(p.path in files and p.line for p in e.problems)
    finally:
        path.write_text(original)
