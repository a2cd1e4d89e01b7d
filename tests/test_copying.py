"""The copying warm-up: the task's tokens and labels, its batches, and a model that learns it."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from kitchen.copying import IGNORE, CopyWarmup, collate, copy_batch, copy_ids, warm_up
from kitchen.models import build_tiny_model, render_chat, train_tokenizer

from .test_models import MICRO, dialogues


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer((render_chat(m) for m in dialogues(200)), 512, model_max_length=256)


def test_a_copying_example_is_prefix_run_gap_run_run_labelled_on_the_repeats():
    """Each example ends with its run twice; the labels are the tokens themselves (the model
    shifts), on both repeats but the first repeat's first token, and nowhere else."""
    for tokens, labels in copy_batch(random.Random(1), list(range(300, 400)), 50, 3, 9):
        assert len(tokens) == len(labels)
        known = [i for i, y in enumerate(labels) if y != IGNORE]
        assert all(labels[i] == tokens[i] for i in known)
        run = (len(known) + 1) // 2
        assert 3 <= run <= 9
        assert known == list(range(len(tokens) - 2 * run + 1, len(tokens)))
        assert tokens[-run:] == tokens[-2 * run : -run]
        # the run was seen before the gap: copying it is possible
        first = len(tokens) - 2 * run
        assert any(tokens[i : i + run] == tokens[-run:] for i in range(first - run + 1))


def test_collate_pads_right_and_ignores_the_padding(tok):
    batch = copy_batch(random.Random(0), copy_ids(tok), 6, 2, 8)
    out = collate(batch, tok.pad_token_id)
    lengths = [len(t) for t, _ in batch]
    assert out["input_ids"].shape == out["labels"].shape == (6, max(lengths))
    assert out["attention_mask"].sum(1).tolist() == lengths
    assert (out["labels"][out["attention_mask"] == 0] == IGNORE).all()
    assert (out["input_ids"][out["attention_mask"] == 0] == tok.pad_token_id).all()


def test_copy_ids_are_the_tokenizers_merges_without_specials(tok):
    ids = copy_ids(tok)
    assert min(ids) >= 256 and max(ids) < len(tok)
    assert not set(ids) & set(tok.all_special_ids)
    assert len(ids) == len(tok) - 256 - len(set(tok.all_special_ids) - set(range(256)))


def test_the_warm_up_teaches_the_model_to_copy(tok):
    """400 steps on short runs take the micro model's loss on the repeats below what any
    model that does not copy can reach: the tokens are uniform over the merges, so without the
    context the best loss is ln(number of merges)."""
    ids = copy_ids(tok)
    model = build_tiny_model(tok, MICRO, seed=0)
    held = collate(copy_batch(random.Random(99), ids, 64, 2, 6), tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        start = model(**held).loss.item()
    log = warm_up(
        model, tok, CopyWarmup(steps=400, batch_size=16, min_run=2, max_run=6, lr=3e-3), seed=0
    )
    with torch.no_grad():
        end = model(**held).loss.item()
    assert [r["step"] for r in log] == list(range(50, 401, 50))
    assert log[-1]["copy_loss"] < log[0]["copy_loss"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert start > math.log(len(ids)) > end + 0.5, (start, end, math.log(len(ids)))


def test_warm_up_settings_are_checked():
    with pytest.raises(ValidationError, match="min_run 9 exceeds max_run 4"):
        CopyWarmup(min_run=9, max_run=4)
    with pytest.raises(ValidationError):
        CopyWarmup(steps=0)
