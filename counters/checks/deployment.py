"""``check --deploy``: the Redis the settings name answers and keeps every key (no eviction)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from redis import RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base import conf
from counters.client import get_client


@register("counters", deploy=True)
def check_redis_reachable(app_configs=None, **kwargs):
    try:
        get_client().ping()
    except RedisError as exc:
        return [
            Warning(
                f"Redis is unreachable at {conf.redis_where()}: {exc}",
                hint="Counter deltas fall back to direct DB writes until it is back.",
                id="counters.W001",
            )
        ]
    return []


#: Eviction policies that may evict any key, the pending deltas included.
EVICTS_ANY = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def _eviction_policies(client: Any) -> set[str]:
    """``maxmemory-policy`` of the Redis behind ``client`` (of every node of a cluster)."""
    reply = client.config_get("maxmemory-policy")
    found: set[str] = set()

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def walk(value: Any) -> None:  # a cluster answers {node: {name: value}}
        if isinstance(value, dict):
            for name, item in value.items():
                if text(name) == "maxmemory-policy":
                    found.add(text(item))
                else:
                    walk(item)

    walk(reply)
    return found


@register("counters", deploy=True)
def check_redis_eviction(app_configs=None, **kwargs):
    """E071: an ``allkeys-*`` policy evicts buffered deltas; W018: ``volatile-*`` evicts
    leases and push fences; W019: the policy cannot be read (CONFIG disabled).

    Redis unreachable is W001's (``check_redis_reachable``): nothing here.
    """
    try:
        policies = _eviction_policies(get_client())
    except (RedisConnectionError, RedisTimeoutError):
        return []
    except RedisError as exc:
        return [
            Warning(
                f"Could not read Redis's maxmemory-policy at {conf.redis_where()}: {exc}",
                hint="Make sure it is noeviction: an evicting policy drops buffered deltas.",
                id="counters.W019",
            )
        ]
    messages: list[CheckMessage] = []
    for policy in sorted(policies):
        if policy in EVICTS_ANY:
            messages.append(
                Error(
                    f"Redis at {conf.redis_where()} has maxmemory-policy {policy}: at maxmemory "
                    "it evicts buffered deltas, and their counts are lost until a rebuild.",
                    hint="Set maxmemory-policy noeviction: a full Redis then refuses pushes "
                    "and commits write to the database directly.",
                    id="counters.E071",
                )
            )
        elif policy.startswith("volatile-"):
            messages.append(
                Warning(
                    f"Redis at {conf.redis_where()} has maxmemory-policy {policy}: at maxmemory "
                    "it evicts keys with a TTL, the flush leases and the fences of late "
                    "pushes among them.",
                    hint="Set maxmemory-policy noeviction.",
                    id="counters.W018",
                )
            )
    return messages
