"""Composite keys stored in fields of the ``into`` model's own names, by its unique constraint.

``key=("writer", "post")`` into ``PairStats(who, on)``, whose fields are not named as the
parts, goes in order to the fields of its unique constraint ``(who, on)``: counted, flushed
and stored exactly there. Two constraints that could each store the parts are refused
(``counters.E058``).
"""

from __future__ import annotations

import pytest
from django.db import connection

import counters
from counters.base.exceptions import TrackingError
from counters.tracking import keys
from tests.deletes.cells import declare
from tests.deletes.models import Note, PairStats, Person, Post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

__all__ = ["declare"]


def test_the_parts_go_to_the_unique_constraint_in_order(declare):
    declare("pairs", Note, key=("writer", "post"), into="deletes.PairStats.n")
    people = [Person.objects.create(code=c) for c in "ab"]
    anchor = Post.objects.create(author=people[0], anchor=True)
    posts = [Post.objects.create(author=people[i % 2]) for i in range(3)]
    for i in range(7):
        Note.objects.create(writer=people[i % 2], post=posts[i % 3], hard=anchor)
    posts[0].delete()
    Note.objects.filter(writer=people[1]).first().delete()
    truth = _truth()
    assert {k: counters.get_value("pairs", k) for k in truth} == truth
    counters.flush()
    stored = {(r.who_id, r.on_id): r.n for r in PairStats.objects.all() if r.n}
    assert stored == truth


def _truth() -> dict[tuple[int, int], int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT writer_id, post_id, COUNT(*) FROM deletes_note "
            "WHERE post_id IS NOT NULL GROUP BY writer_id, post_id"
        )
        return {(w, p): n for w, p, n in cursor.fetchall()}


def test_two_constraints_that_fit_are_refused(declare):
    with pytest.raises(TrackingError) as caught:
        declare("two_ways", Note, key=("writer", "post"), into="deletes.TwoWayStats.n")
    assert caught.value.check_id == keys.AMBIGUOUS_ID == "counters.E058"
    assert "deletes_two" not in str(caught.value)  # the fields are named, in order
    assert "('a', 'b')" in str(caught.value) and "('c', 'd')" in str(caught.value)
