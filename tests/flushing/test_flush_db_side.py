"""A flush that meets a database-side failure (a counter table renamed or gone in a deploy
window) leaves its batch in flight, quarantines nothing, and exits non-zero."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

import counters
from counters.base.exceptions import FlushFailed
from counters.client import get_buffer
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]

TABLE = UnreadCounter._meta.db_table
HIDDEN = f"{TABLE}_hidden"


def rename(old: str, new: str) -> None:
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {qn(old)} RENAME TO {qn(new)}")


@pytest.fixture
def table_renamed() -> Iterator[None]:
    """The counter table is renamed (a migration half done); renamed back afterwards."""
    rename(TABLE, HIDDEN)
    try:
        yield
    finally:
        rename(HIDDEN, TABLE)


@pytest.fixture
def users(settings, make_user) -> list:
    settings.COUNTERS_SHARDS = 4
    people = [make_user() for _ in range(30)]
    Notification.objects.notify(people, verb="v")
    Notification.objects.notify(people[:10], verb="w")
    return people


def test_a_missing_counter_table_quarantines_nothing_and_fails_the_flush(users, table_renamed):
    buffer = get_buffer()
    with pytest.raises(FlushFailed) as info:
        counters.flush()
    assert info.value.result.quarantined == 0
    assert buffer.quarantined() == []
    assert len(info.value.errors) == len({buffer.shard_of(f"unread:{u.pk}") for u in users}), (
        "each shard with deltas fails, and none is quarantined"
    )
    assert buffer.inflight_ids(), "the batches stay in flight"


def test_the_command_exits_non_zero_with_one_line(users, table_renamed):
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command("counters_flush", stdout=out, stderr=err)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("flush failed in "), line
    assert get_buffer().quarantined() == []


def test_once_the_table_is_back_every_delta_is_applied_once(users):
    rename(TABLE, HIDDEN)
    try:
        with pytest.raises(FlushFailed):
            counters.flush()
    finally:
        rename(HIDDEN, TABLE)
    result = counters.flush()
    assert result.quarantined == 0
    assert result.recovered >= 1
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    assert sum(truth(u) for u in users) == 40
    assert get_buffer().inflight_ids() == {}
