"""The app's system checks, one id each (``counters.E0xx``, ``counters.W0xx``), by concern.

Importing this package registers them all (``CountersConfig.ready()``).
"""

from counters.checks.deployment import (
    check_redis_eviction,
    check_redis_persistence,
    check_redis_reachable,
)
from counters.checks.project import (
    check_acknowledge_middleware,
    check_databases,
    check_metrics_dir,
    check_routes,
    check_trackers,
)
from counters.checks.settings import POSITIVE, check_settings

__all__ = [
    "POSITIVE",
    "check_acknowledge_middleware",
    "check_databases",
    "check_metrics_dir",
    "check_redis_eviction",
    "check_redis_persistence",
    "check_redis_reachable",
    "check_routes",
    "check_settings",
    "check_trackers",
]
