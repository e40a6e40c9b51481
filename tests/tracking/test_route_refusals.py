"""Routes that cannot be counted are refused: by track() before any row is written, and by check.

Every model sharing a tracked model's rows (its proxies, its multi-table
parents and children) must change them through counted querysets: its
default manager (E046) and a named base manager (E045); its other managers
are warned about (W002). The automatic base manager is made counted.
"""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.db import models
from django.test.utils import isolate_apps

import counters
from counters.base.exceptions import TrackingError
from counters.tracking import relatives, trackers
from counters.tracking.queryset import CountedQuerySet
from tests.blog.models import Post, RouteBase, RouteChild, RouteEntry, RouteEntryProxy
from tests.blog.routes import track_routes

INTO = "blog.DeclTally.votes"  # a column no other counter of the apps holds


@pytest.fixture(autouse=True)
def isolated_trackers(monkeypatch):
    """Trackers and counters a test adds vanish after it (the route_* ones too)."""
    track_routes(monkeypatch)


def found(check_id: str) -> list[tuple[str, str]]:
    messages = run_checks(tags=["counters"])
    return [(m.id, m.obj._meta.object_name) for m in messages if m.id == check_id]


@pytest.mark.parametrize(
    "model", [RouteEntry, RouteEntryProxy, RouteBase, RouteChild], ids=lambda m: m.__name__
)
def test_the_automatic_base_manager_of_every_sharer_is_counted(model):
    model._meta._expire_cache()  # survives Django dropping its cached managers
    manager = model._base_manager
    assert isinstance(manager.get_queryset(), CountedQuerySet)
    assert (manager.name, manager.auto_created, manager.model) == ("_base_manager", True, model)


def test_the_sharers_and_relatives_of_a_multi_table_family():
    assert set(relatives.sharers(RouteChild)) == {RouteBase, RouteChild}
    assert relatives.relatives(RouteBase) == (RouteChild,)
    assert relatives.relatives(RouteChild) == (RouteBase,)
    assert set(relatives.sharers(RouteEntry)) == {RouteEntry, RouteEntryProxy}
    assert relatives.relatives(RouteEntryProxy) == ()


@isolate_apps("tests.blog")
def test_a_proxy_with_a_plain_default_manager_is_refused_by_track_and_check():
    class RouteVote(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        objects = counters.CountedManager()

        class Meta:
            app_label = "blog"

    counters.track("route_votes", RouteVote, key="post", into=INTO)
    assert found("counters.E046") == []

    class RouteVoteProxy(RouteVote):  # noqa: DJ008
        objects = models.Manager()

        class Meta:
            app_label = "blog"
            proxy = True

    assert found("counters.E046") == [("counters.E046", "RouteVote")]
    message = next(m for m in run_checks(tags=["counters"]) if m.id == "counters.E046").msg
    assert "blog.RouteVoteProxy, a proxy of blog.RouteVote" in message
    with pytest.raises(TrackingError) as info:
        counters.track("route_votes_again", RouteVote, key="post", into="blog.PostStats.comments")
    assert info.value.check_id == "counters.E046"
    assert "route_votes_again" not in {t.name for t in trackers.all_trackers()}


@isolate_apps("tests.blog")
def test_a_multi_table_child_with_a_plain_default_manager_is_refused():
    class RouteParent(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        objects = counters.CountedManager()

        class Meta:
            app_label = "blog"

    class RouteKid(RouteParent):  # noqa: DJ008
        objects = models.Manager()

        class Meta:
            app_label = "blog"

    with pytest.raises(TrackingError) as info:
        counters.track("route_parent", RouteParent, key="post", into=INTO)
    assert info.value.check_id == "counters.E046"  # RouteKid.objects.update() changes its rows
    assert "blog.RouteKid, a multi-table relative of blog.RouteParent" in info.value.problem
    with pytest.raises(TrackingError) as info:
        counters.track("route_kid", RouteKid, key="post", into=INTO)
    assert info.value.check_id == "counters.E013"  # its own default manager


@isolate_apps("tests.blog")
def test_an_uncounted_parent_manager_is_refused_for_a_tracked_child():
    class RouteHolder(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        class Meta:
            app_label = "blog"

    class RouteHeld(RouteHolder):  # noqa: DJ008
        objects = counters.CountedManager()

        class Meta:
            app_label = "blog"

    with pytest.raises(TrackingError) as info:
        counters.track("route_held", RouteHeld, key="post", into=INTO)
    assert info.value.check_id == "counters.E046"  # RouteHolder.objects.update() changes its rows
    assert "blog.RouteHolder, a multi-table relative of blog.RouteHeld" in info.value.problem


@isolate_apps("tests.blog")
def test_a_named_base_manager_that_is_not_counted_is_refused():
    class RouteKept(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        objects = counters.CountedManager()
        everything = models.Manager()  # noqa: DJ012

        class Meta:
            app_label = "blog"
            base_manager_name = "everything"

    with pytest.raises(TrackingError) as info:
        counters.track("route_kept_named", RouteKept, key="post", into=INTO)
    assert info.value.check_id == "counters.E045"
    assert "blog.RouteKept.everything (Meta.base_manager_name)" in info.value.problem


@isolate_apps("tests.blog")
def test_an_uncounted_second_manager_of_a_proxy_is_a_warning():
    class RouteLike(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        objects = counters.CountedManager()

        class Meta:
            app_label = "blog"

    class RouteLikeProxy(RouteLike):  # noqa: DJ008
        raw_rows = models.Manager()

        class Meta:
            app_label = "blog"
            proxy = True
            default_manager_name = "objects"

    counters.track("route_likes", RouteLike, key="post", into=INTO)
    assert found("counters.E046") == []
    assert found("counters.W002") == [("counters.W002", "RouteLikeProxy")]
