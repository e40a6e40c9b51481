"""The small helpers every module shares: log caps, an exception's first line, bytes to str."""

from __future__ import annotations

import pytest

from counters.base.utils import LOG_DELTAS, capped, first_line, to_str


def test_capped_keeps_the_first_items_only():
    deltas = {f"unread:{i}": i for i in range(1000)}
    shown = capped(deltas)
    assert len(shown) == LOG_DELTAS == 20
    assert shown == {f"unread:{i}": i for i in range(20)}
    assert capped({"a": 1}, limit=5) == {"a": 1}


@pytest.mark.parametrize(
    ("exc", "limit", "line"),
    [
        pytest.param(ValueError("first\nsecond"), None, "first", id="multi-line"),
        pytest.param(ValueError("  \n padded \n"), None, "padded", id="stripped"),
        pytest.param(KeyError(), None, "KeyError", id="empty: the type"),
        pytest.param(RuntimeError("x" * 50), 10, "x" * 10, id="capped"),
    ],
)
def test_first_line(exc, limit, line):
    assert first_line(exc, limit) == line


def test_to_str():
    assert to_str(b"unread:7") == "unread:7"
    assert to_str("unread:7") == "unread:7"
    assert to_str(None) is None
