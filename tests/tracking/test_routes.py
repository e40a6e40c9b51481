"""Every route by which Django changes rows of a tracked model is counted exactly.

One test per line of the path table of docs/tracking.md (the ids are named there). Each
route runs on a small world of owners, entries and multi-table rows, then
every ``route_*`` counter of every owner is compared with SQL: ``get_value``
now, the stored rows after a flush.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from django.db import connection, transaction
from django.db.models import F

import counters
from counters.verify.rebuild import rebuild_all
from notifications.models import Notification, UnreadCounter
from tests.blog.models import (
    RouteBase,
    RouteChild,
    RouteEntry,
    RouteEntryProxy,
    RouteOwner,
    route_sentinel,
)
from tests.blog.routes import assert_routes_exact, stored, track_routes, truth, wrong
from tests.helpers import QUICK_CONFIRM, assert_exact

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


@pytest.fixture(autouse=True)
def route_counters(monkeypatch):
    track_routes(monkeypatch)


@dataclass
class World:
    a: RouteOwner
    b: RouteOwner
    c: RouteOwner
    keeper: RouteOwner  # only a keeper (SET(callable))
    backup: RouteOwner  # only a backup (SET_DEFAULT)
    editor: RouteOwner  # only an editor (SET_NULL on a field of the where)
    entries: list[RouteEntry]
    bases: list[RouteBase]
    children: list[RouteChild]


@pytest.fixture
def world() -> World:
    a, b, c, keeper, backup, editor = (
        RouteOwner.objects.create(name=n) for n in ("a", "b", "c", "keeper", "backup", "editor")
    )
    entries = [
        RouteEntry.objects.create(owner=a, keeper=keeper, backup=backup, editor=editor),
        RouteEntry.objects.create(owner=a, keeper=keeper, editor=editor),
        RouteEntry.objects.create(owner=b, keeper=a, backup=backup),
    ]
    bases = [RouteBase.objects.create(owner=a), RouteBase.objects.create(owner=b, flag=True)]
    children = [
        RouteChild.objects.create(owner=a),
        RouteChild.objects.create(owner=a, extra=1),
        RouteChild.objects.create(owner=b),
    ]
    w = World(a, b, c, keeper, backup, editor, entries, bases, children)
    assert_routes_exact()
    return w


# -- the routes of Django's own API -----------------------------------------------


def create(w: World) -> None:
    RouteEntry.objects.create(owner=w.c, editor=w.a)
    RouteEntry(owner=w.c, keeper=w.b).save()
    RouteEntry.objects.get_or_create(owner=w.c, keeper=w.c)


def save_stale(w: World) -> None:
    first, stale = (RouteEntry.objects.get(pk=w.entries[0].pk) for _ in range(2))
    first.owner = w.b
    first.save()
    stale.editor = None
    stale.save(update_fields=["editor"])  # the row is b's now: b loses an edited entry
    RouteEntry.objects.update_or_create(pk=w.entries[1].pk, defaults={"owner": w.c})


def queryset_update(w: World) -> None:
    RouteEntry.objects.filter(owner=w.a).update(owner=w.b)
    RouteEntry.objects.filter(owner=w.b).update(keeper=F("owner"))
    entry = w.entries[2]
    entry.backup = w.c
    RouteEntry.objects.bulk_update([entry], ["backup"])


def bulk_create(w: World) -> None:
    RouteEntry.objects.bulk_create([RouteEntry(owner=w.c, editor=w.a) for _ in range(3)])


def delete(w: World) -> None:
    w.entries[0].delete()
    RouteEntry.objects.filter(owner=w.b).delete()


def delete_parent(w: World) -> None:
    w.a.delete()  # its bases and children go (CASCADE), its entries' owner is set NULL


def savepoint_rollback(w: World) -> None:
    with transaction.atomic():
        RouteEntry.objects.filter(owner=w.a).update(owner=w.c)
        with pytest.raises(RuntimeError), transaction.atomic():
            RouteEntry.objects.filter(owner=w.b).update(owner=w.c)
            raise RuntimeError("rolled back")


# -- Django's internal routes: related managers, the base manager, the collector ---


def related_add(w: World) -> None:
    w.b.entries.add(w.entries[0])  # moves an entry of a to b (the base manager's update)


def related_set(w: World) -> None:
    w.b.entries.set([w.entries[0], w.entries[1]])  # b's own entry is removed


def related_remove_clear(w: World) -> None:
    w.a.entries.remove(w.entries[0])
    w.b.entries.clear()


def related_create(w: World) -> None:
    w.c.entries.create(editor=w.a)
    w.c.bases.create(flag=True)


def base_manager(w: World) -> None:
    RouteEntry._base_manager.filter(owner=w.a).update(owner=w.c)
    RouteChild._base_manager.filter(owner=w.a).update(flag=True)


def set_callable(w: World) -> None:
    route_sentinel()
    w.keeper.delete()  # SET(route_sentinel): Django updates the rows by primary key


def set_default(w: World) -> None:
    w.backup.delete()


def set_null_where(w: World) -> None:
    w.editor.delete()  # editor goes NULL: route_edited of a loses both entries


# -- multi-table inheritance and proxies -------------------------------------------


def mti_parent_manager(w: World) -> None:
    RouteBase.objects.update(flag=True)  # changes the tracked children's rows too


def mti_parent_save(w: World) -> None:
    parent = RouteBase.objects.get(pk=w.children[0].pk)
    parent.flag = True
    parent.save()
    parent = RouteBase.objects.get(pk=w.children[0].pk)
    parent.owner = w.c
    parent.save(update_fields=["owner"])
    RouteBase.objects.bulk_update([RouteBase(pk=w.children[1].pk, flag=True)], ["flag"])


def mti_child_manager(w: World) -> None:
    RouteChild.objects.filter(owner=w.a).update(flag=True)  # the parent's table
    RouteChild.objects.filter(extra=1).update(owner=w.c)


def mti_child_save(w: World) -> None:
    RouteChild.objects.create(owner=w.c, flag=True)
    child = RouteChild.objects.get(pk=w.children[2].pk)
    child.flag = True
    child.save()
    child.owner = w.a
    child.save(update_fields=["owner"])


def mti_delete(w: World) -> None:
    RouteChild.objects.update(flag=True)
    w.children[2].delete()
    RouteBase.objects.filter(pk=w.children[0].pk).delete()
    RouteChild.objects.filter(extra=1).delete()


def proxy(w: World) -> None:
    RouteEntryProxy.objects.filter(owner=w.a).update(owner=w.b)
    RouteEntryProxy.objects.bulk_create([RouteEntryProxy(owner=w.c) for _ in range(2)])
    RouteEntryProxy.objects.create(owner=w.c, editor=w.b)
    RouteEntryProxy.objects.filter(owner=w.b).delete()


ROUTES: list[Callable[[World], None]] = [
    create,
    save_stale,
    queryset_update,
    bulk_create,
    delete,
    delete_parent,
    savepoint_rollback,
    related_add,
    related_set,
    related_remove_clear,
    related_create,
    base_manager,
    set_callable,
    set_default,
    set_null_where,
    mti_parent_manager,
    mti_parent_save,
    mti_child_manager,
    mti_child_save,
    mti_delete,
    proxy,
]


@pytest.mark.parametrize("route", [pytest.param(r, id=r.__name__) for r in ROUTES])
def test_a_route_keeps_every_counter_exact(world, route):
    route(world)
    assert_routes_exact()


def test_the_reported_counts_of_the_internal_routes(world):
    """The figures of the report: each now equals the truth, and the truth is as expected."""
    related_add(world)
    assert [truth("route_entries", o.pk) for o in (world.a, world.b)] == [1, 2]
    set_callable(world)
    sentinel = RouteOwner.objects.get(name="sentinel").pk
    assert (truth("route_kept", sentinel), counters.get_value("route_kept", sentinel)) == (2, 2)
    set_null_where(world)
    pair = (truth("route_edited", world.b.pk), counters.get_value("route_edited", world.b.pk))
    assert pair == (0, 0)
    mti_parent_manager(world)
    child = (truth("route_child_flagged", world.a.pk), stored_after_flush(world.a.pk))
    assert child == (2, 2)


def test_mark_read_and_mark_all_read_count_only_what_they_changed(make_user):
    alice, bob = make_user(), make_user()
    rows = [Notification.objects.create(recipient=u, verb="v") for u in (alice, alice, bob)]
    assert rows[0].mark_read() is True
    assert Notification.objects.get(pk=rows[0].pk).mark_read() is False
    assert Notification.objects.filter(recipient=alice).mark_all_read() == 1
    assert rows[2].mark_unread() is False
    assert Notification.objects.filter(recipient=bob).mark_all_unread() == 0
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 1}
    assert_exact(alice, bob)


def stored_after_flush(owner: int) -> int:
    counters.flush()
    return stored("route_child_flagged", owner)


def test_raw_sql_paused_changes_are_not_counted_and_a_rebuild_repairs_them(world):
    with counters.paused():
        RouteEntry.objects.filter(owner=world.a).update(owner=world.c)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE blog_routebase SET flag = %s", [True])
    assert set(wrong(counters.get_value)) == {
        ("route_entries", world.a.pk),
        ("route_entries", world.c.pk),
        ("route_edited", world.a.pk),
        ("route_edited", world.c.pk),
        ("route_base_flagged", world.a.pk),
        ("route_base_flagged", world.b.pk),
        ("route_child_flagged", world.a.pk),
        ("route_child_flagged", world.b.pk),
    }
    rebuild_all(confirm_delay=QUICK_CONFIRM)  # no writer runs: nothing is on its way
    assert_routes_exact()
