"""A Sentinel failover to a replica that missed writes: what is lost, what is noticed, and the
rebuild that makes every counter exact again.

The same story as a Redis Cluster failover (tests/flushing/test_cluster_failover.py),
told for a master and its replica behind three sentinels. Replication is
asynchronous: here the replica is cut off (paused, its link to the master
killed) while the master takes a flush and more pushes; then the master is
SIGKILLed, the replica resumed, and the sentinels promote it. The promoted
replica lacks:

- the move of a batch the DB has applied: its deltas are pending again and
  would count twice. The shard's batch sequence is behind the DB's: the flush
  notices.
- pushes made after that flush: lost, and nothing can notice.

A full rebuild (``counters_rebuild``, the documented repair) makes every
counter exact. Writes during the failover fall back to the database.
"""

from __future__ import annotations

import pytest
import redis
from django.core.management import call_command

import counters
from counters.flushing import epoch
from counters.models import BufferEpoch, FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.redis_sentinel import SentinelSet

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.redis_sentinel,
    pytest.mark.serial,
    pytest.mark.timeout(180),
]


@pytest.fixture
def sentinels(settings):
    """A master, its replica and three sentinels of this test alone (it kills the master)."""
    with SentinelSet() as sentinels:
        settings.COUNTERS_REDIS_SENTINELS = sentinels.sentinels
        settings.COUNTERS_REDIS_SENTINEL_SERVICE = sentinels.service
        settings.COUNTERS_REDIS_URL = sentinels.url
        settings.COUNTERS_SOCKET_TIMEOUT = 0.5
        settings.COUNTERS_AUTO_REBUILD = False  # show the drift before the repair
        yield sentinels


def drift(users) -> dict[int, int]:
    """get_count minus COUNT(*) of every user whose count is off."""
    counts = UnreadCounter.objects.get_counts(users)
    return {u.pk: counts[u.pk] - truth(u) for u in users if counts[u.pk] != truth(u)}


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_failover_to_a_replica_that_missed_a_flush_is_noticed_and_repaired(sentinels, make_user):
    buffer = counters.get_buffer()
    users = [make_user() for _ in range(40)]
    for user in users:
        for _ in range(2):
            Notification.objects.create(recipient=user, verb="before")
    counters.flush()
    assert [stored(u) for u in users] == [2] * len(users)

    flushed, lost = users[::2], users[1::2]
    for user in flushed:
        Notification.objects.create(recipient=user, verb="flushed, then the move is lost")
    master_port, replica_port = sentinels.master_port(), sentinels.replica_port()
    master = redis.Redis(port=master_port)
    assert master.execute_command("WAIT", 1, 5000) == 1  # the replica has everything so far

    sentinels.pause(replica_port)
    try:
        assert master.client_kill_filter(_type="replica") == 1
        counters.flush()
        for user in lost:
            Notification.objects.create(recipient=user, verb="pushed, then lost")
        master.close()
        sentinels.kill(master_port)
    finally:
        sentinels.resume(replica_port)

    # While the sentinels have no master to name, a write goes to the database at once.
    fallback = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    during = make_user()
    Notification.objects.create(recipient=during, verb="during the failover")
    assert fallback.count() == 1
    assert stored(during) == 1

    sentinels.wait_promoted(replica_port)
    assert sentinels.master_port() == replica_port

    # Before any repair: the flushed batch is pending again, the later pushes are gone.
    assert drift(users) == {**{u.pk: 1 for u in flushed}, **{u.pk: -1 for u in lost}}
    assert epoch.rebuild_needed_since(buffer.prefix) is None

    result = counters.flush()
    moved_shards = {buffer.shard_of(f"unread:{u.pk}") for u in flushed}
    assert set(result.lost_shards) == moved_shards  # the sequence went back: noticed
    assert result.rebuild_needed_since is not None
    assert BufferEpoch.objects.filter(prefix=buffer.prefix, losses__gt=0).count() == len(
        moved_shards
    )
    # The flush applied the batch a second time; the lost pushes stay lost.
    assert [stored(u) - truth(u) for u in flushed] == [1] * len(flushed)
    assert [stored(u) - truth(u) for u in lost] == [-1] * len(lost)

    # After the promotion, writes go to the new master again.
    Notification.objects.create(recipient=during, verb="after the failover")
    assert fallback.count() == 1

    call_command("counters_rebuild", verbosity=0)
    everyone = [*users, during]
    assert drift(everyone) == {}
    assert epoch.rebuild_needed_since(buffer.prefix) is None
    counters.flush()
    assert [stored(u) for u in everyone] == [truth(u) for u in everyone]
    assert stored(during) == 2
