"""Every signal receiver of the counters app, connected in one place."""

from __future__ import annotations

from django.db import connections
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate


def connect_signals(app_config) -> None:
    """Connect the app's receivers (called once from ``CountersConfig.ready()``)."""
    from . import schedule, transactions

    post_migrate.connect(
        schedule.ensure_periodic_task_after_migrate,
        sender=app_config,
        dispatch_uid="counters.ensure_periodic_task",
    )
    connection_created.connect(
        transactions.connection_created, dispatch_uid="counters.follow_transactions"
    )
    for conn in connections.all(initialized_only=True):
        transactions.install(conn)
