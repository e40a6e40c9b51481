"""The ``COUNTERS_*`` settings: each value valid, and the combinations that hold together."""

from __future__ import annotations

import math
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register

from counters.base import conf
from counters.buffer.cluster import node_urls
from counters.buffer.sentinel import master_options, sentinel_addresses
from counters.verify.drift import CONFIRM_READINGS
from counters.write.outbox import OUTBOX_SAFE_AGE

POSITIVE = {
    "COUNTERS_SHARDS": "counters.E001",
    "COUNTERS_BATCH_SIZE": "counters.E002",
    "COUNTERS_FLUSH_INTERVAL": "counters.E003",
    "COUNTERS_FLUSH_TIME_BUDGET": "counters.E004",
    "COUNTERS_LEASE_TIMEOUT": "counters.E005",
    "COUNTERS_SOCKET_TIMEOUT": "counters.E006",
    "COUNTERS_LEDGER_RETENTION": "counters.E007",
    "COUNTERS_FLUSH_PARALLELISM": "counters.E017",
    "COUNTERS_AUDIT_SLICE": "counters.E020",
    "COUNTERS_AUDIT_RETENTION": "counters.E021",
    "COUNTERS_SEND_BATCH": "counters.E030",
    "COUNTERS_FLUSH_LANES": "counters.E031",
    "COUNTERS_WRITE_BATCH": "counters.E093",
}


def _number(name: str, check_id: str) -> tuple[Any, list[CheckMessage]]:
    """Setting ``name`` read as a number, or the error ``check_id`` saying it is not one."""
    try:
        return conf.get(name), []
    except (TypeError, ValueError) as exc:
        return None, [Error(f"{name} is not a valid number: {exc}", id=check_id)]


@register(Tags.compatibility)
def check_settings(app_configs=None, **kwargs):
    errors: list[CheckMessage] = []
    for name, check_id in POSITIVE.items():
        value, invalid = _number(name, check_id)
        if invalid:
            errors += invalid
            continue
        if value is None or not math.isfinite(value) or value <= 0:
            errors.append(
                Error(
                    f"{name} must be a finite number greater than 0 (got {value!r}).", id=check_id
                )
            )
    errors += check_audit_interval()
    errors += check_durable()
    errors += _boolean("COUNTERS_DEFER_ACKS", "counters.E026")
    errors += check_send_delay()
    errors += check_audit_window()
    prefix = conf.get("COUNTERS_KEY_PREFIX")
    if not prefix or any(c in prefix for c in "{} "):
        errors.append(
            Error(
                f"COUNTERS_KEY_PREFIX {prefix!r} must be non-empty, without braces or spaces.",
                id="counters.E008",
            )
        )
    errors.extend(check_redis_url())
    errors.extend(check_sentinels())
    return errors


#: URL schemes of one Redis or Valkey server.
URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


def check_redis_url() -> list[Error]:
    """E009: a redis URL; with COUNTERS_REDIS_CLUSTER, one or several cluster node URLs;
    with COUNTERS_REDIS_SENTINELS, a URL of the master's scheme, credentials and database."""
    url = conf.redis_url()
    if _cluster_on():
        try:
            node_urls(url)
        except ValueError as exc:
            return [Error(f"COUNTERS_REDIS_URL {url!r}: {exc}.", id="counters.E009")]
        return []
    if not url.startswith(URL_SCHEMES):
        return [Error(f"COUNTERS_REDIS_URL {url!r} is not a redis URL.", id="counters.E009")]
    if "," in url:
        return [
            Error(
                f"COUNTERS_REDIS_URL {url!r} lists several URLs.",
                hint="A list of nodes names a Redis Cluster: set COUNTERS_REDIS_CLUSTER.",
                id="counters.E009",
            )
        ]
    if conf.raw("COUNTERS_REDIS_SENTINELS"):
        try:
            master_options(url)
        except ValueError as exc:
            return [Error(f"COUNTERS_REDIS_URL {url!r}: {exc}.", id="counters.E009")]
    return []


def _cluster_on() -> bool:
    try:
        return conf.redis_cluster()
    except (TypeError, ValueError):
        return False


def check_sentinels() -> list[Error]:
    """E080: COUNTERS_REDIS_SENTINELS names sentinels (host:port); E081: a service name;
    E082: not with COUNTERS_REDIS_CLUSTER."""
    raw = conf.raw("COUNTERS_REDIS_SENTINELS")
    if raw is None or raw == "" or raw == []:
        return []
    name = "COUNTERS_REDIS_SENTINELS"
    if not isinstance(raw, (str, list, tuple)):
        return [Error(f"{name} must be a list of host:port, got {raw!r}.", id="counters.E080")]
    try:
        sentinel_addresses(conf.redis_sentinels())
    except ValueError as exc:
        return [
            Error(
                f"{name} {raw!r}: {exc}.",
                hint='List each sentinel as "host:port", e.g. ["10.0.0.1:26379", '
                '"10.0.0.2:26379"], or "host:port,host:port" in the environment.',
                id="counters.E080",
            )
        ]
    errors = []
    service = conf.raw("COUNTERS_REDIS_SENTINEL_SERVICE")
    if not isinstance(service, str) or not service.strip() or any(c.isspace() for c in service):
        errors.append(
            Error(
                f"COUNTERS_REDIS_SENTINEL_SERVICE must be the name the sentinels monitor the "
                f"master under, without spaces (got {service!r}).",
                id="counters.E081",
            )
        )
    if _cluster_on():
        errors.append(
            Error(
                f"{name} and COUNTERS_REDIS_CLUSTER are both set: a Redis Cluster fails "
                "over by itself, without sentinels.",
                hint="Set one of them.",
                id="counters.E082",
            )
        )
    return errors


def check_audit_interval() -> list[CheckMessage]:
    """COUNTERS_AUDIT_INTERVAL: a whole number of seconds, 0 (or None) for off."""
    name = "COUNTERS_AUDIT_INTERVAL"
    value, invalid = _number(name, "counters.E022")
    if invalid:
        return invalid
    if value is not None and value < 0:
        return [
            Error(
                f"{name} must be 0 (off) or a number of seconds greater than 0 (got {value!r}).",
                id="counters.E022",
            )
        ]
    return []


def _boolean(name: str, check_id: str) -> list[CheckMessage]:
    """An error if setting ``name`` is not a boolean (nor a boolean word in the environment)."""
    raw = conf.raw(name)
    if isinstance(raw, bool) or (
        isinstance(raw, str) and raw.strip().lower() in conf.TRUE_WORDS | conf.FALSE_WORDS
    ):
        return []
    return [
        Error(
            f"{name} must be a boolean (True/False, or 1/0, true/false, yes/no, "
            f"on/off in the environment), got {raw!r}.",
            id=check_id,
        )
    ]


def check_durable() -> list[CheckMessage]:
    """E023: COUNTERS_DURABLE a boolean; E024/E025: COUNTERS_OUTBOX_GRACE in range."""
    errors = _boolean("COUNTERS_DURABLE", "counters.E023")
    name = "COUNTERS_OUTBOX_GRACE"
    grace, invalid = _number(name, "counters.E024")
    if invalid:
        return [*errors, *invalid]
    if grace is None or not math.isfinite(grace) or grace <= 0:
        return [
            *errors,
            Error(
                f"{name} must be a finite number of seconds greater than 0 (got {grace!r}).",
                id="counters.E024",
            ),
        ]
    try:
        interval = float(conf.flush_interval() or 0)
    except (TypeError, ValueError):
        interval = 0.0  # E003 reports it
    if grace + interval >= OUTBOX_SAFE_AGE:
        errors.append(
            Error(
                f"{name} ({grace:g} s) plus COUNTERS_FLUSH_INTERVAL ({interval:g} s) must be "
                f"less than {OUTBOX_SAFE_AGE:g} s: an outbox row older than that can no longer "
                "be pushed safely (Redis forgets its push id) and is repaired from the truth "
                "instead.",
                hint="Lower COUNTERS_OUTBOX_GRACE (the default is 30).",
                id="counters.E025",
            )
        )
    return errors


def check_send_delay() -> list[CheckMessage]:
    """COUNTERS_SEND_DELAY_MS: 0 (every COMMIT pushes) up to a second."""
    name = "COUNTERS_SEND_DELAY_MS"
    value, invalid = _number(name, "counters.E029")
    if invalid:
        return invalid
    if value is not None and not (math.isfinite(value) and 0 <= value <= 1000):
        return [
            Error(
                f"{name} must be 0 (off) or milliseconds up to 1000 (got {value!r}).",
                hint="A process killed while deltas wait loses them until the audit repairs "
                "them: keep the delay short.",
                id="counters.E029",
            )
        ]
    return []


def check_audit_window() -> list[CheckMessage]:
    """E070: the audit's confirmation window is longer than a commit may wait in a sender.

    The audit repairs a difference that ``CONFIRM_READINGS`` readings,
    ``2 * COUNTERS_SOCKET_TIMEOUT + 0.2`` s apart, showed. A commit queued by
    the per-process sender reaches Redis only ``COUNTERS_SEND_DELAY_MS``
    later, plus a socket timeout if its push fails: a window shorter than that
    contradicts the sender's delay (the audit stretches its readings to it,
    but every process must share the setting).
    """
    try:
        delay = conf.send_delay()
        timeout = float(conf.socket_timeout())
    except (TypeError, ValueError):
        return []  # E006 or E029 reports it
    if not (math.isfinite(delay) and math.isfinite(timeout)) or delay <= 0 or timeout <= 0:
        return []
    window = (CONFIRM_READINGS - 1) * (2 * timeout + 0.2)
    if window >= delay + timeout:
        return []
    return [
        Error(
            f"The audit's confirmation window ({window:g} s: {CONFIRM_READINGS} readings "
            f"2 x COUNTERS_SOCKET_TIMEOUT + 0.2 s apart) is shorter than a commit may wait in "
            f"the sender (COUNTERS_SEND_DELAY_MS, {delay * 1000:g} ms, plus "
            f"COUNTERS_SOCKET_TIMEOUT, {timeout:g} s): the audit would take a commit still "
            "queued in another process for drift.",
            hint="Raise COUNTERS_SOCKET_TIMEOUT or lower COUNTERS_SEND_DELAY_MS, the same in "
            "every process.",
            id="counters.E070",
        )
    ]
