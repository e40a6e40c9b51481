"""Bootstrap of the processes the bench spawns: Django on the parent's database and prefix."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

#: Settings a child takes over from the parent (values read through ``counters.base.conf``).
COUNTER_SETTINGS = (
    "COUNTERS_REDIS_URL",
    "COUNTERS_KEY_PREFIX",
    "COUNTERS_SHARDS",
    "COUNTERS_BATCH_SIZE",
    "COUNTERS_SOCKET_TIMEOUT",
    "COUNTERS_LEASE_TIMEOUT",
    "COUNTERS_REDIS_CLUSTER",
)


@dataclass(frozen=True)
class ChildContext:
    """What a spawned process needs to run against the parent's database and Redis prefix."""

    settings_module: str
    database: dict[str, Any]
    counters: dict[str, str]

    @classmethod
    def from_parent(cls) -> ChildContext:
        from django.conf import settings
        from django.db import connection

        from .internals import conf

        values: dict[str, object] = {
            "COUNTERS_REDIS_URL": conf.redis_url(),
            "COUNTERS_KEY_PREFIX": conf.key_prefix(),
            "COUNTERS_SHARDS": conf.shards(),
            "COUNTERS_BATCH_SIZE": conf.batch_size(),
            "COUNTERS_SOCKET_TIMEOUT": conf.socket_timeout(),
            "COUNTERS_LEASE_TIMEOUT": conf.lease_timeout(),
        }
        if "COUNTERS_REDIS_CLUSTER" in conf.SETTINGS:  # a Redis Cluster, where supported
            values["COUNTERS_REDIS_CLUSTER"] = "1" if conf.get("COUNTERS_REDIS_CLUSTER") else "0"
        return cls(
            settings_module=settings.SETTINGS_MODULE
            or os.environ.get("DJANGO_SETTINGS_MODULE", ""),
            database=dict(connection.settings_dict),
            counters={name: str(value) for name, value in values.items()},
        )

    def setup(self) -> None:
        """Configure Django in this (fresh) process. Call before importing any model."""
        os.environ["DJANGO_SETTINGS_MODULE"] = self.settings_module
        os.environ.update(self.counters)
        import django
        from django.conf import settings

        settings.DATABASES = {"default": dict(self.database)}
        for name, value in self.counters.items():
            setattr(settings, name, value)
        django.setup()


def peak_rss_kb() -> int:
    """Peak resident set size of this process so far, in KiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
