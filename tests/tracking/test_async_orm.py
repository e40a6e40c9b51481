"""Django's async ORM writes are counted exactly, as their sync twins are.

``acreate``, ``abulk_create``, ``aget_or_create``, ``aupdate_or_create``,
``aupdate``, ``adelete`` and ``asave`` run the counted sync path in a thread.
Each path runs here in an event loop with no sync thread above it (as in an
async view under an ASGI server), on the blog's two counters (a count with a
``where`` and a sum of ``points``) and the unread count, and each counter is
checked against SQL: read from the loop with ``aget_value`` at once, and
stored after a flush.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.db.models import F

import counters
from notifications.models import Notification, UnreadCounter
from tests.blog.models import Comment, Post
from tests.blog.truth import COUNTERS, stored, truth
from tests.helpers import stored as stored_unread
from tests.helpers import truth as unread_truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def in_loop(work: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work()`` in a new event loop of this thread; the thread it hops to closes its
    database connections before the loop ends."""

    async def main() -> Any:
        try:
            return await work()
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(main())


async def acreate(p1: Post, p2: Post) -> None:
    await Comment.objects.acreate(post=p1, approved=True, points=3)
    await Comment.objects.acreate(post=p2, approved=False, points=8)


async def abulk_create(p1: Post, p2: Post) -> None:
    await Comment.objects.abulk_create(
        [
            Comment(post=p1, approved=True, points=2),
            Comment(post=p2, approved=False, points=4),
            Comment(post=p2, approved=True, points=7),
        ]
    )


async def aget_or_create(p1: Post, p2: Post) -> None:
    _, created = await Comment.objects.aget_or_create(
        post=p1, text="first", defaults={"approved": True, "points": 6}
    )
    assert created
    _, created = await Comment.objects.aget_or_create(post=p1, text="first")
    assert not created


async def aupdate_or_create(p1: Post, p2: Post) -> None:
    moved = await Comment.objects.filter(post=p1, approved=True).afirst()
    assert moved is not None
    # an update that moves the row to the other post and changes its points
    await Comment.objects.aupdate_or_create(pk=moved.pk, defaults={"post": p2, "points": 9})
    _, created = await Comment.objects.aupdate_or_create(
        post=p2, text="new", defaults={"approved": True, "points": 5}
    )
    assert created


async def aupdate(p1: Post, p2: Post) -> None:
    assert await Comment.objects.filter(post=p1).aupdate(approved=False) == 3
    assert await Comment.objects.filter(post=p2).aupdate(points=F("points") * 2) == 2


async def adelete(p1: Post, p2: Post) -> None:
    await Comment.objects.filter(post=p1, points__gt=1).adelete()
    comment = await Comment.objects.filter(post=p2, approved=True).afirst()
    assert comment is not None
    await comment.adelete()


async def asave(p1: Post, p2: Post) -> None:
    stale = await Comment.objects.filter(post=p1, approved=True, points=1).aget()
    # another request changes the row after this instance was loaded
    await Comment.objects.filter(pk=stale.pk).aupdate(points=10)
    stale.approved = False
    await stale.asave()  # counted from the row's real old state: -1 comment, -10 points
    fresh = Comment(post=p2, approved=True, points=11)
    await fresh.asave()
    fresh.points = 12
    await fresh.asave(update_fields=["points"])


PATHS = [acreate, abulk_create, aget_or_create, aupdate_or_create, aupdate, adelete, asave]


@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_async_write_is_counted_exactly(path):
    p1, p2 = Post.objects.create(title="one"), Post.objects.create(title="two")
    Comment.objects.create(post=p1, approved=True, points=1)
    Comment.objects.create(post=p1, approved=True, points=2)
    Comment.objects.create(post=p1, approved=False, points=4)
    Comment.objects.create(post=p2, approved=True, points=5)
    Comment.objects.create(post=p2, approved=False, points=1)
    before = {(name, p.pk): truth(name, p) for name in COUNTERS for p in (p1, p2)}

    async def write_then_read() -> dict:
        await path(p1, p2)
        keys = [(name, p.pk) for name in COUNTERS for p in (p1, p2)]
        return {(name, pk): await counters.aget_value(name, pk) for name, pk in keys}

    read = in_loop(write_then_read)
    expected = {(name, p.pk): truth(name, p) for name in COUNTERS for p in (p1, p2)}
    assert expected != before  # the path changed what the counters count
    assert read == expected
    counters.flush()
    assert {(name, p.pk): stored(name, p) for name in COUNTERS for p in (p1, p2)} == expected


def test_async_writes_of_notifications_are_counted_exactly(make_user):
    alice, bob = make_user(), make_user()

    async def work() -> tuple[int, int]:
        first = await Notification.objects.acreate(recipient=alice, verb="a")
        await Notification.objects.abulk_create(
            [Notification(recipient=bob, verb="b"), Notification(recipient=bob, verb="c")]
        )
        await Notification.objects.filter(recipient=bob).aupdate(is_read=True)
        await Notification.objects.aupdate_or_create(pk=first.pk, defaults={"recipient": bob})
        await Notification.objects.acreate(recipient=alice, verb="d", is_read=True)
        await Notification.objects.filter(recipient=alice).adelete()
        return (
            await UnreadCounter.objects.aget_count(alice),
            await UnreadCounter.objects.aget_count(bob),
        )

    assert in_loop(work) == (unread_truth(alice), unread_truth(bob)) == (0, 1)
    counters.flush()
    assert (stored_unread(alice), stored_unread(bob)) == (0, 1)
