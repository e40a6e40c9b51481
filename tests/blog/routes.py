"""Ground truth of the ``route_*`` counters, computed with SQL, and the exactness assertion."""

from __future__ import annotations

import pytest
from django.db import connections
from django.db.models import Q

import counters
from counters.base import registry
from counters.tracking import trackers
from tests.blog.models import RouteBase, RouteChild, RouteEntry, RouteOwner, RouteStats

#: counter -> the SQL counting its rows of one owner (the only parameters: the owner, True).
TRUTH_SQL = {
    "route_entries": "SELECT COUNT(*) FROM blog_routeentry WHERE owner_id = %s",
    "route_kept": "SELECT COUNT(*) FROM blog_routeentry WHERE keeper_id = %s",
    "route_backed": "SELECT COUNT(*) FROM blog_routeentry WHERE backup_id = %s",
    "route_edited": (
        "SELECT COUNT(*) FROM blog_routeentry WHERE owner_id = %s AND editor_id IS NOT NULL"
    ),
    "route_base_flagged": "SELECT COUNT(*) FROM blog_routebase WHERE owner_id = %s AND flag = %s",
    "route_child_flagged": (
        "SELECT COUNT(*) FROM blog_routechild c JOIN blog_routebase b "
        "ON b.id = c.routebase_ptr_id WHERE b.owner_id = %s AND b.flag = %s"
    ),
}
COUNTERS = tuple(TRUTH_SQL)


def track_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Track the ``route_*`` counters for one test; they vanish after it, the apps' stay.

    Not declared by the app: the other tests see only the counters they know.
    """
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    for name, model, key, where in (
        ("route_entries", RouteEntry, "owner", None),
        ("route_kept", RouteEntry, "keeper", None),
        ("route_backed", RouteEntry, "backup", None),
        ("route_edited", RouteEntry, "owner", Q(editor__isnull=False)),
        ("route_base_flagged", RouteBase, "owner", Q(flag=True)),
        ("route_child_flagged", RouteChild, "owner", Q(flag=True)),
    ):
        column = name.removeprefix("route_")
        counters.track(name, model, key=key, into=f"blog.RouteStats.{column}", where=where)


def truth(name: str, owner: int, using: str = "default") -> int:
    sql = TRUTH_SQL[name]
    params = [owner, True][: sql.count("%s")]
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def stored(name: str, owner: int) -> int:
    column = name.removeprefix("route_")
    row = RouteStats.objects.filter(pk=owner).values_list(column, flat=True).first()
    return row or 0


def figures(read) -> dict[tuple[str, int], tuple[int, int]]:
    """{(counter, owner): (truth, read(counter, owner))} for every owner in the table."""
    owners = list(RouteOwner.objects.order_by("pk").values_list("pk", flat=True))
    return {(n, o): (truth(n, o), read(n, o)) for n in COUNTERS for o in owners}


def wrong(read) -> dict[tuple[str, int], tuple[int, int]]:
    return {k: v for k, v in figures(read).items() if v[0] != v[1]}


def assert_routes_exact() -> None:
    """truth == get_value now; after a flush truth == stored == get_value, for every owner."""
    now = wrong(counters.get_value)
    assert not now, f"(truth, get_value) differ: {now}"
    counters.flush()
    flushed = wrong(stored)
    assert not flushed, f"(truth, stored) differ after a flush: {flushed}"
    after = wrong(counters.get_value)
    assert not after, f"(truth, get_value) differ after a flush: {after}"
