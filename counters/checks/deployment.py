"""``check --deploy``: the Redis the settings name answers, keeps every key (no eviction) and
keeps something on disk."""

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
    return _config(client, "maxmemory-policy")


def _config(client: Any, parameter: str) -> set[str]:
    """The values of ``parameter`` on the Redis behind ``client`` (every node of a cluster)."""
    reply = client.config_get(parameter)
    found: set[str] = set()

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def walk(value: Any) -> None:  # a cluster answers {node: {name: value}}
        if isinstance(value, dict):
            for name, item in value.items():
                if text(name) == parameter:
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


@register("counters", deploy=True)
def check_redis_persistence(app_configs=None, **kwargs):
    """W020: Redis keeps nothing on disk (``appendonly no`` and ``save ""``), so a restart
    loses every buffered delta. Nothing when CONFIG is refused or Redis is unreachable."""
    try:
        client = get_client()
        appendonly, save = _config(client, "appendonly"), _config(client, "save")
    except RedisError:
        return []
    if "yes" in appendonly or not appendonly or any(s.strip() for s in save):
        return []
    return [
        Warning(
            f'Redis at {conf.redis_where()} keeps nothing on disk (appendonly no, save ""): '
            "a restart loses every buffered delta, and their counts stay wrong until the "
            "rebuild the flush starts.",
            hint="Enable appendonly (appendfsync everysec) or RDB snapshots in Redis; set "
            "COUNTERS_DURABLE = True to lose nothing on a restart, and keep the periodic "
            "audit (COUNTERS_AUDIT_INTERVAL) to repair what a loss left wrong.",
            id="counters.W020",
        )
    ]
