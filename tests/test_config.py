"""YAML loading: every malformed input becomes located problems, never a crash."""

from __future__ import annotations

import pytest

from kitchen.config import MAX_BYTES, KitchenError, Located, parse_yaml, read_yaml, where


def problems_of(text, path="f.yaml"):
    with pytest.raises(KitchenError) as e:
        parse_yaml(text, path)
    return e.value.problems


def test_where_formats_locations():
    """Locations print as dotted paths with [index] for list items."""
    assert where(("theorems", 2, "derives_from", 0)) == "theorems[2].derives_from[0]"
    assert where(()) == "(top level)"


def test_lines_are_recorded_for_keys_and_items():
    """Each key and list item maps to the line where it starts."""
    doc = parse_yaml("a: 1\nb:\n  - x\n  - y: 2\n")
    assert isinstance(doc, Located)
    assert doc.line_of(("a",)) == 1
    assert doc.line_of(("b", 1, "y")) == 4
    assert doc.line_of(("b", 1, "missing")) == 4  # falls back to the nearest parent


def test_syntax_error_names_file_and_line():
    """A YAML syntax error gives the file and the line of the problem."""
    (p,) = problems_of("a: 1\nb: [1, 2\nc: 3\n")
    assert p.path == "f.yaml" and p.line is not None and p.line >= 2
    assert "not valid YAML" in p.message


def test_duplicate_keys_are_reported():
    """PyYAML keeps the last duplicate silently; we report it with its line."""
    (p,) = problems_of("a: 1\nb: 2\na: 3\n")
    assert p.line == 3 and "duplicate key 'a'" in p.message


def test_empty_file():
    (p,) = problems_of("")
    assert "empty" in p.message


def test_non_utf8_bytes():
    (p,) = problems_of(b"name: caf\xe9\n")
    assert "UTF-8" in p.message


def test_huge_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * (MAX_BYTES + 10))
    with pytest.raises(KitchenError) as e:
        read_yaml(big)
    assert "limit" in str(e.value) and str(big) in str(e.value)


def test_deep_nesting():
    """Deep nesting is reported, whether our depth limit or the parser's recursion trips first."""
    for depth in (60, 5000):
        (p,) = problems_of("a: " + "[" * depth + "]" * depth)
        assert "nested" in p.message


def test_anchor_bomb_is_bounded():
    """Anchors that expand exponentially ('billion laughs') are refused, not expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    (p,) = problems_of("\n".join(lines))
    assert "anchors" in p.message


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(KitchenError, match="no such file"):
        read_yaml(tmp_path / "nope.yaml")
    with pytest.raises(KitchenError, match="is a folder"):
        read_yaml(tmp_path)
