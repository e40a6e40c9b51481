"""counters.track() refuses what it cannot count exactly, naming the problem and a check id,
and manage.py check reports the same ids.

A mistake in a declaration (an unknown key, model, field or amount) raises
ImproperlyConfigured. Each of the other refusals was accepted once and then
failed at every write or flush: a where on a generated column (create raised
AttributeError, updates of its inputs were not counted), a composite primary key
(every write raised), two counters in one column (each added into the other), a
text key into an integer primary key (every create raised InvalidKey after its
COMMIT), and counter rows with a NOT NULL column the flush could not fill.
"""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.db.models import NOT_PROVIDED, F, Q
from django.test.utils import isolate_apps

import counters
from counters.base import registry
from counters.base.exceptions import CountersError, TrackingError, UnknownCounter
from counters.tracking import trackers
from counters.tracking.declare import CHECK_IDS
from tests.blog.models import Comment, DeclGenerated, DeclPair, DeclTally, Post

STATS = "blog.PostStats.comments"


@pytest.fixture(autouse=True)
def isolated_trackers(monkeypatch):
    """Trackers and counters a test adds vanish after it; the apps' own ones stay."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))


# -- mistakes in a declaration ---------------------------------------------------------


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
            {"where": Q(post__id__gt=0)}, "counters.E056", "through blog.Post", id="traversal"
        ),
        pytest.param(
            {"where": Q(post__title__startswith="x")},
            "counters.E011",
            "'startswith'",
            id="traversal-lookup",
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
        pytest.param({"name": "a:b"}, "counters.E016", "letters, digits", id="name"),
        pytest.param({"name": "post comments"}, "counters.E016", "letters", id="name-space"),
        pytest.param({"name": "café"}, "counters.E016", "letters", id="name-accent"),
        pytest.param({"name": ""}, "counters.E016", "letters", id="name-empty"),
    ],
)
def test_a_mistake_raises_improperly_configured_with_its_check_id(kwargs, check_id, words):
    args = {"name": "comments2", "model": Comment, "key": "post", "into": STATS, **kwargs}
    with pytest.raises(ImproperlyConfigured) as info:
        counters.track(args.pop("name"), args.pop("model"), **args)
    error = info.value
    assert isinstance(error, TrackingError) and isinstance(error, CountersError)
    assert error.check_id == check_id
    assert check_id in CHECK_IDS
    assert str(error).startswith(f"{check_id}: counter ")
    assert words in error.problem
    assert "comments2" not in {t.name for t in trackers.all_trackers()}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        pytest.param(
            {"wher": Q(approved=True)},
            "unknown keyword 'wher' (did you mean 'where'?); the keywords are key, into, where, "
            "amount",
            id="misspelled",
        ),
        pytest.param({"colour": "red"}, "unknown keyword 'colour'; the keywords", id="unknown"),
        pytest.param({"into": None}, "argument: 'into'; the keywords are key", id="missing"),
    ],
)
def test_a_wrong_keyword_raises_a_tracking_error_naming_the_valid_ones(kwargs, words):
    args = {"key": "post", "into": STATS, **kwargs}
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(TrackingError) as info:
        counters.track("comments2", Comment, **args)
    assert info.value.check_id == "counters.E016"
    assert info.value.counter == "comments2"
    assert words in info.value.problem
    assert "comments2" not in {t.name for t in trackers.all_trackers()}


def test_the_same_declaration_twice_is_harmless_and_other_arguments_are_refused():
    first = trackers.get_tracker("post_comments")
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
    assert trackers.trackers_for(Comment) == (
        trackers.get_tracker("post_comments"),
        trackers.get_tracker("post_points"),
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


# -- declarations that would fail at every write or flush ------------------------------


TALLY = "blog.DeclTally.votes"


def refused(check_id: str, model, **kwargs) -> TrackingError:
    with pytest.raises(TrackingError) as info:
        counters.track("refused", model, **kwargs)
    assert info.value.check_id == check_id
    assert check_id in CHECK_IDS
    assert "refused" not in {t.name for t in trackers.all_trackers()}
    with pytest.raises(UnknownCounter):
        registry.get_spec("refused")
    return info.value


def counters_checks() -> list[tuple[str, str]]:
    return [(m.id, m.msg) for m in run_checks(tags=["counters"]) if m.id.startswith("counters.")]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"key": "post", "where": Q(doubled__gt=4)}, id="where"),
        pytest.param({"key": "post", "where": Q(points=1) | Q(doubled=2)}, id="where-in-or"),
        pytest.param({"key": "doubled"}, id="key"),
    ],
)
def test_a_generated_field_is_refused(kwargs):
    error = refused("counters.E051", DeclGenerated, into=TALLY, **kwargs)
    assert "'doubled' is a GeneratedField" in error.problem


def test_its_inputs_may_be_counted():
    counters.track("points", DeclGenerated, key="post", into=TALLY, where=Q(points__gt=2))


@pytest.mark.parametrize(
    ("model", "into", "role"),
    [
        pytest.param(DeclPair, TALLY, "source model blog.DeclPair", id="source"),
        pytest.param(
            Comment, "blog.DeclPairStats.comments", "into model blog.DeclPairStats", id="into"
        ),
    ],
)
def test_a_composite_primary_key_is_refused(model, into, role):
    error = refused("counters.E052", model, key="post", into=into)
    assert f"{role} has a composite primary key" in error.problem


def test_a_second_counter_into_one_column_is_refused():
    error = refused("counters.E053", Comment, key="post", into="blog.PostStats.comments")
    assert "already holds counter 'post_comments'" in error.problem
    counters.track("votes", Comment, key="post", into=TALLY)
    refused("counters.E053", Comment, key="post", into=TALLY, where=Q(approved=True))
    # the same declaration again is still harmless
    counters.track("votes", Comment, key="post", into=TALLY)


def test_a_text_key_into_an_integer_key_is_refused():
    error = refused("counters.E054", Comment, key="text", into=TALLY)
    assert "'text' holds text values" in error.problem
    assert "blog.DeclTally.post" in error.problem
    counters.track("by_rating", Comment, key="rating", into=TALLY)  # integer into integer


def test_counter_rows_the_flush_cannot_create_are_refused():
    error = refused("counters.E050", Comment, key="post", into="blog.DeclStrict.comments")
    assert "NOT NULL columns without a default (label)" in error.problem


def test_stamped_columns_are_accepted():
    counters.track("stamped", Comment, key="post", into="blog.DeclStamped.comments")


def test_the_apps_declarations_pass():
    assert counters_checks() == []


def test_check_reports_a_counter_registered_into_a_tracked_column():
    counters.track("votes", Comment, key="post", into=TALLY)
    registry.register("votes_too", "blog.DeclTally", key_field="post", value_field="votes")
    assert [check_id for check_id, _ in counters_checks()] == ["counters.E053"]


def test_check_reports_a_column_that_lost_its_default(monkeypatch):
    counters.track("votes", Comment, key="post", into=TALLY)
    monkeypatch.setattr(DeclTally._meta.get_field("first"), "default", NOT_PROVIDED)
    found = counters_checks()
    assert [check_id for check_id, _ in found] == ["counters.E050"]
    assert "(first)" in found[0][1]
