"""The project's Celery app with one more task that writes counted changes.

``celery -A tests.e2e.celery_writes worker`` is the project's worker
(``config.celery.app``) that can also run ``tests.write_notifications``.
"""

from __future__ import annotations

import logging

from config.celery import app

__all__ = ["app"]

WRITE_TASK_NAME = "tests.write_notifications"
#: Logged by the task once it has committed every change (and is about to return).
WROTE = "wrote {count} notifications for user {user_id}"

logger = logging.getLogger(__name__)


@app.task(name=WRITE_TASK_NAME, ignore_result=True)
def write_notifications(user_id: int, count: int) -> None:
    from notifications.models import Notification

    for i in range(count):
        Notification.objects.create(recipient_id=user_id, verb=f"task {i}")
    logger.info(WROTE.format(count=count, user_id=user_id))
