"""Notebook 02 (the cold start) run with its script settings: what each section computed."""

from __future__ import annotations

import pytest

from kitchen import paths
from kitchen.world import parse_action

from .test_notebooks import load_app


@pytest.fixture(scope="module")
def defs():
    _, values = load_app("02_cold_start.py").run()
    return values


def test_the_played_dialogue_follows_the_typed_actions(defs):
    """The default actions replay into a dialogue: one turn per typed line until the episode
    ends, and the world answered each (tool results or diner replies)."""
    played = defs["played"]
    typed = [line for line in defs["actions"].value.splitlines() if line.strip()]
    assert 1 <= len(played.turns) <= len(typed)
    assert [t.action.text for t in played.turns] == typed[: len(played.turns)]
    assert len(played.messages) == 2 + 2 * len(played.turns)


def test_the_shipped_policy_plays_valid_actions(defs):
    traj = defs["policy_traj"]
    assert traj is not None and traj.done and traj.outcome is not None
    valid = sum(t.action.kind != "invalid" for t in traj.turns) / len(traj.turns)
    assert valid >= 0.8


def test_the_profile_swap_shows_the_policy_and_the_data_per_verbosity(defs):
    """The profile-swap cell ran: one row per verbosity, the policy's words finite for each (it
    wrote every first recommendation), and the data's own detailed recommendations longer than
    its brief ones (what the policy was trained to do)."""
    swap, table = defs["swap"], defs["swap_table"]
    assert table["verbosity"].to_list() == ["brief", "normal", "detailed"]
    assert all(0 < w < 60 for w in swap["policy"].values())
    assert swap["data"]["detailed"] > swap["data"]["brief"]


def test_sft_data_statistics_cover_the_shipped_data(defs):
    """The statistics read every dialogue of the shipped SFT data."""
    stats, actions = defs["data_stats"], defs["sft_actions"]
    shipped = (paths.DATA / "sft" / "train.jsonl").read_text().splitlines()
    assert stats["dialogues"] == sum(bool(line.strip()) for line in shipped) > 1000
    assert set(actions["action"].unique()) >= {"search", "allergens", "order", "say"}
    assert 3 < stats["assistant turns per dialogue"] < 20  # half the dialogues are meals


def test_the_small_sft_run_learns(defs):
    """The gated SFT cell ran in script mode: train and held-out loss fell, and the log the
    live chart drew has a row per logged step."""
    log = defs["sft_log"]
    train = log.drop_nulls("loss")["loss"].to_list()
    held = log.drop_nulls("eval_loss")["eval_loss"].to_list()
    assert len(train) >= 5 and len(held) >= 2
    assert train[-1] < train[0] - 0.5 and held[-1] < held[0] - 0.5
    assert defs["sft_result"].final_dir.is_dir()


def test_samples_before_and_after(defs):
    """The shipped policy opens like the scripted agent: a search of the cuisine the diner
    named (`@search CUISINE` for a dish, `@search CUISINE COURSE` for a meal); the untrained
    model does not."""
    samples = defs["samples"]
    assert samples.height == 4
    assert {"before", "after", "shipped policy"} <= set(samples.columns)
    cuisines = {"thai", "indian", "italian", "japanese", "mexican", "chinese", "mediterranean"}
    hits = 0
    for row in samples.iter_rows(named=True):
        named = [c for c in cuisines if c in row["diner says"].lower()]
        a = parse_action(row["shipped policy"])
        searched = (a.argument or "").split()[:1] if a.tool == "search" else []
        hits += bool(named) and searched == [named[0]]
        assert row["before"] != row["shipped policy"]
    assert hits >= 3
