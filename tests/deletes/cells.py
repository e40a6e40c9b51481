"""Helpers of the deletion tests: counters declared for one test, and their SQL truth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

import counters
from counters.base import registry
from counters.tracking import trackers


@pytest.fixture
def declare(monkeypatch) -> Iterator[Any]:
    """``declare(name, model, **track_kwargs)``: counters declared for this test alone."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names", "_middles"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))

    def track(name: str, model: Any, **kwargs: Any) -> None:
        counters.track(name, model, **kwargs)

    yield track


def sql_counts(sql: str, params: list[Any] | None = None) -> dict[Any, int]:
    """``{key: n}`` of a ``SELECT key, COUNT(*) ... GROUP BY key`` (NULL keys left out)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return {key: n for key, n in cursor.fetchall() if key is not None}


def stored(model: Any, key_attname: str, column: str = "n") -> dict[Any, int]:
    """``{key: value}`` of the nonzero stored counter rows of ``model``."""
    rows = model.objects.values_list(key_attname, column)
    return {key: value for key, value in rows if value}


def values(name: str, keys: Any) -> dict[Any, int]:
    """``{key: get_value}`` of ``keys``, nonzero ones only."""
    found = {key: counters.get_value(name, key) for key in keys}
    return {key: value for key, value in found.items() if value}
