"""The Redis Cluster the cluster tests run on: 3 masters, 3 replicas, and a real failover."""

from __future__ import annotations

import pytest
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient

from tests.redis_cluster import RedisCluster

pytestmark = pytest.mark.redis


def test_six_nodes_three_masters_and_a_promoted_replica_keeps_every_slot():
    with RedisCluster() as cluster:
        masters = cluster.masters()
        assert len(masters) == 3
        client = ClusterClient(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
        try:
            for shard in range(16):
                client.set(f"probe:{{s{shard}}}:k", shard)
            killed, promoted = cluster.fail_master()
            assert killed in masters and promoted not in masters
            assert sorted(cluster.masters()) == sorted({*masters, promoted} - {killed})
            client.nodes_manager.initialize()
            values = [client.get(f"probe:{{s{shard}}}:k") for shard in range(16)]
            # replication is asynchronous, but nothing wrote during the failover
            assert values == [str(shard).encode() for shard in range(16)]
        finally:
            client.close()
