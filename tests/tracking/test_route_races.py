"""Racing writes to one multi-table row, through the parent and through the child, stay exact.

Every save, update and delete locks the row in the parent's table first,
so the writers queue on the locks instead of deadlocking, and each change
counts once in the parent's and the child's counters.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection  # noqa: F401 (read by the skipif condition)

from tests.blog.models import RouteBase, RouteChild, RouteOwner
from tests.blog.routes import assert_routes_exact, track_routes
from tests.conftest import has_row_locks
from tests.helpers import race

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.serial,
    pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections"),
    pytest.mark.usefixtures("redis_backend"),
]


@pytest.fixture(autouse=True)
def route_counters(monkeypatch):
    track_routes(monkeypatch)


THREADS = 8
ROUNDS = 15


def write(i: int, round_: int, pk: int, owners: list[RouteOwner]) -> None:
    """One of four routes to the same row, chosen by thread and round."""
    flag = (i + round_) % 2 == 0
    owner = owners[(i * 7 + round_) % len(owners)]
    route = (i + round_) % 4
    if route == 0:
        RouteBase.objects.filter(pk=pk).update(flag=flag)
    elif route == 1:
        parent = RouteBase.objects.get(pk=pk)
        parent.flag, parent.owner = flag, owner
        parent.save()
    elif route == 2:
        child = RouteChild.objects.get(pk=pk)
        child.flag, child.owner = flag, owner
        child.save()
    else:
        RouteChild.objects.filter(pk=pk).update(owner=owner, flag=flag)


def test_racing_parent_and_child_routes_neither_deadlock_nor_miscount():
    owners = [RouteOwner.objects.create(name=str(i)) for i in range(3)]
    pk = RouteChild.objects.create(owner=owners[0], flag=True).pk

    def run(i: int, barrier: threading.Barrier) -> None:
        barrier.wait(timeout=10)
        for round_ in range(ROUNDS):
            write(i, round_, pk, owners)

    race(THREADS, run)
    assert_routes_exact()


def test_racing_deletes_and_updates_of_multi_table_rows_neither_deadlock_nor_miscount():
    owner = RouteOwner.objects.create(name="o")
    pks = [RouteChild.objects.create(owner=owner, flag=True).pk for _ in range(24)]

    def run(i: int, barrier: threading.Barrier) -> None:
        barrier.wait(timeout=10)
        for n, pk in enumerate(pks if i % 2 else reversed(pks)):
            route = (i + n) % 4
            if route == 0:
                RouteBase.objects.filter(pk=pk).update(flag=n % 2 == 0)
            elif route == 1:
                RouteChild.objects.filter(pk=pk).update(flag=n % 2 == 1)
            elif route == 2:
                child = RouteChild.objects.filter(pk=pk).first()
                if child is not None:
                    child.delete()
            else:
                RouteBase.objects.filter(pk=pk).delete()

    race(THREADS, run)
    assert_routes_exact()
