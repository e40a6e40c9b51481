"""Every ORM path of a tracked model keeps its counters exact (the blog's two track() calls).

``post_comments`` counts approved comments per post, ``post_points`` sums
their points. Each test checks both against SQL: ``get_value`` before a
flush, the stored rows after it.
"""

from __future__ import annotations

import pytest
from django.db import NotSupportedError
from django.db.models import Case, F, Value, When

import counters
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


@pytest.fixture
def posts():
    return [Post.objects.create(title=f"post {i}") for i in range(3)]


def values(post) -> tuple[int, int]:
    return (
        counters.get_value("post_comments", post.pk),
        counters.get_value("post_points", post.pk),
    )


@pytest.mark.parametrize(
    ("approved", "points", "expected"),
    [
        pytest.param(True, 5, (1, 5), id="approved"),
        pytest.param(False, 5, (0, 0), id="not-approved"),
        pytest.param(True, -3, (1, -3), id="negative-amount"),
        pytest.param(True, 0, (1, 0), id="zero-amount"),
    ],
)
def test_create_counts_the_row_when_where_holds(posts, approved, points, expected):
    Comment.objects.create(post=posts[0], approved=approved, points=points)
    assert values(posts[0]) == expected
    assert_exact(*posts)


def test_save_of_a_new_instance_and_get_or_create_and_update_or_create(posts):
    Comment(post=posts[0], approved=True, points=2).save()
    c, created = Comment.objects.get_or_create(post=posts[0], text="once", approved=True)
    assert created
    assert Comment.objects.get_or_create(post=posts[0], text="once")[1] is False
    Comment.objects.update_or_create(pk=c.pk, defaults={"points": 10})
    Comment.objects.update_or_create(post=posts[1], text="new", defaults={"approved": True})
    assert values(posts[0]) == (2, 12)
    assert values(posts[1]) == (1, 1)
    assert_exact(*posts)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param({"approved": False}, [(0, 0), (0, 0)], id="condition-off"),
        pytest.param({"points": 7}, [(1, 7), (0, 0)], id="amount"),
        pytest.param({"post_index": 1}, [(0, 0), (1, 4)], id="key-moved"),
        pytest.param({"post_index": 1, "points": 9, "approved": True}, [(0, 0), (1, 9)], id="all"),
        pytest.param({"text": "edited"}, [(1, 4), (0, 0)], id="uncounted-field"),
    ],
)
def test_save_of_a_loaded_instance(posts, change, expected):
    c = Comment.objects.create(post=posts[0], approved=True, points=4)
    for name, value in change.items():
        if name == "post_index":
            c.post = posts[value]
        else:
            setattr(c, name, value)
    c.save()
    assert [values(p) for p in posts[:2]] == expected
    assert_exact(*posts)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(["text"], [(1, 4), (0, 0)], id="uncounted-field"),
        pytest.param(["approved"], [(0, 0), (0, 0)], id="condition-only"),
        pytest.param(["points"], [(1, 8), (0, 0)], id="amount-only"),
        pytest.param(["post"], [(0, 0), (1, 4)], id="key-only"),
        pytest.param(["post_id", "points"], [(0, 0), (1, 8)], id="key-attname-and-amount"),
    ],
)
def test_save_with_update_fields_counts_only_the_saved_fields(posts, fields, expected):
    c = Comment.objects.create(post=posts[0], approved=True, points=4)
    c.post, c.approved, c.points, c.text = posts[1], False, 8, "changed"
    c.save(update_fields=fields)
    assert [values(p) for p in posts[:2]] == expected
    assert_exact(*posts)


def test_two_stale_instances_count_the_change_once(posts):
    c = Comment.objects.create(post=posts[0], approved=False, points=3)
    first, second = Comment.objects.get(pk=c.pk), Comment.objects.get(pk=c.pk)
    first.approved = True
    first.save()
    second.approved = True
    second.save()
    assert values(posts[0]) == (1, 3)
    assert_exact(*posts)


def test_a_stale_instance_writes_its_old_state_back_and_that_is_counted(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=3)
    stale = Comment.objects.get(pk=c.pk)
    Comment.objects.filter(pk=c.pk).update(approved=False, points=50)
    stale.text = "edited"
    stale.save()  # writes approved=True, points=3 back: a real change
    assert values(posts[0]) == (1, 3)
    assert_exact(*posts)


def test_a_stale_instance_of_a_deleted_row_is_inserted_again(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=3)
    stale = Comment.objects.get(pk=c.pk)
    c.delete()
    assert values(posts[0]) == (0, 0)
    stale.save()
    assert values(posts[0]) == (1, 3)
    assert_exact(*posts)


def test_save_with_an_expression_reads_the_stored_value_back(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=3)
    c.points = F("points") * 2 + 1
    c.save()
    assert values(posts[0]) == (1, 7)
    assert_exact(*posts)


def test_queryset_update_of_condition_amount_and_key(posts):
    for i in range(4):
        Comment.objects.create(post=posts[0], approved=i % 2 == 0, points=i + 1)
    assert Comment.objects.filter(post=posts[0]).update(approved=True) == 4
    assert values(posts[0]) == (4, 10)
    assert Comment.objects.filter(points__gte=3).update(post=posts[1]) == 2
    assert Comment.objects.filter(post=posts[1]).update(points=100) == 2
    assert Comment.objects.filter(post=posts[1]).update(text="only text") == 2
    assert [values(p) for p in posts[:2]] == [(2, 3), (2, 200)]
    assert_exact(*posts)


@pytest.mark.parametrize(
    "update",
    [
        pytest.param({"points": F("points") * 2}, id="amount-times-two"),
        pytest.param({"points": F("points") - 10}, id="amount-below-zero"),
        pytest.param(
            {"approved": Case(When(approved=True, then=Value(False)), default=Value(True))},
            id="condition-flipped",
        ),
        pytest.param({"post": F("post_id") + 0}, id="key-expression"),
    ],
)
def test_queryset_update_with_expressions_reads_the_new_values(posts, update):
    for i in range(4):
        Comment.objects.create(post=posts[i % 2], approved=i < 3, points=i + 1)
    Comment.objects.all().update(**update)
    assert_exact(*posts)


def test_update_through_a_join_locks_only_the_comments(posts):
    posts[1].title = "target"
    posts[1].save()
    for post in posts:
        Comment.objects.create(post=post, approved=False, points=2)
    assert Comment.objects.filter(post__title="target").update(approved=True) == 1
    assert Comment.objects.filter(post__title__startswith="post").distinct().update(points=3) == 2
    assert [values(p) for p in posts] == [(0, 0), (1, 2), (0, 0)]
    assert_exact(*posts)


def test_related_manager_paths_are_counted(posts):
    posts[0].comment_set.create(approved=True, points=6)
    posts[0].comment_set.filter(points=6).update(points=1)
    assert values(posts[0]) == (1, 1)
    posts[0].comment_set.all().delete()
    assert values(posts[0]) == (0, 0)
    assert_exact(*posts)


def test_bulk_create_and_bulk_update(posts):
    made = Comment.objects.bulk_create(
        [
            Comment(post=posts[0], approved=True, points=2),
            Comment(post=posts[0], approved=False, points=3),
            Comment(post=posts[1], approved=True, points=4),
        ]
    )
    assert [values(p) for p in posts[:2]] == [(1, 2), (1, 4)]
    made[0].points, made[1].approved, made[2].post = 20, True, posts[0]
    assert Comment.objects.bulk_update(made, ["points", "approved", "post"], batch_size=2) == 3
    assert [values(p) for p in posts[:2]] == [(3, 27), (0, 0)]
    assert_exact(*posts)


def test_bulk_create_refuses_conflict_modes_it_cannot_count(posts):
    with pytest.raises(NotSupportedError, match="ignore_conflicts"):
        Comment.objects.bulk_create([Comment(post=posts[0], approved=True)], ignore_conflicts=True)
    assert Comment.objects.count() == 0


def test_instance_and_queryset_delete(posts):
    comments = [
        Comment.objects.create(post=posts[i % 2], approved=True, points=i) for i in range(6)
    ]
    comments[0].delete()
    deleted, per_model = Comment.objects.filter(post=posts[1], points__gte=3).delete()
    assert (deleted, per_model) == (2, {"blog.Comment": 2})
    assert [values(p) for p in posts[:2]] == [(2, 6), (1, 1)]
    assert_exact(*posts)


def test_deleting_a_stale_instance_twice_counts_once(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=5)
    first, second = Comment.objects.get(pk=c.pk), Comment.objects.get(pk=c.pk)
    first.delete()
    second.delete()
    assert values(posts[0]) == (0, 0)
    assert_exact(*posts)


def test_deleting_a_post_cascades_and_nothing_is_brought_back(posts):
    doomed, kept = posts[0], posts[1]
    for post in (doomed, doomed, kept):
        Comment.objects.create(post=post, approved=True, points=3)
    counters.flush()
    assert PostStats.objects.get(pk=doomed.pk).comments == 2
    Comment.objects.create(post=doomed, approved=True, points=1)  # buffered, not flushed
    doomed_pk = doomed.pk
    doomed.delete()
    assert not PostStats.objects.filter(pk=doomed_pk).exists()
    assert not Comment.objects.filter(post_id=doomed_pk).exists()
    result = counters.flush()
    assert result.dropped == 2  # both counters of the deleted post
    assert not PostStats.objects.filter(pk=doomed_pk).exists()
    assert values(Post(pk=doomed_pk)) == (0, 0)
    assert (stored("post_comments", kept), truth("post_comments", kept)) == (1, 1)
    assert_exact(*posts[1:])


def test_queryset_delete_of_posts_cascades(posts):
    for post in posts:
        Comment.objects.create(post=post, approved=True, points=2)
    counters.flush()
    Post.objects.filter(pk__in=[posts[0].pk, posts[2].pk]).delete()
    assert PostStats.objects.count() == 1
    counters.flush()
    assert values(posts[0]) == values(posts[2]) == (0, 0)
    assert list(PostStats.objects.values_list("pk", "comments", "points")) == [(posts[1].pk, 1, 2)]
    assert_exact(posts[1])


def test_sliced_and_combined_update_and_delete_are_refused_like_django(posts):
    Comment.objects.create(post=posts[0], approved=False)
    with pytest.raises(TypeError):
        Comment.objects.all()[:1].update(approved=True)
    with pytest.raises(TypeError):
        Comment.objects.all()[:1].delete()
    union = Comment.objects.filter(pk__gt=0).union(Comment.objects.all())
    with pytest.raises(NotSupportedError):
        union.update(approved=True)
    with pytest.raises(NotSupportedError):
        union.delete()
    assert_exact(*posts)
