"""A change of the buffer layout (COUNTERS_SHARDS, COUNTERS_KEY_PREFIX) with deltas pending:
the flush drains the old layout itself, exactly once, and until it has, reads miss those
deltas, so the audit and rebuilds repair nothing and the flush and counters_status say so."""

from __future__ import annotations

import json

import pytest

import counters
from counters.base.exceptions import LayoutChangePending
from counters.buffer.lease import Lease
from counters.buffer.store import Buffer, shard_of
from counters.client import get_buffer
from counters.models import BufferLayout
from counters.ops.status import gather
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild_all
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


@pytest.fixture
def sixteen_shards(settings):
    settings.COUNTERS_SHARDS = 16
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # repairs confirm drift 0.6 s apart
    settings.COUNTERS_AUTO_REBUILD = False


def notify(users, times: int) -> None:
    for user in users:
        for _ in range(times):
            Notification.objects.create(recipient=user, verb="v")


def readings(users) -> tuple[int, int, int]:
    """(truth, get_value, stored), each summed over ``users``."""
    return (
        sum(truth(u) for u in users),
        sum(UnreadCounter.objects.get_count(u) for u in users),
        sum(stored(u) for u in users),
    )


def assert_exact(users) -> None:
    """truth == get_value == stored for every user, after a flush."""
    result = counters.flush()
    assert result.layouts_pending == []
    for user in users:
        value = UnreadCounter.objects.get_count(user)
        assert (user.pk, value, stored(user)) == (user.pk, truth(user), truth(user))


def high_shard_users(make_user, n: int) -> list:
    """``n`` users whose unread counter lives in shards 8-15 of 16 (the ones 8 shards lose)."""
    users = []
    while len(users) < n:
        user = make_user()
        if shard_of(f"unread:{user.pk}", 16) >= 8:
            users.append(user)
        else:
            user.delete()
    return users


def not_drained() -> list[str]:
    return gather(get_buffer())["layouts"]["not_drained"]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_fewer_shards_the_flush_drains_the_old_ones_and_nothing_repairs_twice(
    sixteen_shards, settings, make_user
):
    low = [u for u in (make_user() for _ in range(12)) if shard_of(f"unread:{u.pk}", 16) < 8]
    high = high_shard_users(make_user, 6)
    users = low + high
    notify(users, 1)
    counters.flush()
    notify(users, 2)  # pending under 16 shards
    settings.COUNTERS_SHARDS = 8

    total = 3 * len(users)
    missed = 2 * len(high)  # pending in shards 8-15, which 8 shards never read
    assert readings(users) == (total, total - missed, len(users))
    assert not_drained() == [f"prefix {get_buffer().prefix!r}, 16 shards"]
    skipped = audit(confirm_delay=0.01)
    assert skipped.skipped and "16 shards" in skipped.skipped
    assert skipped.repaired == 0
    with pytest.raises(LayoutChangePending):
        rebuild_all()

    result = counters.flush()  # drains shards 8-15 of the old layout too
    assert result.layouts_pending == []
    assert "LAYOUT" not in result.summary()
    assert readings(users) == (total, total, total)
    assert not_drained() == []
    assert BufferLayout.objects.get(shards=16).drained_at is not None

    assert audit(confirm_delay=0.01).repaired == 0
    assert sum(r.repaired for r in rebuild_all()) == 0
    # The documented drain, a flush with the old value, finds nothing left to add.
    settings.COUNTERS_SHARDS = 16
    code, out, err = run_manage("counters_flush", "--json", env=env(COUNTERS_SHARDS="16"))
    assert (code, json.loads(out)["deltas"]) == (0, 0), err
    settings.COUNTERS_SHARDS = 8
    assert_exact(users)
    assert readings(users) == (total, total, total)


def env(**extra: str) -> dict[str, str]:
    return project_env(COUNTERS_AUTO_REBUILD="0", **extra)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_new_key_prefix_drains_the_old_one_also_from_writers_still_on_it(
    sixteen_shards, settings, counters_prefix, make_user
):
    users = [make_user() for _ in range(10)]
    notify(users, 3)  # pending under the old prefix, never flushed
    new_prefix = f"{counters_prefix}.moved"
    settings.COUNTERS_KEY_PREFIX = new_prefix
    assert readings(users) == (30, 0, 0)

    old = f"prefix {counters_prefix!r}, 16 shards"
    old_buffer = Buffer(get_buffer().client, counters_prefix, 16)
    busy = next(s for s in range(16) if old_buffer.pending_count(s))
    with Lease(old_buffer.client, old_buffer.key(busy, "lease"), 30) as lease:
        assert lease.held  # another flusher holds one shard of the old prefix
        code, out, err = run_manage("counters_flush", "--json", env=env(COUNTERS_SHARDS="16"))
        assert code == 5, err
        assert json.loads(out)["layouts_pending"] == [old]
        assert f"deltas of buffer layout {old} are not drained yet" in err
        assert not_drained() == [old]
        assert audit(confirm_delay=0.01).skipped
    assert readings(users)[0] > readings(users)[2]
    result = counters.flush()
    assert result.layouts_pending == []
    assert readings(users) == (30, 30, 30)

    # A process that still runs with the old prefix keeps writing there (it recorded
    # that layout at its first push and does not again).
    settings.COUNTERS_KEY_PREFIX = counters_prefix
    notify(users, 1)
    settings.COUNTERS_KEY_PREFIX = new_prefix
    assert readings(users) == (40, 30, 30)
    assert not_drained() == [old]
    assert audit(confirm_delay=0.01).skipped
    assert_exact(users)
    assert readings(users) == (40, 40, 40)
    assert audit(confirm_delay=0.01).repaired == 0
    assert_exact(users)


def test_a_layout_the_flush_cannot_reach_is_reported_until_drained(
    sixteen_shards, settings, make_user
):
    """A layout on the other kind of Redis (cluster or not) is drained by a flush run with
    its settings; until then the flush exits 5 and counters_status shows it."""
    users = [make_user() for _ in range(3)]
    notify(users, 1)
    prefix = get_buffer().prefix
    BufferLayout.objects.create(prefix=prefix, shards=16, cluster=True)  # as a cluster writer
    cluster = f"prefix {prefix!r}, 16 shards, Redis Cluster"

    result = counters.flush()
    assert result.layouts_pending == [cluster]
    assert "LAYOUT CHANGE NOT DRAINED" in result.summary()
    assert not_drained() == [cluster]
    code, out, err = run_manage("counters_flush", env=env(COUNTERS_SHARDS="16"))
    assert code == 5, err
    assert f"deltas of buffer layout {cluster} are not drained yet" in err
    code, out, err = run_manage("counters_status", env=env(COUNTERS_SHARDS="16"))
    assert code == 0, err
    assert f"LAYOUT CHANGE NOT DRAINED: deltas of {cluster}" in out
    with pytest.raises(LayoutChangePending):
        rebuild_all()
    assert readings(users) == (3, 3, 3)


@pytest.fixture
def eager(settings):
    """COUNTERS_FLUSH_PARALLELISM = 4 (the beat task's parallel run), sent tasks run inline."""
    from config.celery import app

    settings.COUNTERS_FLUSH_PARALLELISM = 4
    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_parallel_run_drains_the_old_layout_before_it_sends_the_parts(
    sixteen_shards, eager, settings, make_user
):
    from counters import tasks

    users = [make_user() for _ in range(8)] + high_shard_users(make_user, 4)
    notify(users, 2)  # pending under 16 shards, never flushed
    settings.COUNTERS_SHARDS = 8
    missed = 2 * sum(shard_of(f"unread:{u.pk}", 16) >= 8 for u in users)
    assert missed >= 8 and readings(users) == (24, 24 - missed, 0)
    tasks.flush_counters()
    assert readings(users) == (24, 24, 24)
    assert not_drained() == []
    last = gather(get_buffer())["last_flush"]
    assert (last["layouts_pending"], last["parallel"]["reported"]) == ([], 4)
    notify(users, 1)
    tasks.flush_counters()
    assert audit(confirm_delay=0.01).repaired == 0
    assert readings(users) == (36, 36, 36)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_new_prefix_on_another_redis_is_a_loss_not_a_silent_drain(
    sixteen_shards, own_redis, settings, counters_prefix, make_user
):
    """The old layout's shards are looked for on the Redis in use: on another one its epoch
    tokens are missing, which is a loss of the new prefix's counts until a rebuild."""
    from tests.redis_server import RedisServer

    users = [make_user() for _ in range(5)]
    notify(users, 2)  # pending under the old prefix, on the first Redis
    with RedisServer() as other:
        settings.COUNTERS_REDIS_URL = other.url
        settings.COUNTERS_KEY_PREFIX = f"{counters_prefix}.moved"
        notify(users, 1)
        result = counters.flush()
        assert result.layouts_pending == []  # nothing of it on this Redis
        assert result.rebuild_needed_since is not None
        assert readings(users) == (15, 5, 5)
        rebuild_all()
        assert_exact(users)
        assert counters.flush().rebuild_needed_since is None
        assert readings(users) == (15, 15, 15)


def test_a_layout_that_appears_during_a_rebuild_stops_its_repairs(
    sixteen_shards, make_user, monkeypatch
):
    """A process with other settings records its layout while a rebuild confirms a drift:
    the repair is refused, since reads now miss what that process pushes."""
    from counters.buffer.store import Buffer
    from counters.verify import rebuild
    from counters.write import preflight

    users = [make_user() for _ in range(3)]
    notify(users, 2)
    counters.flush()
    UnreadCounter.objects.filter(user=users[0]).update(count=7)  # drift: raw SQL
    real_sleep = rebuild.time.sleep

    def new_writer_starts(seconds: float) -> None:
        buffer = get_buffer()
        preflight.record_layout(Buffer(buffer.client, buffer.prefix, 8), "default")
        real_sleep(seconds)

    monkeypatch.setattr(rebuild.time, "sleep", new_writer_starts)
    with pytest.raises(LayoutChangePending):
        rebuild_all()
    assert readings(users) == (6, 11, 11)  # nothing repaired: 7 + 2 + 2 stays
    assert not_drained() == [f"prefix {get_buffer().prefix!r}, 8 shards"]


def test_a_flush_with_the_old_settings_drains_a_retired_layout_and_retires_nothing(
    sixteen_shards, settings, counters_prefix, make_user
):
    """The drain of a layout the new flush cannot reach: stop its writers, run one flush
    with its settings. That flush drains it and leaves the new layout in use."""
    from django.utils import timezone

    users = [make_user() for _ in range(4)]
    notify(users, 2)  # pending under the old layout
    old = BufferLayout.objects.get(prefix=counters_prefix, shards=16, cluster=False)
    # What the first flush on a Redis Cluster does: record its layout, retire this one.
    new = BufferLayout.objects.create(prefix=counters_prefix, shards=16, cluster=True)
    BufferLayout.objects.filter(pk=old.pk).update(retired_at=timezone.now())
    assert not_drained() == [str(old)]  # seen from the old settings: this layout waits

    code, out, err = run_manage("counters_flush", "--json", env=env(COUNTERS_SHARDS="16"))
    assert code == 0, err
    assert (json.loads(out)["deltas"], json.loads(out)["layouts_pending"]) == (8, [])
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.drained_at is not None and old.drained_at >= old.retired_at
    assert new.retired_at is None  # still the layout in use
    assert not_drained() == []
    assert readings(users) == (8, 8, 8)
