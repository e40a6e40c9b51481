"""Every receiver of the counters app, connected in one place: :func:`connect_signals`;
and the app's own signal for projects, :data:`applied` (sent after a transaction that
changed counter rows commits: :mod:`counters.write.changes`).

Called once from ``CountersConfig.ready()``, so this module is imported only
once the app registry is ready. The receivers of each tracked model are
connected by ``counters.track()`` (:func:`counters.tracking.routes.install_tracked`).
"""

from __future__ import annotations

from types import ModuleType

from django.core.signals import request_started
from django.db import connections
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate

from counters.base import metrics
from counters.ops import schedule
from counters.tracking import counting
from counters.write import acks, sender, transactions
from counters.write.changes import applied

__all__ = ["applied", "connect_signals"]

celery_signals: ModuleType | None
try:
    from celery import signals as celery_signals
except ImportError:  # Celery is optional (the extra django-tally[celery]): cron runs the flush
    celery_signals = None


def connect_signals(app_config) -> None:
    """Connect the app's receivers (called once from ``CountersConfig.ready()``)."""
    post_migrate.connect(
        schedule.ensure_periodic_task_after_migrate,
        sender=app_config,
        dispatch_uid="counters.ensure_periodic_task",
    )
    post_migrate.connect(
        schedule.ensure_audit_task_after_migrate,
        sender=app_config,
        dispatch_uid="counters.ensure_audit_task",
    )
    connection_created.connect(
        transactions.connection_created, dispatch_uid="counters.follow_transactions"
    )
    for conn in connections.all(initialized_only=True):
        transactions.follow(conn)
    counting.rows_changed.connect(counting.count_rows, dispatch_uid="counters.count_rows")
    # Pushes acknowledged later (COUNTERS_DEFER_ACKS): a web process serving requests
    # without the middleware waits on them.
    request_started.connect(acks.request_started, dispatch_uid="counters.write.acks.request")
    if celery_signals is not None:
        _connect_celery(celery_signals)


def _connect_celery(celery: ModuleType) -> None:
    """Receivers of the end of a Celery process (``celery.signals``)."""
    # A Celery process that ends drops its live Prometheus gauges (multiprocess mode).
    celery.worker_process_shutdown.connect(
        metrics.child_exited, dispatch_uid="counters.base.metrics.child"
    )
    celery.worker_shutdown.connect(
        metrics.worker_exited, dispatch_uid="counters.base.metrics.worker"
    )
    # Queued deltas are pushed before a Celery process ends (a prefork child skips atexit).
    celery.worker_process_shutdown.connect(
        sender.drain_on_signal, dispatch_uid="counters.write.sender.child"
    )
    celery.worker_shutdown.connect(
        sender.drain_on_signal, dispatch_uid="counters.write.sender.worker"
    )
    # A task's commits are pushed (the sender) and acknowledged (COUNTERS_DEFER_ACKS) when
    # it ends.
    celery.task_postrun.connect(sender.task_ended, dispatch_uid="counters.write.acks.task")
