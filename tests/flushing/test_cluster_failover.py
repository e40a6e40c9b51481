"""A Redis Cluster failover to a replica that missed writes: what is lost, what is noticed,
and the rebuild that makes every counter exact again.

Replication is asynchronous: a master acknowledges a write before its replica
has it. Here the replica is cut off (paused, its link to the master killed)
while the master takes a flush and more pushes, then the master is SIGKILLed
and the replica promoted. The promoted replica lacks:

- the move of a batch the DB has applied: its deltas are pending again and
  would count twice. The shard's batch sequence is behind the DB's: the flush
  notices.
- pushes made after that flush: lost, and nothing can notice.

A full rebuild (``counters_rebuild``) repairs both.
"""

from __future__ import annotations

import time

import pytest
import redis
from django.core.management import call_command

import counters
from counters.flushing import epoch
from counters.models import BufferEpoch
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.redis_cluster import RedisCluster

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.redis_cluster,
    pytest.mark.timeout(180),
]


@pytest.fixture
def cluster(settings):
    """A cluster of this test alone (it kills a master)."""
    with RedisCluster() as cluster:
        settings.COUNTERS_REDIS_CLUSTER = True
        settings.COUNTERS_REDIS_URL = cluster.url
        settings.COUNTERS_SOCKET_TIMEOUT = 0.5
        settings.COUNTERS_AUTO_REBUILD = False  # show the drift before the repair
        yield cluster


def wait_promoted(cluster: RedisCluster, replica: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while replica not in cluster.masters():
        assert time.monotonic() < deadline, f"replica {replica} was not promoted"
        time.sleep(0.05)
    cluster.wait_ok()


def master_port(buffer, user) -> int:
    """Port of the master that holds the shard of ``user``'s unread counter."""
    shard = buffer.shard_of(f"unread:{user.pk}")
    return buffer.client.get_node_from_key(buffer.key(shard, "pending")).port


def drift(users) -> dict[int, int]:
    """get_count minus COUNT(*) of every user whose count is off."""
    counts = UnreadCounter.objects.get_counts(users)
    return {u.pk: counts[u.pk] - truth(u) for u in users if counts[u.pk] != truth(u)}


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_failover_to_a_replica_that_missed_a_flush_is_noticed_and_repaired(cluster, make_user):
    buffer = counters.get_buffer()
    users = [make_user() for _ in range(60)]
    for user in users:
        for _ in range(2):
            Notification.objects.create(recipient=user, verb="before")
    counters.flush()
    assert [stored(u) for u in users] == [2] * len(users)

    victim = master_port(buffer, users[0])
    on_victim = [u for u in users if master_port(buffer, u) == victim]
    flushed, lost = on_victim[::2], on_victim[1::2]
    assert flushed and lost
    for user in flushed:
        Notification.objects.create(recipient=user, verb="flushed, then the move is lost")
    replica = cluster.replica_of(victim)
    master = redis.Redis(port=victim)
    assert master.execute_command("WAIT", 1, 5000) == 1  # the replica has everything so far

    cluster.pause(replica)
    try:
        assert master.client_kill_filter(_type="replica") == 1
        counters.flush()
        for user in lost:
            Notification.objects.create(recipient=user, verb="pushed, then lost")
        master.close()
        cluster.kill(victim)
    finally:
        cluster.resume(replica)
    wait_promoted(cluster, replica)

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

    call_command("counters_rebuild", verbosity=0)
    assert drift(users) == {}
    assert epoch.rebuild_needed_since(buffer.prefix) is None
    counters.flush()
    assert [stored(u) for u in users] == [truth(u) for u in users]
