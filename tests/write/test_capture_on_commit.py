"""A project's own Django TestCase sees its counters: captureOnCommitCallbacks sends the deltas."""

from __future__ import annotations

import contextlib

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import TestCase

import counters
from notifications.models import Notification, UnreadCounter

pytestmark = pytest.mark.redis


class CaptureOnCommitTest(TestCase):
    def test_executed_callbacks_send_the_deltas_once(self) -> None:
        user = get_user_model().objects.create(username="captured")
        member = f"unread:{user.pk}"
        with self.captureOnCommitCallbacks(execute=True) as callbacks:
            transaction.on_commit(lambda: None)  # someone else's, registered first
            Notification.objects.create(recipient=user, verb="a")
            Notification.objects.create(recipient=user, verb="b")
            self.assertEqual(UnreadCounter.objects.get_count(user), 2)  # its own changes
            self.assertEqual(counters.get_buffer().snapshot([member]).pending[member], 0)
        self.assertEqual(len(callbacks), 2)
        counters.push_queued()  # the default sender queued them: pushed now
        self.assertEqual(counters.get_buffer().snapshot([member]).pending[member], 2)
        self.assertEqual(UnreadCounter.objects.get_count(user), 2)

    def test_a_rolled_back_savepoint_leaves_the_changes_made_after_it_sent(self) -> None:
        user = get_user_model().objects.create(username="after-rollback")
        member = f"unread:{user.pk}"
        with self.captureOnCommitCallbacks(execute=True):
            # The first counted change, in a savepoint rolled back: Django drops the
            # callbacks registered inside it.
            with contextlib.suppress(RuntimeError), transaction.atomic():
                Notification.objects.create(recipient=user, verb="rolled back")
                raise RuntimeError("roll back")
            Notification.objects.create(recipient=user, verb="kept")
            with transaction.atomic():
                Notification.objects.create(recipient=user, verb="kept, in a savepoint")
        truth = Notification.objects.filter(recipient=user, is_read=False).count()
        self.assertEqual(truth, 2)
        counters.push_queued()
        self.assertEqual(counters.get_buffer().snapshot([member]).pending[member], truth)
        self.assertEqual(UnreadCounter.objects.get_count(user), truth)
