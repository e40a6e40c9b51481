"""Many-to-many memberships: rows of a through model counted per group, exact against SQL
COUNT of the through rows through add/remove/set/clear from both sides, deletes of either
end, an explicit through model's own manager, a seeded random mix and a rebuild."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import NotSupportedError, models, transaction
from django.db.models import Count

import counters
from counters.base import registry
from counters.base.exceptions import TrackingError
from counters.tracking import trackers
from counters.tracking.refusals import problems, uncounted_manager
from tests.blog.models import Club, ClubStats, GroupStats, Membership, Post
from tests.conftest import has_row_locks
from tests.helpers import race

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

GROUPS = "group_members"
CLUBS = "club_members"
Through = User.groups.through


@pytest.fixture(autouse=True)
def memberships(monkeypatch) -> Iterator[None]:
    """The two membership counters, declared for this test alone."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    counters.track(GROUPS, Through, key="group", into="blog.GroupStats.members")
    counters.track(CLUBS, Membership, key="club", into="blog.ClubStats.members")
    yield


def truth(through: type[models.Model] = Through, key: str = "group") -> dict[int, int]:
    """SQL COUNT of the through rows per key: the ground truth."""
    rows = through.objects.order_by().values(key).annotate(n=Count("id"))
    return {row[key]: row["n"] for row in rows}


def stored(into: type[models.Model] = GroupStats) -> dict[int, int]:
    return {pk: n for pk, n in into.objects.values_list("pk", "members") if n}


def assert_exact() -> None:
    """Reads equal the truth now; after a flush the rows do too, for both counters."""
    for name, through, key, into in (
        (GROUPS, Through, "group", GroupStats),
        (CLUBS, Membership, "club", ClubStats),
    ):
        expected = truth(through, key)
        keys = set(expected) | set(stored(into))
        values = {k: v for k, v in counters.get_values(name, list(keys)).items() if v}
        assert values == expected, name
        counters.flush()
        assert stored(into) == expected, name
        for k in keys:
            assert counters.get_value(name, k) == expected.get(k, 0), name


def people(n: int, start: int = 0) -> list[User]:
    return [User.objects.create(username=f"u{start + i}") for i in range(n)]


@pytest.mark.usefixtures("redis_backend")
def test_add_remove_set_clear_from_both_sides():
    alice, bob, carol = people(3)
    red, blue = Group.objects.create(name="red"), Group.objects.create(name="blue")
    alice.groups.add(red, blue)
    alice.groups.add(red)  # already there: Django skips it, nothing counted
    red.user_set.add(bob, alice)
    assert counters.get_value(GROUPS, red.pk) == 2
    assert_exact()
    bob.groups.remove(blue)  # not a member: nothing removed
    blue.user_set.remove(alice)
    red.user_set.add(carol.pk)  # by primary key
    assert_exact()
    alice.groups.set([blue])
    red.user_set.set([alice, carol])  # bob goes, alice comes back
    assert_exact()
    blue.user_set.clear()
    carol.groups.clear()
    carol.groups.clear()  # nothing left: nothing counted
    assert truth() == {red.pk: 1}
    assert_exact()
    with transaction.atomic():
        bob.groups.add(blue)
        red.user_set.add(bob)
    try:
        with transaction.atomic():
            carol.groups.add(blue)
            raise RuntimeError
    except RuntimeError:
        pass  # rolled back: its delta is dropped
    assert_exact()


def test_deleting_either_end_counts_the_memberships_that_go():
    users = people(5)
    groups = [Group.objects.create(name=f"g{i}") for i in range(3)]
    for i, user in enumerate(users):
        user.groups.set(groups[: 1 + i % 3])
    assert_exact()
    users[0].delete()
    groups[2].delete()  # its counter row goes with it
    assert_exact()
    User.objects.filter(pk__in=[users[1].pk, users[2].pk]).delete()
    Group.objects.filter(pk=groups[1].pk).delete()
    assert_exact()
    assert truth() == {groups[0].pk: 2}
    assert not GroupStats.objects.filter(pk=groups[2].pk).exists()


def test_the_through_models_own_manager_is_counted():
    alice, bob = people(2)
    red = Group.objects.create(name="red")
    assert uncounted_manager(Through) is None
    row = Through.objects.create(user=alice, group=red)
    Through.objects.bulk_create([Through(user=bob, group=red)])
    assert_exact()
    blue = Group.objects.create(name="blue")
    Through.objects.filter(pk=row.pk).update(group=blue)
    assert_exact()
    row.refresh_from_db()
    row.delete()
    Through.objects.filter(user=bob).delete()
    assert_exact()
    with pytest.raises(NotSupportedError):  # only Django's add() may skip conflicts
        Through.objects.bulk_create([Through(user=bob, group=red)], ignore_conflicts=True)
    assert_exact()


def test_an_explicit_through_model_counts_every_path():
    posts = [Post.objects.create(title=f"p{i}") for i in range(4)]
    chess, go = Club.objects.create(name="chess"), Club.objects.create(name="go")
    chess.posts.add(posts[0], posts[1])
    posts[2].clubs.add(chess, go)
    Membership.objects.create(club=go, post=posts[3])
    Membership.objects.bulk_create([Membership(club=go, post=posts[0])])
    assert_exact()
    chess.posts.remove(posts[3], posts[0])  # one of them was a member
    posts[0].clubs.set([chess])
    go.posts.set([posts[1]])
    assert_exact()
    shogi = Club.objects.create(name="shogi")
    Membership.objects.filter(club=chess).update(club=shogi)
    posts[1].delete()
    assert_exact()
    go.posts.clear()
    chess.posts.add(*posts[2:])
    Club.objects.filter(pk__in=[chess.pk, shogi.pk]).delete()
    assert_exact()
    assert truth(Membership, "club") == {}


def test_a_seeded_random_mix_stays_exact():
    rng = random.Random(2611)
    users = people(6)
    groups = [Group.objects.create(name=f"g{i}") for i in range(4)]
    made = len(users)
    for step in range(200):
        op = rng.random()
        user, group = rng.choice(users), rng.choice(groups)
        some_users = rng.sample(users, rng.randint(0, 3))
        some_groups = rng.sample(groups, rng.randint(0, 3))
        if op < 0.2:
            user.groups.add(*some_groups)
        elif op < 0.35:
            group.user_set.add(*some_users)
        elif op < 0.45:
            user.groups.remove(*some_groups)
        elif op < 0.55:
            group.user_set.remove(*some_users)
        elif op < 0.63:
            user.groups.set(some_groups)
        elif op < 0.7:
            group.user_set.set(some_users)
        elif op < 0.74:
            (user.groups if rng.random() < 0.5 else group.user_set).clear()
        elif op < 0.8:
            users.remove(user)
            user.delete()
            users += people(1, start=made)
            made += 1
        elif op < 0.84:
            groups.remove(group)
            Group.objects.filter(pk=group.pk).delete()
            groups.append(Group.objects.create(name=f"g{step}"))
        elif op < 0.9:
            Through.objects.get_or_create(user=user, group=group)
        elif op < 0.95:
            with transaction.atomic():
                user.groups.add(group)
                Through.objects.filter(group=rng.choice(groups)).delete()
        else:
            counters.flush()
    assert sum(truth().values()) == Through.objects.count()
    assert_exact()


@pytest.mark.serial
@pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections")
def test_racing_adds_and_removes_of_one_pair_from_both_sides_count_once():
    alice, bob = people(2)
    red = Group.objects.create(name="red")

    def write(i: int, barrier) -> None:
        user = (alice, bob)[i % 2]
        for round_ in range(10):
            barrier.wait()
            if (i + round_) % 3 == 0:
                red.user_set.remove(user)
            elif (i // 2 + round_) % 2:  # each user added from either side
                User.objects.get(pk=user.pk).groups.add(red)
            else:
                Group.objects.get(pk=red.pk).user_set.add(user)

    race(6, write)
    assert_exact()


def test_rebuild_puts_back_the_sql_truth():
    users = people(4)
    groups = [Group.objects.create(name=f"g{i}") for i in range(3)]
    for i, user in enumerate(users):
        user.groups.set(groups[: 1 + i % 3])
    counters.flush()
    expected = truth()
    GroupStats.objects.filter(pk=groups[0].pk).update(members=99)
    GroupStats.objects.filter(pk=groups[1].pk).delete()
    stray = Group.objects.create(name="stray")
    GroupStats.objects.create(group=stray, members=5)
    assert stored() != expected
    report = counters.rebuild(GROUPS, batch_size=2, confirm_delay=0.05)
    assert report.repaired >= 3
    counters.flush()
    assert stored() == expected
    assert counters.get_value(GROUPS, stray.pk) == 0
    assert_exact()


def test_status_check_and_audit():
    alice = people(1)[0]
    red = Group.objects.create(name="red")
    alice.groups.add(red)
    assert problems(trackers.get_tracker(GROUPS)) == []  # what manage.py check runs
    call_command("check", stdout=io.StringIO())  # no counters.E013 for auth's through
    call_command("counters_status", stdout=io.StringIO())
    counters.flush()
    GroupStats.objects.update(members=7)  # drift the audit finds and repairs
    for _ in range(3):
        counters.audit(confirm_delay=0.05)
    counters.flush()
    assert stored() == truth() == {red.pk: 1}


def test_a_symmetrical_through_is_refused():
    class Peer(models.Model):
        friends = models.ManyToManyField("self")

        class Meta:
            app_label = "blog"

        def __str__(self) -> str:
            return str(self.pk)

    try:
        with pytest.raises(TrackingError) as info:
            counters.track("peer_friends", Peer.friends.through, key="from_peer", into="x.Y.z")
        assert info.value.check_id == "counters.E057"
        assert "symmetrical" in str(info.value)
    finally:
        from django.apps import apps

        for model in (Peer, Peer.friends.through):
            apps.all_models["blog"].pop(model._meta.model_name, None)
        apps.clear_cache()
