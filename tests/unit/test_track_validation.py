"""counters.track() refuses what it cannot count exactly, naming the problem and a check id."""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.db.models import F, Q
from django.test.utils import isolate_apps

import counters
from counters import registry, tracking
from counters.exceptions import CountersError, TrackingError
from tests.blog.models import Comment, Post

STATS = "blog.PostStats.comments"


@pytest.fixture(autouse=True)
def isolated_trackers(monkeypatch):
    """Trackers and counters a test adds vanish after it; the apps' own ones stay."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_fields", "_names"):
        monkeypatch.setattr(tracking, name, dict(getattr(tracking, name)))


@pytest.mark.parametrize(
    ("kwargs", "check_id", "words"),
    [
        pytest.param({"key": "author"}, "counters.E010", "key 'author'", id="unknown-key"),
        pytest.param({"model": "blog.Nope"}, "counters.E010", "no model", id="unknown-model"),
        pytest.param({"into": "blog.PostStats"}, "counters.E010", "app_label.Model", id="into"),
        pytest.param({"into": "blog.Nope.n"}, "counters.E010", "no model", id="into-model"),
        pytest.param({"into": "blog.PostStats.n"}, "counters.E010", "into 'n'", id="into-field"),
        pytest.param({"amount": "score"}, "counters.E010", "amount 'score'", id="amount"),
        pytest.param({"where": Q(colour=1)}, "counters.E010", "no field 'colour'", id="where"),
        pytest.param(
            {"where": Q(post__title="x")}, "counters.E011", "follows a relation", id="traversal"
        ),
        pytest.param(
            {"where": Q(text__icontains="a")}, "counters.E011", "'icontains'", id="lookup"
        ),
        pytest.param(
            {"where": Q(points__gt=F("rating"))}, "counters.E011", "expression", id="expression"
        ),
        pytest.param({"where": Q(text__gt="m")}, "counters.E011", "CharField", id="text-order"),
        pytest.param({"where": {"approved": True}}, "counters.E011", "a Q object", id="not-q"),
        pytest.param({"where": Q(points="many")}, "counters.E011", "not a value", id="value"),
        pytest.param({"amount": "approved"}, "counters.E012", "BooleanField", id="bool-amount"),
        pytest.param({"amount": "text"}, "counters.E012", "CharField", id="text-amount"),
        pytest.param({"into": "blog.Post.title"}, "counters.E012", "CharField", id="target"),
        pytest.param({"model": Post, "key": "id"}, "counters.E013", "CountedManager", id="manager"),
        pytest.param(
            {"into": "blog.Comment.points"}, "counters.E015", "pointing to blog.Post", id="key"
        ),
        pytest.param({"name": "a:b"}, "counters.E016", "without ':'", id="name"),
    ],
)
def test_a_mistake_raises_improperly_configured_with_its_check_id(kwargs, check_id, words):
    args = {"name": "comments2", "model": Comment, "key": "post", "into": STATS, **kwargs}
    with pytest.raises(ImproperlyConfigured) as info:
        counters.track(args.pop("name"), args.pop("model"), **args)
    error = info.value
    assert isinstance(error, TrackingError) and isinstance(error, CountersError)
    assert error.check_id == check_id
    assert check_id in tracking.CHECK_IDS
    assert str(error).startswith(f"{check_id}: counter ")
    assert words in error.problem
    assert "comments2" not in {t.name for t in tracking.all_trackers()}


def test_the_same_declaration_twice_is_harmless_and_other_arguments_are_refused():
    first = tracking.get_tracker("post_comments")
    again = counters.track("post_comments", Comment, key="post", into=STATS, where=Q(approved=True))
    assert again is first
    with pytest.raises(TrackingError) as info:
        counters.track("post_comments", Comment, key="post", into=STATS)
    assert info.value.check_id == "counters.E014"
    with pytest.raises(TrackingError) as info:
        counters.track("unread", Comment, key="post", into=STATS)  # a register()ed name
    assert info.value.check_id == "counters.E014"


def test_track_registers_a_counter_on_the_into_field():
    spec = registry.get_spec("post_points")
    assert (spec.model_label, spec.key_field) == ("blog.PostStats", "post")
    assert spec.value_field == "points"
    assert spec.non_negative is False  # a sum may go below zero
    assert registry.get_spec("post_comments").non_negative is True  # a count may not
    assert tracking.trackers_for(Comment) == (
        tracking.get_tracker("post_comments"),
        tracking.get_tracker("post_points"),
    )


def test_the_apps_pass_the_system_checks():
    assert [m.id for m in run_checks(tags=["counters"]) if m.id.startswith("counters.")] == []


@isolate_apps("tests.blog")
def test_an_uncounted_second_manager_is_a_warning():
    class Vote(models.Model):  # noqa: DJ008
        post = models.ForeignKey(Post, on_delete=models.CASCADE)

        objects = counters.CountedManager()
        everything = models.Manager()  # noqa: DJ012

        class Meta:
            app_label = "blog"

    counters.track("votes", Vote, key="post", into="blog.DeclTally.votes")
    found = [m for m in run_checks(tags=["counters"]) if m.id.startswith("counters.")]
    assert [(m.id, m.obj) for m in found] == [("counters.W002", Vote)]
    assert "blog.Vote.everything is not counted" in found[0].msg
