"""The counters app's signal, and every receiver of the app, connected in one place.

:data:`rows_changed` is sent by :class:`counters.CountedQuerySet` after it
changed rows of a tracked model, inside the transaction, with the rows' old
and new values of the tracked fields: ``old`` and ``new`` are lists of
``{attname: value}`` (a created row is only in ``new``, a deleted one only
in ``old``); ``using`` is the database alias. The rows were locked while
they were read, so ``new - old`` is exactly what the change did. Its
receiver adds that difference to every counter tracking ``sender``; other
receivers may watch it too (an audit log, a cache to drop).
"""

from __future__ import annotations

from django.apps import apps
from django.db import connections, models
from django.db.backends.signals import connection_created
from django.db.models.signals import post_delete, post_migrate, pre_delete
from django.dispatch import Signal

#: Sent with ``sender`` (the model), ``old``, ``new`` and ``using``; see the module doc.
rows_changed = Signal()


def connect_signals(app_config) -> None:
    """Connect the app's receivers (called once from ``CountersConfig.ready()``)."""
    from celery.signals import worker_process_shutdown, worker_shutdown

    from . import counting, metrics, schedule, sender, transactions

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
        transactions.install(conn)
    rows_changed.connect(counting.rows_changed, dispatch_uid="counters.count_rows")
    # A Celery process that ends drops its live Prometheus gauges (multiprocess mode).
    worker_process_shutdown.connect(metrics.child_exited, dispatch_uid="counters.metrics.child")
    worker_shutdown.connect(metrics.worker_exited, dispatch_uid="counters.metrics.worker")
    # Queued deltas are pushed before a Celery process ends (a prefork child skips atexit).
    worker_process_shutdown.connect(sender.drain_on_signal, dispatch_uid="counters.sender.child")
    worker_shutdown.connect(sender.drain_on_signal, dispatch_uid="counters.sender.worker")


def connect_model(model: type[models.Model]) -> None:
    """Connect the delete receivers of a tracked model (and its proxies); idempotent.

    Called by ``counters.track()``. The receivers are connected per model, so
    Django keeps fast-deleting the rows of every model that is not tracked.
    Saves are counted without receivers (:func:`counters.counting.install_save`).
    """
    from . import counting

    senders = [model] + [
        m for m in apps.get_models() if m._meta.proxy and m._meta.concrete_model is model
    ]
    for sender in senders:
        uid = f"counters:{sender._meta.label}"
        pre_delete.connect(counting.before_delete, sender=sender, dispatch_uid=f"{uid}:pre_delete")
        post_delete.connect(counting.after_delete, sender=sender, dispatch_uid=f"{uid}:post_delete")
