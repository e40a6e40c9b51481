"""A parent keyed by a natural key, deleted and created again: its new counter starts from 0.

The shelf's code keys its counter (``to_field="code"``). Deleting the shelf
deletes its books (each counted ``-1``) and its counter row, whose value is
kept in a tombstone (as is any delta the flush drops for the gone shelf); a
shelf created again with the same code takes it back into the buffer, so the
old shelf's deltas sum to 0 and the new one counts only its own books. (It
used to inherit them: 3 books, -9 read and stored.)
"""

from __future__ import annotations

import pytest

import counters
from counters.base import registry
from counters.models import Tombstone
from counters.tracking import trackers
from tests.blog.models import DeclBook, DeclShelf, DeclShelfStats

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NAME = "shelf_books"


@pytest.fixture(autouse=True)
def shelf_books(monkeypatch):
    """The counter of books per shelf code, declared for this test alone."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    counters.track(NAME, DeclBook, key="shelf", into="blog.DeclShelfStats.books")


def truth(code: str) -> int:
    return DeclBook.objects.filter(shelf_id=code).count()


def stored(code: str) -> int:
    row = DeclShelfStats.objects.filter(shelf_id=code).values_list("books", flat=True).first()
    return row or 0


def shelf_with(code: str, books: int) -> DeclShelf:
    shelf = DeclShelf.objects.create(code=code)
    DeclBook.objects.bulk_create([DeclBook(shelf=shelf) for _ in range(books)])
    for _ in range(books):  # one path that saves, one that does not
        DeclBook.objects.create(shelf=shelf)
    return shelf


def assert_exact(code: str, expected: int) -> None:
    assert (truth(code), counters.get_value(NAME, code)) == (expected, expected)
    counters.flush()
    assert (truth(code), counters.get_value(NAME, code), stored(code)) == (
        expected,
        expected,
        expected,
    )


@pytest.mark.parametrize(
    "flushed",
    [pytest.param(True, id="old-count-flushed"), pytest.param(False, id="old-count-buffered")],
)
def test_a_parent_created_again_counts_only_its_own_children(flushed):
    shelf_with("A", 6)
    other = shelf_with("B", 2)
    if flushed:
        counters.flush()
        assert stored("A") == 12
    DeclShelf.objects.get(code="A").delete()
    assert (truth("A"), counters.get_value(NAME, "A")) == (0, 0)
    shelf = DeclShelf.objects.create(code="A")
    for _ in range(3):
        DeclBook.objects.create(shelf=shelf)
    assert_exact("A", 3)
    assert_exact(other.code, 4)


def test_a_parent_deleted_by_a_queryset_and_created_again():
    shelf_with("A", 5)
    counters.flush()
    DeclShelf.objects.filter(code="A").delete()
    shelf_with("A", 1)
    assert_exact("A", 2)


def test_a_flush_between_the_delete_and_the_new_parent():
    shelf_with("A", 4)
    counters.flush()
    DeclBook.objects.filter(shelf_id="A").first().delete()  # -1 buffered for the old shelf
    DeclShelf.objects.get(code="A").delete()
    result = counters.flush()  # the parent is gone: its deltas are dropped and kept
    assert result.dropped == 1
    assert Tombstone.objects.count() == 0  # 8 kept, then -1 and -7 dropped: nothing owed
    shelf_with("A", 2)
    assert_exact("A", 4)
    assert Tombstone.objects.count() == 0


def test_a_parent_deleted_for_good_leaves_nothing_behind():
    shelf_with("A", 3)
    shelf_with("B", 1)
    counters.flush()
    DeclBook.objects.filter(shelf_id="A").first().delete()
    DeclShelf.objects.filter(code__in=["A", "B"]).delete()
    assert Tombstone.objects.count() == 2  # what the rows held, until their deltas are in
    result = counters.flush()
    assert result.dropped == 2
    assert Tombstone.objects.count() == 0
    assert (stored("A"), stored("B"), DeclShelfStats.objects.count()) == (0, 0, 0)


def test_an_auto_increment_key_keeps_no_tombstone():
    from tests.blog.models import Comment, Post

    post = Post.objects.create()
    Comment.objects.create(post=post, approved=True)
    counters.flush()
    post.delete()
    assert counters.flush().dropped == 2
    assert Tombstone.objects.count() == 0


def test_a_parent_bulk_created_again_is_exact_after_the_flush():
    shelf_with("A", 3)
    counters.flush()
    DeclShelf.objects.get(code="A").delete()
    [shelf] = DeclShelf.objects.bulk_create([DeclShelf(code="A")])  # no post_save
    DeclBook.objects.create(shelf=shelf)
    counters.flush()
    assert (truth("A"), counters.get_value(NAME, "A"), stored("A")) == (1, 1, 1)
    assert Tombstone.objects.count() == 0
    assert_exact("A", 1)
