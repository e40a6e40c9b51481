"""``counters.signals.applied``: sent after COMMIT, once per counter, with exactly the deltas
the committed transaction applied; nothing for a rollback; a raising receiver harms nothing."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError, transaction

import counters
from counters.flushing import shard
from notifications.models import Notification, UnreadCounter
from tests.blog.models import Comment, Post, PostStats
from tests.helpers import cut_redis, restore_redis, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
]


@pytest.fixture
def received() -> Iterator[list[dict[str, Any]]]:
    """The keyword arguments of every ``applied`` signal sent while the test runs."""
    calls: list[dict[str, Any]] = []

    def receiver(sender, **kwargs):
        calls.append({"sender": sender, **kwargs})

    counters.signals.applied.connect(receiver, weak=False)
    try:
        yield calls
    finally:
        counters.signals.applied.disconnect(receiver)


@pytest.fixture
def raising() -> Iterator[None]:
    """A receiver that raises, connected first."""

    def receiver(sender, **kwargs):
        raise RuntimeError("receiver failed")

    counters.signals.applied.connect(receiver, weak=False)
    try:
        yield
    finally:
        counters.signals.applied.disconnect(receiver)


@pytest.fixture
def one_shard(settings):
    """One shard: a flush of a small backlog is one transaction."""
    settings.COUNTERS_SHARDS = 1


def merged(calls: list[dict[str, Any]]) -> dict[str, dict[Any, int]]:
    """{counter: {key: delta}} over several sends, checking that none repeats a key: each
    transaction (a shard's batch) applies a key once."""
    out: dict[str, dict[Any, int]] = {}
    for call in calls:
        mine = out.setdefault(call["counter"], {})
        assert not set(mine) & set(call["deltas"]), "a key sent twice"
        assert all(call["deltas"].values()), "a zero delta sent"
        mine.update(call["deltas"])
    return out


def rows() -> dict[int, int]:
    """Stored unread counts by user id."""
    return dict(UnreadCounter.objects.values_list("user_id", "count"))


def changed(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """{key: after - before}, nonzero only."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k) != before.get(k)}


def users_with_changes(make_user) -> list:
    """Users with a flushed count, then changes of every kind buffered (one nets to zero)."""
    users = [make_user() for _ in range(6)]
    Notification.objects.notify(users, verb="first")
    counters.flush()
    Notification.objects.notify(users[:3], verb="second")
    Notification.objects.filter(recipient=users[3]).mark_all_read()
    Notification.objects.filter(recipient=users[4]).delete()
    gone = Notification.objects.create(recipient=users[5], verb="created then deleted")
    gone.delete()
    return users


@pytest.mark.usefixtures("one_shard")
def test_a_flush_sends_exactly_the_deltas_it_applied(make_user, received):
    users = users_with_changes(make_user)
    received.clear()
    before = rows()
    counters.flush()
    after = rows()
    assert after == {u.pk: truth(u) for u in users}
    assert [(c["counter"], c["using"], c["sender"]) for c in received] == [
        ("unread", "default", UnreadCounter)
    ]
    assert (
        received[0]["deltas"]
        == changed(before, after)
        == {
            users[0].pk: 1,
            users[1].pk: 1,
            users[2].pk: 1,
            users[3].pk: -1,
            users[4].pk: -1,
        }
    )
    counters.flush()  # nothing buffered: nothing sent
    assert len(received) == 1


def test_each_shard_batch_sends_its_own_keys(settings, make_user, received):
    settings.COUNTERS_SHARDS = 8
    users = users_with_changes(make_user)
    received.clear()
    before = rows()
    result = counters.flush()
    assert len(received) == result.batches
    assert merged(received) == {"unread": changed(before, rows())}
    assert rows() == {u.pk: truth(u) for u in users}


@pytest.mark.usefixtures("one_shard")
def test_one_send_per_counter_of_the_transaction(received):
    posts = [Post.objects.create() for _ in range(3)]
    for i, post in enumerate(posts):
        Comment.objects.bulk_create([Comment(post=post, approved=True, points=5)] * (i + 1))
    counters.flush()
    by_counter = {c["counter"]: c["deltas"] for c in received}
    assert len(received) == len(by_counter) == 2
    comments = dict(PostStats.objects.values_list("post_id", "comments"))
    points = dict(PostStats.objects.values_list("post_id", "points"))
    assert by_counter == {"post_comments": comments, "post_points": points}
    assert comments == {p.pk: Comment.objects.filter(post=p).count() for p in posts}


def test_a_rolled_back_flush_sends_nothing_and_the_next_one_sends_once(
    make_user, received, monkeypatch
):
    users = users_with_changes(make_user)
    received.clear()
    before = rows()
    real = shard.ledger.record_batch

    def record_then_fail(batch, using):
        real(batch, using)
        raise OperationalError("injected: the connection was lost")

    monkeypatch.setattr(shard.ledger, "record_batch", record_then_fail)
    with pytest.raises(counters.FlushFailed):
        counters.flush()
    assert received == []
    assert rows() == before
    monkeypatch.undo()
    counters.flush()
    assert merged(received) == {"unread": changed(before, rows())}
    assert rows() == {u.pk: truth(u) for u in users}


def test_inside_an_outer_transaction_it_waits_for_the_commit(make_user, received):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    with transaction.atomic():
        counters.flush()
        assert received == []
    assert [c["deltas"] for c in received] == [{alice.pk: 1}]
    assert stored(alice) == truth(alice) == 1


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_direct_write_sends_what_it_applied(settings, make_user, received):
    alice, bob = make_user(), make_user()
    Notification.objects.notify([alice, bob], verb="v")
    counters.flush()
    received.clear()
    saved = cut_redis(settings)
    try:
        with transaction.atomic():
            Notification.objects.notify([alice, alice, bob], verb="w")
            Notification.objects.filter(recipient=bob).mark_all_read()
        with pytest.raises(RuntimeError), transaction.atomic():
            Notification.objects.create(recipient=alice, verb="rolled back")
            raise RuntimeError
    finally:
        restore_redis(settings, saved)
    assert [(c["counter"], c["deltas"]) for c in received] == [
        ("unread", {alice.pk: 2, bob.pk: -1})
    ]
    assert (stored(alice), stored(bob)) == (truth(alice), truth(bob)) == (3, 0)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_raising_receiver_breaks_nothing(make_user, raising, received, caplog, settings):
    users = users_with_changes(make_user)
    received.clear()
    before = rows()
    with caplog.at_level(logging.ERROR, logger="django.dispatch"):
        result = counters.flush()
    assert not result.failed_shards
    after = rows()
    assert after == {u.pk: truth(u) for u in users}
    assert merged(received) == {"unread": changed(before, after)}
    assert "receiver failed" in caplog.text
    # a direct write too: applied, recorded, the other receiver told
    saved = cut_redis(settings)
    try:
        Notification.objects.create(recipient=users[0], verb="direct")
    finally:
        restore_redis(settings, saved)
    assert stored(users[0]) == truth(users[0])
    assert received[-1]["deltas"] == {users[0].pk: 1}


@pytest.mark.parametrize("seed", [3, 17])
def test_a_random_mix_of_paths_flushes_and_direct_writes_is_told_exactly(
    seed, settings, make_user, received
):
    """Every step is a counted path, a flush, or a direct write (Redis cut);
    after each flush the sum of every delta sent so far is the stored rows' change from the
    start, and the stored rows are the SQL truth."""
    rng = random.Random(seed)
    users = [make_user() for _ in range(5)]
    counters.flush()
    start = rows()
    told: dict[Any, int] = {}

    def write() -> None:
        user = rng.choice(users)
        mine = Notification.objects.filter(recipient=user)
        step = rng.randrange(5)
        if step == 0:
            Notification.objects.create(recipient=user, verb="v")
        elif step == 1:
            Notification.objects.notify(rng.sample(users, 2), verb="w")
        elif step == 2:
            mine.filter(pk__in=list(mine.values_list("pk", flat=True)[:2])).mark_all_read()
        elif step == 3:
            mine.filter(pk__in=list(mine.values_list("pk", flat=True)[:1])).delete()
        else:
            with transaction.atomic():
                Notification.objects.create(recipient=user, verb="x")
                mine.mark_all_read()

    for _ in range(12):
        received.clear()
        for _ in range(rng.randrange(1, 6)):
            if rng.random() < 0.2:
                saved = cut_redis(settings)
                try:
                    write()
                finally:
                    restore_redis(settings, saved)
            else:
                write()
        counters.flush()
        for call in received:  # direct writes' sends, then the flush's (a key once per batch)
            assert call["counter"] == "unread" and all(call["deltas"].values())
            for key, delta in call["deltas"].items():
                told[key] = told.get(key, 0) + delta
        told = {k: d for k, d in told.items() if d}
        after = rows()
        assert {u.pk: after.get(u.pk, 0) for u in users} == {u.pk: truth(u) for u in users}
        assert told == {k: d for k, d in changed(start, after).items() if d}
