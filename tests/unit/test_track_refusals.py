"""counters.track() refuses declarations it cannot count, and manage.py check reports the same ids.

Each of these was accepted once and then failed at every write or flush:
a where on a generated column (create raised AttributeError, updates of its
inputs were not counted), a composite primary key (every write raised), two
counters in one column (each added into the other), a text key into an
integer primary key (every create raised InvalidKey after its COMMIT), and
counter rows with a NOT NULL column the flush could not fill.
"""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.db.models import NOT_PROVIDED, Q

import counters
from counters import registry, tracking
from counters.exceptions import TrackingError, UnknownCounter
from tests.blog.models import Comment, DeclGenerated, DeclPair, DeclTally

TALLY = "blog.DeclTally.votes"


@pytest.fixture(autouse=True)
def isolated_trackers(monkeypatch):
    """Trackers and counters a test adds vanish after it; the apps' own ones stay."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_fields", "_names"):
        monkeypatch.setattr(tracking, name, dict(getattr(tracking, name)))


def refused(check_id: str, model, **kwargs) -> TrackingError:
    with pytest.raises(TrackingError) as info:
        counters.track("refused", model, **kwargs)
    assert info.value.check_id == check_id
    assert check_id in tracking.CHECK_IDS
    assert "refused" not in {t.name for t in tracking.all_trackers()}
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
