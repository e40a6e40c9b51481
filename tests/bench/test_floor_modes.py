"""The bench's ``floor_push`` mode, on the real Redis: each unread insert of its runs is pushed
once, after its COMMIT, by Tally's push script, and nothing outside its runs.

The quick run of the whole bench (``test_bench_command.py``) checks that a run's pushes
add up to its inserts; here what they add, where, and when. No timing is asserted.
"""

from __future__ import annotations

from binascii import crc32

import pytest
from django.db import transaction

import counters
from benchmarks.writers import PushFloor, operations, push_floor_prefix
from notifications.models import Notification

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def pushed(client, prefix: str) -> dict[str, float]:
    """member -> summed delta over the floor_push pending sets under ``prefix``."""
    sums: dict[str, float] = {}
    for key in client.scan_iter(match=f"{push_floor_prefix(prefix)}*:pending"):
        for member, score in client.zscan_iter(key):
            sums[member.decode()] = sums.get(member.decode(), 0) + score
    return sums


def test_floor_push_pushes_each_committed_unread_insert_of_its_runs_once(
    make_user, counters_prefix
):
    a, b = make_user().pk, make_user().pk
    floor = operations()["floor_push"]
    assert isinstance(floor, PushFloor)
    try:
        check_pushes(floor, a, b, counters_prefix)
    finally:
        floor.finish()
        floor.close()


def check_pushes(floor: PushFloor, a: int, b: int, counters_prefix: str) -> None:
    client = counters.get_client()
    floor(a)  # before its run: no receiver, nothing pushed
    floor.begin()
    for uid in (a, a, b):
        floor(uid)
    with counters.paused():
        Notification.objects.create(recipient_id=b, verb="bench", is_read=True)  # not unread
        with pytest.raises(RuntimeError), transaction.atomic():
            Notification.objects.create(recipient_id=b, verb="bench")
            raise RuntimeError("rolled back: never pushed")
        with transaction.atomic():
            Notification.objects.create(recipient_id=a, verb="bench")
            assert pushed(client, counters_prefix) == {f"unread:{a}": 2, f"unread:{b}": 1}
    floor.finish()  # reads every reply, and disconnects the receiver
    assert floor.unread == 0
    floor(b)  # after its run: nothing pushed
    floor.finish()
    assert pushed(client, counters_prefix) == {f"unread:{a}": 3, f"unread:{b}": 1}
    # four pushes of one writer, numbered 1, 2, 4 (a) and 3 (b): each shard's writer hash
    # holds the last it applied
    shard = {uid: crc32(f"unread:{uid}".encode()) % PushFloor.SHARDS for uid in (a, b)}
    expected = {shard[b]: 3} | {shard[a]: 4}
    prefix = push_floor_prefix(counters_prefix)
    assert {
        n: int(client.hget(f"{prefix}{{s{n}}}:w:{floor.writer}", "seq") or 0) for n in expected
    } == expected
    assert floor.seq == 4
    assert Notification.objects.filter(recipient_id__in=[a, b]).count() == 7


def test_floor_push_pushes_every_member_of_a_change_under_one_push_id(counters_prefix):
    """Two counters of one model: one command per shard the members fall on, in one write,
    all under the same sequence number."""
    from tests.blog.models import Comment, Post

    post = Post.objects.create(title="floor")
    members = [f"post_comments:{post.pk}", f"post_points:{post.pk}"]
    shards = {crc32(m.encode()) % PushFloor.SHARDS for m in members}

    def deltas(comment: Comment) -> dict[str, int] | None:
        return dict(zip(members, (1, comment.points), strict=True)) if comment.approved else None

    def insert(_: int) -> None:
        with counters.paused():
            Comment.objects.create(post=post, approved=True, points=3)

    floor = PushFloor(insert, "blog.Comment", deltas)
    try:
        floor.begin()
        floor(0)
        floor(0)
        with counters.paused():
            Comment.objects.create(post=post, approved=False)  # counted by neither
        assert floor.unread == 2 * len(shards)
        floor.finish()
    finally:
        floor.close()
    client = counters.get_client()
    assert pushed(client, counters_prefix) == {members[0]: 2, members[1]: 6}
    prefix = push_floor_prefix(counters_prefix)
    assert {n: int(client.hget(f"{prefix}{{s{n}}}:w:{floor.writer}", "seq")) for n in shards} == {
        n: 2 for n in shards
    }
    assert Comment.objects.filter(post=post).count() == 3
