"""With the sender, a request's commits reach Redis before its response, a task's before it ends."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from celery import shared_task
from django.db import connections
from django.http import HttpResponse
from django.test import RequestFactory

from config.celery import app
from counters import tasks
from counters.middleware import AcknowledgeMiddleware
from counters.write import sender
from notifications.models import Notification
from tests.helpers import assert_exact, in_redis, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_backend")]


@pytest.fixture(autouse=True)
def delay(settings):
    """A sender that would hold commits for a second, and push only a batch of 10,000."""
    settings.COUNTERS_SEND_DELAY_MS = 1000
    settings.COUNTERS_SEND_BATCH = 10_000


def test_a_sync_response_leaves_once_its_commits_are_pushed_in_one_batch(make_user):
    alice, bob = make_user(), make_user()

    def view(request):
        for i in range(3):
            Notification.objects.create(recipient=alice, verb=str(i))
        Notification.objects.create(recipient=bob, verb="x")
        assert (in_redis(alice), in_redis(bob)) == (0, 0)  # queued, not pushed
        return HttpResponse("ok")

    response = AcknowledgeMiddleware(view)(RequestFactory().get("/"))
    assert response.status_code == 200
    assert (in_redis(alice), in_redis(bob)) == (truth(alice), truth(bob)) == (3, 1)
    assert sender._senders["default"].batches == 1  # four commits, one push
    assert_exact(alice, bob)


def test_an_async_response_leaves_once_its_commits_are_pushed(make_user):
    alice = make_user()

    async def view(request):
        for i in range(2):
            await Notification.objects.acreate(recipient=alice, verb=str(i))
        assert await sync_to_async(in_redis)(alice) == 0
        return HttpResponse("ok")

    async def serve():
        try:
            return await AcknowledgeMiddleware(view)(RequestFactory().get("/"))
        finally:  # the connection the view's queries opened in asgiref's thread, as Django's
            await sync_to_async(connections.close_all)()  # request_finished would close it

    assert asyncio.run(serve()).status_code == 200
    assert in_redis(alice) == truth(alice) == 2
    assert_exact(alice)


@shared_task
def notify_twice(user_id: int) -> int:
    for verb in ("a", "b"):
        Notification.objects.create(recipient_id=user_id, verb=verb)
    return in_redis_of(user_id)


def in_redis_of(user_id: int) -> int:
    from django.contrib.auth import get_user_model

    return in_redis(get_user_model().objects.get(pk=user_id))


def test_a_celery_task_pushes_its_commits_when_it_ends(make_user):
    alice = make_user()
    result = notify_twice.apply(args=[alice.pk])  # run here, with Celery's task signals
    assert result.get() == 0  # queued while the task ran
    assert in_redis(alice) == truth(alice) == 2
    assert sender._senders["default"].batches == 1
    assert_exact(alice)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_the_flush_task_pushes_its_process_queue_first(make_user, settings, parallelism):
    """``counters.flush_counters`` (beat's task), alone or fanned out to its parts (run
    eagerly here), flushes what the process that runs it committed a moment before."""
    settings.COUNTERS_FLUSH_PARALLELISM = parallelism
    alice = make_user()
    for i in range(2):
        Notification.objects.create(recipient=alice, verb=str(i))
    assert in_redis(alice) == 0  # queued
    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        tasks.flush_counters()
    finally:
        app.conf.task_always_eager = before
    assert stored(alice) == truth(alice) == 2
    assert in_redis(alice) == 0  # flushed: nothing left pending
    assert_exact(alice)
