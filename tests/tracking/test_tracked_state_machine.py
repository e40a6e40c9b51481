"""Stateful property test of the blog's tracked counters: any mix of paths stays exact.

After every step ``get_value`` of ``post_comments`` and ``post_points``
equals the SQL truth for every post; after every flush the stored rows do.
"""

from __future__ import annotations

import os

import pytest
from django.db import transaction
from django.db.models import Case, F, Value, When
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import counters
from counters.models import FlushBatch
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import COUNTERS, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

POSTS = 3
EXAMPLES = int(os.environ.get("TALLY_STATEFUL_EXAMPLES", "100"))

post_index = st.integers(0, POSTS - 1)
pick = st.integers(0, 10**6)
points = st.integers(-5, 20)


class Rollback(Exception):
    pass


class BlogCounting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.posts = [Post.objects.create(title=f"sm{i}") for i in range(POSTS)]

    def teardown(self) -> None:
        Comment.objects.all().delete()
        Post.objects.all().delete()
        PostStats.objects.all().delete()
        FlushBatch.objects.all().delete()
        client, buffer = counters.get_client(), counters.get_buffer()
        keys = list(client.scan_iter(match=f"{buffer.prefix}:*"))
        if keys:
            client.delete(*keys)

    def live(self) -> list[Post]:
        return [p for p in self.posts if p.pk is not None]

    def post(self, i: int) -> Post:
        live = self.live()
        return live[i % len(live)]

    def one(self, i: int) -> Comment:
        pks = list(Comment.objects.order_by("pk").values_list("pk", flat=True))
        return Comment.objects.get(pk=pks[i % len(pks)])

    def has_rows(self) -> bool:
        return Comment.objects.exists()

    # -- writes -----------------------------------------------------------------
    @rule(p=post_index, approved=st.booleans(), n=points)
    def create(self, p, approved, n):
        Comment.objects.create(post=self.post(p), approved=approved, points=n)

    @rule(rows=st.lists(st.tuples(post_index, st.booleans(), points), min_size=1, max_size=4))
    def bulk_create(self, rows):
        Comment.objects.bulk_create(
            [Comment(post=self.post(p), approved=a, points=n) for p, a, n in rows]
        )

    @precondition(has_rows)
    @rule(i=pick, approved=st.booleans(), n=points, p=post_index)
    def stale_save(self, i, approved, n, p):
        stale = self.one(i)
        Comment.objects.filter(pk=stale.pk).update(approved=not approved, points=F("points") + 1)
        stale.approved, stale.points, stale.post = approved, n, self.post(p)
        stale.save()

    @precondition(has_rows)
    @rule(i=pick, n=points, fields=st.sampled_from([["points"], ["approved"], ["post"]]))
    def save_update_fields(self, i, n, fields):
        c = self.one(i)
        c.points, c.approved, c.post = n, not c.approved, self.post(n)
        c.save(update_fields=fields)

    @rule(p=post_index, approved=st.booleans())
    def update_condition(self, p, approved):
        Comment.objects.filter(post=self.post(p)).update(approved=approved)

    @rule(factor=st.integers(-2, 3))
    def update_expression(self, factor):
        Comment.objects.filter(points__gt=0).update(points=F("points") * factor)

    @rule()
    def flip_all(self):
        Comment.objects.update(
            approved=Case(When(approved=True, then=Value(False)), default=Value(True))
        )

    @rule(src=post_index, dst=post_index)
    def move(self, src, dst):
        Comment.objects.filter(post=self.post(src)).update(post=self.post(dst))

    @precondition(has_rows)
    @rule(i=pick, n=points)
    def bulk_update(self, i, n):
        rows = list(Comment.objects.order_by("pk")[: (i % 3) + 1])
        for row in rows:
            row.points, row.approved = n, not row.approved
        Comment.objects.bulk_update(rows, ["points", "approved"])

    @precondition(has_rows)
    @rule(i=pick)
    def delete_one(self, i):
        self.one(i).delete()

    @rule(n=points)
    def queryset_delete(self, n):
        Comment.objects.filter(points__lte=n).delete()

    @precondition(lambda self: len(self.live()) > 1)
    @rule(p=post_index)
    def delete_post(self, p):
        self.post(p).delete()  # cascades to its comments and its stats row

    @rule(p=post_index, n=points)
    def get_or_update_or_create(self, p, n):
        post = self.post(p)
        try:
            Comment.objects.get_or_create(post=post, text=f"g{n}", defaults={"points": n})
            Comment.objects.update_or_create(
                post=post, text=f"g{n}", defaults={"approved": n % 2 == 0}
            )
        except Comment.MultipleObjectsReturned:
            # A save moved a comment of the same text here: Django refuses before any write,
            # and the invariant checks that nothing was counted.
            pass

    @rule(p=post_index)
    def rolled_back(self, p):
        try:
            with transaction.atomic():
                Comment.objects.create(post=self.post(p), approved=True, points=99)
                Comment.objects.filter(post=self.post(p)).update(approved=False)
                raise Rollback
        except Rollback:
            pass

    @rule()
    def flush(self):
        counters.flush()
        for post in self.live():
            for name in COUNTERS:
                assert (name, stored(name, post)) == (name, truth(name, post))

    # -- the property -------------------------------------------------------------
    @invariant()
    def exact(self):
        live = self.live()
        for name in COUNTERS:
            values = counters.get_values(name, [p.pk for p in live])
            assert [values[p.pk] for p in live] == [truth(name, p) for p in live], name


# 200 examples of 12 steps take about two minutes on PostgreSQL on 2 CPUs, and up to three
# times that when the machine is busy: more than the suite's default timeout of 300 s.
@pytest.mark.timeout(900)
def test_any_sequence_of_paths_and_flushes_stays_exact():
    run_state_machine_as_test(
        BlogCounting,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
