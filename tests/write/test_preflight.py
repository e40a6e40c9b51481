"""A process records its buffer's layout before its first push, and again when it comes
back to a layout (``counters.write.preflight.ensure_recorded``)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from counters.buffer.store import Buffer
from counters.models import BufferLayout
from counters.write import preflight

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(preflight, "_recorded", {})


def test_a_layout_is_recorded_once_and_again_when_a_process_comes_back_to_it(
    redis_client, counters_prefix, fresh
):
    first = Buffer(redis_client, f"{counters_prefix}-a", shards=2)
    second = Buffer(redis_client, f"{counters_prefix}-b", shards=2)
    preflight.ensure_recorded(first, "default")
    with CaptureQueriesContext(connection) as queries:
        preflight.ensure_recorded(first, "default")  # the same buffer: nothing to do
    assert len(queries) == 0
    layouts = BufferLayout.objects.filter(prefix__in=[first.prefix, second.prefix])
    assert [x.prefix for x in layouts] == [first.prefix]

    preflight.ensure_recorded(second, "default")
    assert sorted(x.prefix for x in layouts.all()) == [first.prefix, second.prefix]
    layouts.filter(prefix=first.prefix).update(retired_at=timezone.now())  # drained meanwhile

    preflight.ensure_recorded(first, "default")  # back to it: in use again
    assert BufferLayout.objects.get(prefix=first.prefix).retired_at is None
    preflight.ensure_recorded(Buffer(redis_client, first.prefix, shards=2), "default")
    assert BufferLayout.objects.filter(prefix=first.prefix).count() == 1
