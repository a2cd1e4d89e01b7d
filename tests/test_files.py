"""Atomic writes and JSONL: nothing half-written, bad lines reported with their line."""

from __future__ import annotations

import os

import pytest

from kitchen.config import KitchenError
from kitchen.files import atomic_write_bytes, atomic_write_text, read_jsonl, write_jsonl


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "sub" / "f.txt"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert [x.name for x in p.parent.iterdir()] == ["f.txt"]  # no temp files left
    assert p.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(p, b"new")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.txt"]


def test_jsonl_round_trip_and_append(tmp_path):
    p = tmp_path / "r.jsonl"
    write_jsonl(p, [{"a": 1}, {"b": "é"}])
    write_jsonl(p, [{"c": 3}], append=True)
    assert list(read_jsonl(p)) == [{"a": 1}, {"b": "é"}, {"c": 3}]


def test_jsonl_bad_line_is_located(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\n\n{oops\n')
    with pytest.raises(KitchenError, match=r"r.jsonl:3: line: not valid JSON"):
        list(read_jsonl(p))
    p.write_text("[1, 2]\n")
    with pytest.raises(KitchenError, match="expected a JSON object"):
        list(read_jsonl(p))
