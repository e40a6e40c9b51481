"""Fixtures of the unit tests (fakeredis)."""

from __future__ import annotations

import fakeredis
import pytest


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    """A fakeredis server of this test alone."""
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())
