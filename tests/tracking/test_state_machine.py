"""Stateful property test: any sequence of counted paths and flushes stays exact.

After every step ``get_count`` equals the ``COUNT(*)`` truth for every user;
after every flush the stored rows equal it too.
"""

from __future__ import annotations

import os

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
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
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

USERS = 3
EXAMPLES = int(os.environ.get("TALLY_STATEFUL_EXAMPLES", "200"))

user_index = st.integers(0, USERS - 1)
pick = st.integers(0, 10**6)


class Rollback(Exception):
    pass


class UnreadCounting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        User = get_user_model()
        self.users = [User.objects.create(username=f"sm{i}") for i in range(USERS)]

    def teardown(self) -> None:
        Notification.objects.all().delete()
        UnreadCounter.objects.all().delete()
        FlushBatch.objects.all().delete()
        get_user_model().objects.filter(pk__in=[u.pk for u in self.users]).delete()
        client, buffer = counters.get_client(), counters.get_buffer()
        keys = list(client.scan_iter(match=f"{buffer.prefix}:*"))
        if keys:
            client.delete(*keys)

    def pks(self) -> list[int]:
        return list(Notification.objects.order_by("pk").values_list("pk", flat=True))

    def one(self, i: int) -> Notification:
        pks = self.pks()
        return Notification.objects.get(pk=pks[i % len(pks)])

    def has_rows(self) -> bool:
        return Notification.objects.exists()

    # -- writes -----------------------------------------------------------------
    @rule(u=user_index, is_read=st.booleans())
    def create(self, u, is_read):
        Notification.objects.create(recipient=self.users[u], verb="c", is_read=is_read)

    @rule(rows=st.lists(st.tuples(user_index, st.booleans()), min_size=1, max_size=5))
    def bulk_create(self, rows):
        Notification.objects.bulk_create(
            [Notification(recipient=self.users[u], verb="b", is_read=r) for u, r in rows]
        )

    @rule(us=st.lists(user_index, min_size=1, max_size=6))
    def notify(self, us):
        Notification.objects.notify([self.users[u] for u in us], verb="n", batch_size=2)

    @precondition(has_rows)
    @rule(i=pick, read=st.booleans())
    def mark(self, i, read):
        n = self.one(i)
        n.mark_read() if read else n.mark_unread()

    @rule(u=st.one_of(st.none(), user_index))
    def mark_all_read(self, u):
        qs = Notification.objects.all()
        if u is not None:
            qs = qs.filter(recipient=self.users[u])
        qs.mark_all_read()

    @rule(src=user_index, dst=user_index)
    def move_all(self, src, dst):
        Notification.objects.filter(recipient=self.users[src]).update(recipient=self.users[dst])

    @rule(u=user_index, is_read=st.booleans())
    def update_is_read(self, u, is_read):
        Notification.objects.filter(recipient=self.users[u]).update(is_read=is_read)

    @precondition(has_rows)
    @rule(i=pick, read=st.booleans(), u=user_index)
    def stale_save(self, i, read, u):
        stale = self.one(i)
        fresh = Notification.objects.get(pk=stale.pk)
        fresh.mark_read() if read else fresh.mark_unread()
        stale.recipient = self.users[u]
        stale.save()

    @precondition(has_rows)
    @rule(i=pick)
    def delete_one(self, i):
        self.one(i).delete()

    @rule(u=user_index)
    def delete_of_user(self, u):
        Notification.objects.filter(recipient=self.users[u], verb="c").delete()

    @rule(u=user_index)
    def rolled_back(self, u):
        try:
            with transaction.atomic():
                Notification.objects.create(recipient=self.users[u], verb="x")
                Notification.objects.filter(recipient=self.users[u]).mark_all_read()
                raise Rollback
        except Rollback:
            pass

    @rule()
    def flush(self):
        counters.flush()
        for user in self.users:
            assert stored(user) == truth(user)

    # -- the property -------------------------------------------------------------
    @invariant()
    def exact(self):
        counts = UnreadCounter.objects.get_counts(self.users)
        assert [counts[u.pk] for u in self.users] == [truth(u) for u in self.users]


# 200 examples of 12 steps (a plain `pytest`; `make test-postgres` runs 50) take two to three
# minutes on PostgreSQL on 2 CPUs, and up to three times that when the machine is busy: more
# than the suite's default timeout of 300 s.
@pytest.mark.timeout(900)
def test_any_sequence_of_paths_and_flushes_stays_exact():
    run_state_machine_as_test(
        UnreadCounting,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
