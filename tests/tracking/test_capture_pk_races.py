"""A save with an explicit primary key, racing an insert of the same key, counts once.

Django's ``save()`` of an instance with a primary key runs an UPDATE, then an
INSERT if the UPDATE changed nothing. The row may be inserted by another
transaction after the lock found nothing: the UPDATE then changes a row no
one read. The counted old state is what the statement actually replaced, read
under the row lock, so no interleaving counts a row twice (PostgreSQL: SQLite
serialises its write transactions).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction

from counters.tracking import counting
from notifications.models import Notification
from tests.conftest import has_row_locks
from tests.helpers import assert_exact, race, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.serial,
    pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections"),
]

THREADS = 4
IDS = 200
FIRST_ID = 1_000_000


def in_thread(target: Any) -> None:
    """Run ``target()`` on a connection of its own, committed before this returns."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # pragma: no cover - reported by the assertion
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert errors == []


@pytest.mark.parametrize("update_fields", [None, ["recipient", "is_read"]], ids=["all", "fields"])
def test_a_row_inserted_between_the_lock_and_the_update(monkeypatch, make_user, update_fields):
    """Fault injected: a create() of the same pk commits right after the lock found no row."""
    alice, bob = make_user("alice"), make_user("bob")
    real = counting.locked_rows
    injected: list[int] = []

    def then_insert(qs):
        rows = real(qs)
        if not rows and not injected and threading.current_thread() is threading.main_thread():
            injected.append(FIRST_ID)
            in_thread(lambda: Notification.objects.create(pk=FIRST_ID, recipient=alice, verb="v"))
        return rows

    monkeypatch.setattr(counting, "locked_rows", then_insert)
    n = Notification(pk=FIRST_ID, recipient=bob, verb="v", is_read=False)
    n.save(update_fields=update_fields)  # updates the row the other transaction inserted
    assert injected == [FIRST_ID]
    assert Notification.objects.filter(pk=FIRST_ID, recipient=bob).exists()
    assert (truth(alice), truth(bob)) == (0, 1)
    assert_exact(alice, bob)


def upsert(pk: int, user: Any, is_read: bool) -> None:
    """Save with the pk; if an insert of the same pk won the race, save again (an update)."""
    for _ in range(3):
        try:
            with transaction.atomic():
                Notification(pk=pk, recipient=user, verb="upsert", is_read=is_read).save()
            return
        except IntegrityError:
            continue
    raise AssertionError(f"{pk} not saved")


def create(pk: int, user: Any, is_read: bool) -> None:
    try:
        with transaction.atomic():
            Notification.objects.create(pk=pk, recipient=user, verb="create", is_read=is_read)
    except IntegrityError:
        pass  # the row exists: an upsert made it


def test_upserts_racing_creates_of_the_same_pks(make_user):
    """4 threads, every id written by each of them at the same instant: creates and upserts."""
    users = [make_user("alice"), make_user("bob")]

    def run(i: int, barrier: threading.Barrier) -> None:
        rng = random.Random(i)
        for pk in range(FIRST_ID, FIRST_ID + IDS):
            write = create if (pk + i) % THREADS == 0 else upsert
            barrier.wait(timeout=30)
            write(pk, rng.choice(users), rng.random() < 0.3)
            write(pk, rng.choice(users), rng.random() < 0.3)

    race(THREADS, run, timeout=300)
    assert Notification.objects.count() == IDS
    assert_exact(*users)
