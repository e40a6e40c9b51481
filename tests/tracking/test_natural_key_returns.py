"""A natural key that comes back, by any route, counts only its new children at once.

``Book.shelf`` is a nullable ``CASCADE`` foreign key to ``Shelf.code``. A shelf deleted and
created again (by ``save()``, ``bulk_create()``, ``QuerySet.update()`` of another shelf's
code, or ``save()`` of a renamed shelf) reads exactly before the flush, in whatever order
the delete, the flushes and the new books come; after the flush the stored row is exact
too, its tombstone folded once, and ``counters.signals.applied`` reports what the stored
row changed by.
"""

from __future__ import annotations

import pytest

import counters
from counters.models import Tombstone
from counters.signals import applied
from tests.deletes.cells import declare
from tests.deletes.models import Book, Shelf, ShelfStats

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

__all__ = ["declare"]

NAME = "shelf_books_n"


@pytest.fixture(autouse=True)
def shelf_books(declare):
    declare(NAME, Book, key="shelf", into="deletes.ShelfStats.n")


def truth(code: str) -> int:
    return Book.objects.filter(shelf_id=code).count()


def stored(code: str) -> int:
    return ShelfStats.objects.filter(shelf_id=code).values_list("n", flat=True).first() or 0


def assert_exact(code: str) -> None:
    expected = truth(code)
    assert counters.get_value(NAME, code) == expected
    counters.flush()
    assert (counters.get_value(NAME, code), stored(code)) == (expected, expected)
    assert not Tombstone.objects.filter(counter=NAME, key=code).exists()


def _comes_back(route: str) -> Shelf:
    if route == "save":
        return Shelf.objects.create(code="A")
    if route == "bulk_create":
        Shelf.objects.bulk_create([Shelf(code="A")])
    elif route == "update":
        Shelf.objects.create(code="Z")
        Shelf.objects.filter(code="Z").update(code="A")
    else:  # a rename of an existing shelf, saved
        shelf = Shelf.objects.create(code="Y")
        shelf.code = "A"
        shelf.save()
    return Shelf.objects.get(code="A")


@pytest.mark.parametrize(
    "order",
    [
        pytest.param("flush,delete,flush,create", id="flushed-before-and-after"),
        pytest.param("flush,delete,create", id="flushed-before"),
        pytest.param("delete,flush,create", id="flushed-after"),
        pytest.param("delete,create", id="never-flushed"),
        pytest.param("flush,delete,create,flush", id="flushed-around"),
        pytest.param("delete,create,flush", id="flushed-at-the-end"),
    ],
)
def test_a_shelf_deleted_and_created_again(order):
    shelf = Shelf.objects.create(code="A")
    Book.objects.create(shelf=shelf)
    for step in order.split(","):
        if step == "flush":
            counters.flush()
        elif step == "delete":
            Shelf.objects.get(code="A").delete()
            assert counters.get_value(NAME, "A") == 0
        else:
            Book.objects.create(shelf=Shelf.objects.create(code="A"))
    assert_exact("A")
    assert truth("A") == 1


@pytest.mark.parametrize("route", ["save", "bulk_create", "update", "rename"])
def test_a_natural_key_back_by_any_route(route):
    shelf = Shelf.objects.create(code="A")
    Book.objects.bulk_create([Book(shelf=shelf) for _ in range(4)])
    counters.flush()
    shelf.delete()
    assert counters.get_value(NAME, "A") == 0
    back = _comes_back(route)
    for _ in range(3):
        Book.objects.create(shelf=back)
    assert (truth("A"), counters.get_value(NAME, "A")) == (3, 3)
    assert_exact("A")


def test_applied_reports_the_folded_tombstone():
    seen: list[dict] = []

    def receiver(sender, counter, deltas, using, **kwargs):
        if counter == NAME:
            seen.append(dict(deltas))

    applied.connect(receiver, dispatch_uid="test-folded")
    try:
        shelf = Shelf.objects.create(code="A")
        Book.objects.bulk_create([Book(shelf=shelf) for _ in range(2)])
        counters.flush()
        shelf.delete()  # the row's 2 kept in a tombstone, -2 buffered
        Shelf.objects.bulk_create([Shelf(code="A")])  # back without post_save
        Book.objects.create(shelf_id="A")
        seen.clear()
        counters.flush()  # applies -2 + 1 to a new row, and folds the tombstone's 2 into it
    finally:
        applied.disconnect(dispatch_uid="test-folded")
    assert stored("A") == truth("A") == 1
    assert sum(d.get("A", 0) for d in seen) == 1
