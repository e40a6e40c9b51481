"""Every ``COUNTERS_*`` setting, its type and its default, read at call time.

Lookup order for each name: the Django setting, then an environment variable
of the same name, then the default below. Reading at call time means
``override_settings`` and changed environments take effect without a restart
of anything but the process that reads them.

The few settings every counted write reads (:func:`write_switches`) are the
exception: they are parsed once and kept until Django's ``setting_changed``
(``override_settings``, pytest-django's ``settings``) says a ``COUNTERS_*``
setting changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed


@dataclass(frozen=True)
class Setting:
    name: str
    type: type
    default: Any
    doc: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "COUNTERS_REDIS_URL",
            str,
            None,
            "Redis server holding the buffer. Default: the REDIS_URL setting, "
            "else redis://127.0.0.1:6379/0.",
        ),
        Setting(
            "COUNTERS_REDIS_CLUSTER",
            bool,
            False,
            "COUNTERS_REDIS_URL names a Redis Cluster: any node, or several node URLs "
            "comma-separated (a process finds the cluster if one of them answers).",
        ),
        Setting(
            "COUNTERS_REDIS_SENTINELS",
            list,
            None,
            "Redis Sentinel: the sentinels to ask for the master of "
            "COUNTERS_REDIS_SENTINEL_SERVICE, a list of host:port (or a comma-separated string "
            "in the environment). COUNTERS_REDIS_URL then gives only the scheme, credentials "
            "and database of the master. Default: no Sentinel.",
        ),
        Setting(
            "COUNTERS_REDIS_SENTINEL_SERVICE",
            str,
            "mymaster",
            "With COUNTERS_REDIS_SENTINELS, the name the sentinels monitor the master under.",
        ),
        Setting("COUNTERS_KEY_PREFIX", str, "counters", "Prefix of every Redis key Tally writes."),
        Setting(
            "COUNTERS_SHARDS",
            int,
            16,
            "Number of shards. Each shard is one sorted set with its own lease; "
            "shards spread over a Redis Cluster. Changing it strands pending deltas "
            "in the old shards until they are flushed with the old value.",
        ),
        Setting(
            "COUNTERS_BATCH_SIZE",
            int,
            5000,
            "Most keys moved and applied in one DB transaction (5000: a flush of a backlog "
            "runs fewer, larger batches, see docs/benchmarks.md).",
        ),
        Setting(
            "COUNTERS_FLUSH_INTERVAL",
            int,
            10,
            "Seconds between two runs of the periodic flush task (django-celery-beat).",
        ),
        Setting(
            "COUNTERS_FLUSH_PARALLELISM",
            int,
            1,
            "Celery workers one run of the periodic flush is split over: the beat task "
            "sends this many counters.flush_shards tasks per database, each flushing a "
            "disjoint set of shards (at most COUNTERS_SHARDS parts). 1: the beat task "
            "flushes every shard itself.",
        ),
        Setting(
            "COUNTERS_FLUSH_LANES",
            int,
            2,
            "Shards one flush drains side by side, each lane a thread with a database "
            "connection of its own; their batches' statements take turns, so one lane "
            "moves its next batch out of Redis, or commits one, while another's statement "
            "runs. 1: one shard after another. A flush inside a transaction, or on SQLite, "
            "uses one.",
        ),
        Setting(
            "COUNTERS_FLUSH_TIME_BUDGET",
            float,
            30.0,
            "Seconds one flush may spend before it stops starting new batches.",
        ),
        Setting(
            "COUNTERS_LEASE_TIMEOUT",
            float,
            30.0,
            "Seconds a shard lease lives unless extended; a dead flusher's lease "
            "expires after this long.",
        ),
        Setting(
            "COUNTERS_SOCKET_TIMEOUT",
            float,
            2.0,
            "Seconds a Redis call may take before the write path falls back to the DB.",
        ),
        Setting(
            "COUNTERS_LEDGER_RETENTION",
            int,
            7 * 24 * 3600,
            "Seconds applied batch ids are kept in the FlushBatch ledger.",
        ),
        Setting(
            "COUNTERS_AUTO_REBUILD",
            bool,
            True,
            "Run the full rebuild from the flush while a Redis data loss is not repaired. "
            "A rebuild is safe under live writes and is what makes the counts exact again.",
        ),
        Setting(
            "COUNTERS_DATABASES",
            list,
            None,
            "Database aliases a flush without an alias drains (the periodic task, "
            "notification_update_counter without --database); a list, or a comma-separated "
            "string in the environment. Default: every alias the database routers let "
            "the counters app migrate to.",
        ),
        Setting(
            "COUNTERS_METRICS",
            bool,
            False,
            "Serve the Prometheus exposition at the counters app's /metrics view; "
            "off, the view answers 404.",
        ),
        Setting(
            "COUNTERS_SEND_DELAY_MS",
            float,
            200.0,
            "Milliseconds committed deltas may wait in this process's queue before a "
            "background thread pushes them, many commits in one round trip "
            "(counters.write.sender); a request's are pushed before its response, a Celery "
            "task's when it ends. 0: every COMMIT pushes its own deltas before returning.",
        ),
        Setting(
            "COUNTERS_SEND_BATCH",
            int,
            500,
            "With COUNTERS_SEND_DELAY_MS, commits that make the sender push at once.",
        ),
        Setting(
            "COUNTERS_DEFER_ACKS",
            bool,
            True,
            "A committed push is written to Redis and its reply read later: by the next "
            "push, before any read of a counter in the process, before the request's "
            "response is returned (counters.middleware.AcknowledgeMiddleware) or within "
            "50 ms. Off: every COMMIT waits for its push's reply.",
        ),
        Setting(
            "COUNTERS_WRITE_BATCH",
            int,
            1,
            "With COUNTERS_DEFER_ACKS, pushes a thread hands to Redis in one write outside a "
            "request (a command, a Celery task, a script): written once that many wait, or "
            "within 50 ms. 1: each push is written as its COMMIT ends. More: fewer system "
            "calls and less Redis CPU per push, but a process killed before the write loses "
            "those commits until the audit repairs them.",
        ),
        Setting(
            "COUNTERS_AUDIT_INTERVAL",
            int,
            10,
            "Seconds between two runs of the periodic audit (django-celery-beat); 0 turns "
            "the periodic audit off.",
        ),
        Setting(
            "COUNTERS_AUDIT_SLICE",
            int,
            1000,
            "Keys of each counter one audit run compares with the truth.",
        ),
        Setting(
            "COUNTERS_AUDIT_RETENTION",
            int,
            90 * 24 * 3600,
            "Seconds the audit's repair records (AuditRepair) are kept.",
        ),
        Setting(
            "COUNTERS_DURABLE",
            bool,
            False,
            "Durable mode: the deltas of each transaction are also written, inside it, to "
            "the outbox table (one row per transaction and database); the next flush deletes "
            "the rows whose push applied in Redis. A writer killed between COMMIT and its push "
            "loses nothing: the flush pushes rows older than COUNTERS_OUTBOX_GRACE. Costs one "
            "INSERT in the transaction.",
        ),
        Setting(
            "COUNTERS_OUTBOX_GRACE",
            float,
            30.0,
            "Seconds an outbox row is left to its writer before a flush pushes it itself "
            "(the writer died, or Redis was down). COUNTERS_OUTBOX_GRACE plus "
            "COUNTERS_FLUSH_INTERVAL must stay under the age after which a row can no longer "
            "be pushed safely (OUTBOX_SAFE_AGE, 120 s): older rows are repaired from the truth.",
        ),
    )
}

_MISSING = object()


#: Strings a boolean setting accepts (any case); anything else is an error (see checks.py).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def parse(setting: Setting, raw: Any) -> Any:
    """Convert ``raw`` (a setting value or an environment string) to the setting's type."""
    if raw is None:
        return None
    if setting.type is bool and isinstance(raw, str):
        return raw.strip().lower() in TRUE_WORDS
    if setting.type is list:
        items = raw.split(",") if isinstance(raw, str) else raw
        return [str(item).strip() for item in items if str(item).strip()]
    if setting.type is int and isinstance(raw, float) and not raw.is_integer():
        raise ValueError(f"{setting.name} must be a whole number, got {raw!r}")
    return setting.type(raw)


def get(name: str) -> Any:
    setting = SETTINGS[name]
    raw = getattr(django_settings, name, _MISSING)
    if raw is _MISSING:
        raw = os.environ.get(name, setting.default)
    return parse(setting, raw)


def redis_url() -> str:
    return get("COUNTERS_REDIS_URL") or getattr(
        django_settings, "REDIS_URL", "redis://127.0.0.1:6379/0"
    )


def redis_cluster() -> bool:
    return bool(get("COUNTERS_REDIS_CLUSTER"))


def redis_where() -> str:
    """Where the buffer's Redis is looked for, for messages: its URL, or with Sentinel the
    service and the sentinels that name its master."""
    try:
        sentinels = redis_sentinels()
    except (TypeError, ValueError):  # a bad setting: counters.E080 names it
        sentinels = []
    if not sentinels:
        return redis_url()
    return f"{redis_sentinel_service()!r} via sentinels {','.join(sentinels)}"


def redis_sentinels() -> list[str]:
    """``COUNTERS_REDIS_SENTINELS``: the sentinels' addresses, empty when Sentinel is not used."""
    return get("COUNTERS_REDIS_SENTINELS") or []


def redis_sentinel_service() -> str:
    return get("COUNTERS_REDIS_SENTINEL_SERVICE")


def key_prefix() -> str:
    return get("COUNTERS_KEY_PREFIX")


def shards() -> int:
    return get("COUNTERS_SHARDS")


def batch_size() -> int:
    return get("COUNTERS_BATCH_SIZE")


def flush_interval() -> int:
    return get("COUNTERS_FLUSH_INTERVAL")


def flush_parallelism() -> int:
    return get("COUNTERS_FLUSH_PARALLELISM")


def flush_lanes() -> int:
    return get("COUNTERS_FLUSH_LANES")


def flush_time_budget() -> float:
    return get("COUNTERS_FLUSH_TIME_BUDGET")


def lease_timeout() -> float:
    return get("COUNTERS_LEASE_TIMEOUT")


def socket_timeout() -> float:
    return get("COUNTERS_SOCKET_TIMEOUT")


def ledger_retention() -> int:
    return get("COUNTERS_LEDGER_RETENTION")


def auto_rebuild_enabled() -> bool:
    return get("COUNTERS_AUTO_REBUILD")


def configured_databases() -> list[str] | None:
    """``COUNTERS_DATABASES``: the aliases a flush drains, None for every one it may migrate."""
    return get("COUNTERS_DATABASES")


def metrics_enabled() -> bool:
    return get("COUNTERS_METRICS")


def send_delay() -> float:
    """Seconds committed deltas may wait for the per-process sender; 0 when it is off."""
    return (get("COUNTERS_SEND_DELAY_MS") or 0.0) / 1000


def send_batch() -> int:
    return get("COUNTERS_SEND_BATCH")


def defer_acks() -> bool:
    return get("COUNTERS_DEFER_ACKS")


def write_batch() -> int:
    return get("COUNTERS_WRITE_BATCH")


def audit_interval() -> int:
    """Seconds between periodic audits; 0 when the periodic audit is off (0 or None)."""
    return get("COUNTERS_AUDIT_INTERVAL") or 0


def audit_slice() -> int:
    return get("COUNTERS_AUDIT_SLICE")


def audit_retention() -> int:
    return get("COUNTERS_AUDIT_RETENTION")


def durable() -> bool:
    return bool(get("COUNTERS_DURABLE"))


def outbox_grace() -> float:
    return get("COUNTERS_OUTBOX_GRACE")


def raw(name: str) -> Any:
    """The value of setting ``name`` as given (Django setting, else environment), unparsed."""
    value = getattr(django_settings, name, _MISSING)
    if value is _MISSING:
        value = os.environ.get(name, SETTINGS[name].default)
    return value


@dataclass(frozen=True, slots=True)
class WriteSwitches:
    """The settings a counted write reads, parsed once (see :func:`write_switches`)."""

    durable: bool
    send_delay: float
    defer_acks: bool
    write_batch: int


_switches: WriteSwitches | None = None


def write_switches() -> WriteSwitches:
    """``COUNTERS_DURABLE``, ``COUNTERS_SEND_DELAY_MS`` (as seconds), ``COUNTERS_DEFER_ACKS``
    and ``COUNTERS_WRITE_BATCH``.

    Read once and kept: a counted write reads them each time, and reading a
    setting costs microseconds (a missing Django setting raises inside
    ``getattr``, then the environment is searched). ``setting_changed`` drops
    them; a process that changes its environment at run time does not see it here.
    """
    switches = _switches
    if switches is None:
        switches = _read_switches()
    return switches


def _read_switches() -> WriteSwitches:
    global _switches
    _switches = WriteSwitches(durable(), send_delay(), defer_acks(), write_batch())
    return _switches


def _forget_switches(setting: str, **kwargs: Any) -> None:
    global _switches
    if setting.startswith("COUNTERS_"):
        _switches = None


setting_changed.connect(_forget_switches, dispatch_uid="counters.base.conf.switches")
