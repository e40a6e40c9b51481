"""Poison isolation: a delta that cannot be applied is quarantined, the rest of its shard
is applied exactly once, and the quarantine is shown, retried and discarded."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection

import counters
from counters.base import registry
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.models import FlushBatch
from counters.ops.run import flush
from counters.ops.status import gather
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]

BIGINT_MAX = 2**63 - 1


@dataclass
class Poison:
    """A delta pushed straight into the buffer that no flush can apply as things are."""

    member: str
    delta: int
    counter: str
    error: str  # what the quarantined entry's error starts with
    fix: Callable[[], None] | None  # None: nothing makes it applicable
    value: Callable[[], int]  # its counter's stored value, to check after a retry
    expected: int  # that value once the fixed delta is applied


@pytest.fixture
def four_shards(settings):
    settings.COUNTERS_SHARDS = 4


@pytest.fixture
def isolated_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def unknown_counter(make_user) -> Poison:
    """A counter renamed by a deploy: its buffered deltas name a counter no longer registered."""
    owner = make_user()
    return Poison(
        member=f"renamed:{owner.pk}",
        delta=3,
        counter="renamed",
        error="UnknownCounter: no counter named 'renamed' is registered",
        fix=lambda: counters.register("renamed", "notifications.UnreadCounter"),
        value=lambda: stored(owner),
        expected=3,
    )


def bad_key(make_user) -> Poison:
    return Poison(
        member="unread:abc",
        delta=2,
        counter="unread",
        error="ValidationError",
        fix=None,
        value=lambda: 0,
        expected=0,
    )


def bigint_overflow(make_user) -> Poison:
    """A stored value near 2**63 - 1 plus a delta: PostgreSQL and MySQL refuse the bigint."""
    owner = make_user()
    UnreadCounter.objects.create(user=owner, count=BIGINT_MAX - 9)
    return Poison(
        member=f"unread:{owner.pk}",
        delta=100,
        counter="unread",
        error="DataError: "
        + ("bigint out of range" if connection.vendor == "postgresql" else "integer out of range"),
        fix=lambda: UnreadCounter.objects.filter(user=owner).update(count=0),
        value=lambda: stored(owner),
        expected=100,
    )


overflow_refused = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite turns an integer overflow into a float"
)
KINDS = [
    pytest.param(unknown_counter, id="unknown-counter"),
    pytest.param(bad_key, id="bad-key"),
    pytest.param(bigint_overflow, id="bigint-overflow", marks=overflow_refused),
]
FIXABLE = [KINDS[0], KINDS[2]]


def buffer():
    return get_buffer()


def users_around(make_user, shard: int, same: int = 4, other: int = 4) -> list:
    """Users with unread notifications: ``same`` of them in ``shard``, ``other`` elsewhere."""
    mine, others = [], []
    while len(mine) < same or len(others) < other:
        user = make_user()
        in_shard = buffer().shard_of(f"unread:{user.pk}") == shard
        (mine if in_shard else others).append(user)
    users = mine + others
    for i, user in enumerate(users):
        for _ in range(i % 3 + 1):
            Notification.objects.create(recipient=user, verb="v")
    Notification.objects.filter(recipient=users[0]).first().mark_read()
    return users


def plant(poison: Poison) -> int:
    """Push the poison member into its shard; returns the shard."""
    buf = buffer()
    buf.push({poison.member: poison.delta}, "poison")
    return buf.shard_of(poison.member)


@pytest.fixture(params=KINDS)
def poisoned(request, four_shards, isolated_registry, make_user):
    """A shard holding a poison delta and good deltas, and other shards with good deltas."""
    poison = request.param(make_user)
    shard = plant(poison)
    users = users_around(make_user, shard)
    return poison, users


def assert_good(users) -> None:
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    assert sum(truth(u) for u in users) > len(users)  # the check is not vacuous


def test_poison_is_quarantined_and_the_rest_of_its_shard_applied(poisoned):
    poison, users = poisoned
    result = counters.flush()  # raises FlushFailed if a shard failed
    assert (result.quarantined, result.failed_shards) == (1, {})
    assert_good(users)
    [entry] = buffer().quarantined()
    assert (entry.member, entry.delta) == (poison.member, poison.delta)
    assert entry.counter == poison.counter
    assert entry.error.startswith(poison.error), entry.error
    assert buffer().inflight_ids() == {}
    # Applied once: a second flush finds nothing, and the ledger holds each good delta once.
    again = counters.flush()
    assert (again.batches, again.quarantined) == (0, 0)
    assert_good(users)
    assert sum(FlushBatch.objects.values_list("deltas", flat=True)) == sum(map(truth, users))


def test_status_shows_the_quarantine_by_counter(poisoned):
    poison, _ = poisoned
    counters.flush()
    quarantine = gather(buffer())["quarantine"]
    assert quarantine["deltas"] == 1
    group = quarantine["counters"][poison.counter]
    assert (group["count"], group["sum"]) == (1, poison.delta)
    [example] = group["examples"]
    assert (example["member"], example["delta"]) == (poison.member, poison.delta)
    assert example["error"].startswith(poison.error)
    out = io.StringIO()
    call_command("counters_status", stdout=out)
    text = out.getvalue()
    assert "QUARANTINED: 1 deltas" in text
    assert f"  {poison.counter}: 1 deltas, sum {poison.delta:+d}" in text
    assert f"    {poison.member} ({poison.delta:+d}): {poison.error}" in text


@pytest.mark.parametrize("kind", FIXABLE)
def test_retry_after_the_fix_applies_the_delta_once(
    kind, four_shards, isolated_registry, make_user, caplog
):
    poison = kind(make_user)
    plant(poison)
    users = users_around(make_user, buffer().shard_of(poison.member), same=2, other=2)
    counters.flush()
    before = poison.value()
    assert len(buffer().quarantined()) == 1
    poison.fix()
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="counters"):
        call_command("counters_flush", "--retry-quarantined", stdout=out)
    assert "1 quarantined deltas retried" in out.getvalue()
    [line] = [r for r in caplog.records if "quarantined deltas of prefix" in r.getMessage()]
    assert line.levelno == logging.INFO
    assert f"retrying 1 quarantined deltas of prefix {buffer().prefix!r}: " in line.getMessage()
    assert f"{poison.counter} (1)" in line.getMessage()
    assert buffer().quarantined() == []
    assert poison.value() == poison.expected != before
    call_command("counters_flush", "--retry-quarantined", stdout=io.StringIO())
    counters.flush()
    assert poison.value() == poison.expected
    assert_good(users)


def test_a_retried_delta_that_fails_again_is_quarantined_again_then_discarded(
    four_shards, make_user, caplog
):
    poison = bad_key(make_user)
    plant(poison)
    users = users_around(make_user, buffer().shard_of(poison.member), same=2, other=2)
    counters.flush()
    [first] = buffer().quarantined()
    result = flush(using="default", retry_quarantined=True)
    assert (result.requeued, result.quarantined) == (1, 1)
    [second] = buffer().quarantined()
    assert (second.member, second.delta) == (first.member, first.delta)
    assert second.field != first.field  # failed again, in another batch
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="counters"):
        call_command("counters_flush", "--discard-quarantined", stdout=io.StringIO())
    [line] = [r for r in caplog.records if "quarantined deltas of prefix" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "discarded 1 quarantined deltas" in line.getMessage()
    assert "(sum +2): unread (1)" in line.getMessage()
    assert buffer().quarantined() == []
    assert buffer().pending_count(buffer().shard_of(poison.member)) == 0
    assert_good(users)


def test_retry_and_discard_exclude_each_other():
    with pytest.raises(CommandError, match="not allowed with argument"):
        call_command("counters_flush", "--retry-quarantined", "--discard-quarantined")


def test_a_retry_puts_each_delta_back_once(four_shards, make_user):
    poison = bad_key(make_user)
    plant(poison)
    counters.flush()
    entries = buffer().quarantined()
    assert buffer().requeue(entries) == (1, [])
    assert buffer().requeue(entries) == (0, [])  # a second retry of the same entries
    shard = buffer().shard_of(poison.member)
    assert buffer().client.zscore(buffer().key(shard, "pending"), poison.member) == poison.delta


def test_several_poisons_in_one_batch_are_each_quarantined(four_shards, make_user):
    bad = {f"unread:x{i}": i + 1 for i in range(5)}
    buffer().push(bad, "poison")
    users = [make_user() for _ in range(10)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    result = counters.flush()
    assert result.quarantined == 5
    assert {e.member: e.delta for e in buffer().quarantined()} == bad
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1] * 10


@overflow_refused
def test_overflow_of_one_key_does_not_hold_up_the_keys_after_it(four_shards, make_user):
    """The applier sorts keys: a poison key in the middle of a batch of hundreds."""
    users = [make_user() for _ in range(300)]
    Notification.objects.notify(users, verb="v")
    victim = users[150]
    UnreadCounter.objects.create(user=victim, count=BIGINT_MAX)
    result = counters.flush()
    assert result.quarantined == 1
    [entry] = buffer().quarantined()
    assert (entry.member, entry.delta) == (f"unread:{victim.pk}", 1)
    rows = dict(UnreadCounter.objects.values_list("user_id", "count"))
    assert rows[victim.pk] == BIGINT_MAX
    assert sorted(pk for pk, count in rows.items() if count == 1) == sorted(
        u.pk for u in users if u != victim
    )


def test_a_poison_is_found_in_halvings_while_a_backlog_waits(settings, make_user):
    """Halves sent back to pending are moved by themselves next, not mixed into the backlog."""
    settings.COUNTERS_SHARDS = 1
    settings.COUNTERS_BATCH_SIZE = 64
    User = get_user_model()
    User.objects.bulk_create([User(username=f"backlog-{i}") for i in range(511)])
    pks = list(User.objects.filter(username__startswith="backlog-").values_list("pk", flat=True))
    # The poison's delta is the lowest score, so the first batch takes it; as a member it
    # sorts after every numeric key, so each narrowing sends it back with the second half.
    buffer().push({"unread:abc": -1, **{f"unread:{pk}": 1 for pk in pks}}, "backlog")
    attempts: list[tuple[int, bool]] = []
    real = flusher.apply_batch

    def spy(batch, using, result):
        try:
            real(batch, using, result)
        except Exception:
            attempts.append((len(batch.items), False))
            raise
        attempts.append((len(batch.items), True))

    with mock.patch.object(flusher, "apply_batch", spy):
        result = counters.flush()
    assert [size for size, ok in attempts if not ok] == [64, 32, 16, 8, 4, 2, 1]
    assert result.quarantined == 1
    assert [(e.member, e.delta) for e in buffer().quarantined()] == [("unread:abc", -1)]
    assert sum(size for size, ok in attempts if ok) == len(pks)
    rows = dict(UnreadCounter.objects.filter(user_id__in=pks).values_list("user_id", "count"))
    assert rows == dict.fromkeys(pks, 1)
