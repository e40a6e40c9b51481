"""The Redis Cluster client: shards over every master, a listed node down at start, a stale
slot table, a master without the scripts, and the status and rebuild on a cluster."""

from __future__ import annotations

import pytest
from redis.cluster import ClusterNode

import counters
from counters.models import FlushBatch
from counters.ops.status import gather
from counters.verify.rebuild import rebuild
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth
from tests.redis_server import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.redis_cluster]


@pytest.fixture
def cluster(settings, redis_cluster_server):
    settings.COUNTERS_REDIS_CLUSTER = True
    settings.COUNTERS_REDIS_URL = redis_cluster_server.url
    return redis_cluster_server


def pending_key(user) -> str:
    buffer = counters.get_buffer()
    return buffer.key(buffer.shard_of(f"unread:{user.pk}"), "pending")


def fallback_writes() -> int:
    return FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count()


def test_the_shards_spread_over_every_master(cluster):
    buffer = counters.get_buffer()
    masters = {buffer.client.get_node_from_key(buffer.key(s, "pending")).port for s in range(16)}
    assert masters == set(cluster.masters())


def test_a_process_finds_the_cluster_while_the_first_listed_node_is_down(
    settings, cluster, make_user
):
    settings.COUNTERS_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0,{cluster.url}"
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    assert fallback_writes() == 0
    assert_exact(alice)
    assert stored(alice) == 1


def test_a_stale_slot_table_is_corrected_by_the_moved_reply(cluster, make_user):
    alice = make_user()
    client = counters.get_buffer().client
    key = pending_key(alice)
    right = client.get_node_from_key(key)
    wrong = next(n for n in client.get_primaries() if n.name != right.name)
    client.nodes_manager.slots_cache[client.keyslot(key)] = [wrong]  # the fault
    Notification.objects.create(recipient=alice, verb="v")
    assert client.get_node_from_key(key).name == right.name
    assert fallback_writes() == 0
    assert_exact(alice)


def test_a_master_the_slot_table_names_wrongly_and_that_cannot_be_reached_is_looked_up_again(
    cluster, make_user
):
    """Nothing reached the dead address, so the push goes to the master a refresh names."""
    alice = make_user()
    client = counters.get_buffer().client
    key = pending_key(alice)
    right = client.get_node_from_key(key)
    client.nodes_manager.slots_cache[client.keyslot(key)] = [
        ClusterNode("127.0.0.1", free_port())  # the fault: no one listens there
    ]
    Notification.objects.create(recipient=alice, verb="v")
    assert client.get_node_from_key(key).name == right.name
    assert fallback_writes() == 0
    assert_exact(alice)


def test_a_master_that_lost_its_scripts_loads_them_again(cluster, make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="v")
    client = counters.get_buffer().client
    for node in client.get_primaries():
        client.get_redis_connection(node).script_flush()  # the fault: a restarted master
    Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=bob, verb="v")
    assert fallback_writes() == 0
    assert_exact(alice, bob)
    assert (stored(alice), stored(bob)) == (2, 1)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_status_and_rebuild_see_every_master(cluster, make_user):
    users = [make_user() for _ in range(12)]
    for i, user in enumerate(users):
        for _ in range(i % 4 + 1):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    UnreadCounter.objects.filter(user=users[1]).update(count=40)  # drift by raw SQL
    Notification.objects.create(recipient=users[2], verb="buffered")
    data = gather(counters.get_buffer())
    assert [s["shard"] for s in data["shards"]] == list(range(16))
    assert data["totals"]["pending_keys"] == 1
    assert all(s["epoch"] for s in data["shards"])
    assert data["epoch"]["state"] == "ok"
    report = rebuild("unread", confirm_delay=0.05)
    assert report.repaired == 1
    assert [UnreadCounter.objects.get_count(u) for u in users] == [truth(u) for u in users]
    assert_exact(*users)
