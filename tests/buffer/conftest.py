"""Fixtures of the buffer tests (fakeredis).

``client`` here is a fakeredis server, not pytest-django's test client: no test of this
folder makes HTTP requests.
"""

from __future__ import annotations

import fakeredis
import pytest


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    """A fakeredis server of this test alone."""
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())
