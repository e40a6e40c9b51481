"""Related keys (``key="post__author"``): exact on every path of the comments and of the posts.

The counters of ``tests.blog`` count approved comments per author of their post,
the points of approved comments on published posts per editor of their post
(``SET_NULL``), and approved comments of published posts per post. After each
path, ``get_value`` of every key equals the SQL truth over the join, and after
a flush so do the stored rows.
"""

from __future__ import annotations

import pytest
from django.db import transaction
from django.db.models import Case, F, Q, Value, When

import counters
from counters.base.exceptions import TrackingError
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild_all
from tests.blog.models import RelAuthor, RelComment, RelLooseComment, RelPost, RelVote, RouteEntry
from tests.blog.related import assert_related_exact, stored, truths
from tests.helpers import QUICK_CONFIRM

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def world():
    a, b, c = (RelAuthor.objects.create(name=n) for n in "abc")
    posts = [
        RelPost.objects.create(author=a, editor=b, published=True),
        RelPost.objects.create(author=a, editor=c, published=False),
        RelPost.objects.create(author=b, editor=a, published=True),
    ]
    for i, post in enumerate(posts):
        for j in range(4):
            RelComment.objects.create(post=post, approved=(i + j) % 2 == 0, points=j + 1)
    return a, b, c, posts


@pytest.mark.usefixtures("redis_backend")
def test_comment_paths(world):
    _a, _b, _c, posts = world
    assert_related_exact()
    comment = RelComment.objects.create(post=posts[0], approved=True, points=5)
    comment.approved = False
    comment.save()
    comment.approved = True
    comment.post = posts[2]
    comment.save(update_fields=["approved", "post"])
    RelComment.objects.filter(post=posts[1]).update(approved=True)
    RelComment.objects.filter(post=posts[0]).update(post=posts[1])
    RelComment.objects.bulk_create([RelComment(post=p, approved=True) for p in posts])
    some = list(RelComment.objects.filter(post=posts[2]))
    for obj in some:
        obj.approved = not obj.approved
    RelComment.objects.bulk_update(some, ["approved"])
    assert_related_exact()
    comment.delete()
    RelComment.objects.filter(points=2).delete()
    assert_related_exact()


def test_post_author_save_and_update(world):
    a, b, c, posts = world
    post = posts[0]
    post.author = c
    post.save()
    assert_related_exact(flush=False)
    post.editor = None
    post.save(update_fields=["editor"])
    RelPost.objects.filter(pk=posts[1].pk).update(author=b, editor=a)
    RelPost.objects.filter(author=b).update(author=F("editor"))
    assert_related_exact()
    RelPost.objects.bulk_update(
        [RelPost(pk=p.pk, author=c, editor=b) for p in posts], ["author", "editor"]
    )
    a.rel_posts.update(published=False)  # a related manager
    assert_related_exact()
    # through a multi-valued join: each post moves once, however many comments match
    RelPost.objects.filter(comments__approved=True).update(editor=a, published=True)
    RelPost.objects.filter(comments__points__gt=0).distinct().update(author=a)
    assert_related_exact()


def test_publish_toggles(world):
    _a, b, _c, posts = world
    posts[1].published = True
    posts[1].save()
    assert_related_exact(flush=False)
    RelPost.objects.update(published=Case(When(published=True, then=Value(False)), default=True))
    assert_related_exact()
    RelPost.objects.filter(pk=posts[0].pk).update(published=True, author=b)
    assert_related_exact()


def test_middle_and_last_deletes(world):
    a, _b, c, posts = world
    posts[0].delete()  # its comments cascade
    assert_related_exact(flush=False)
    c.delete()  # SET_NULL on the editor of posts[1]
    assert_related_exact(flush=False)
    assert RelPost.objects.get(pk=posts[1].pk).editor_id is None
    a.delete()  # CASCADE: its posts, and their comments
    assert_related_exact()
    RelPost.objects.all().delete()
    assert_related_exact()
    assert truths("author_comments") == {}


def test_in_one_transaction_and_rolled_back(world):
    a, b, c, posts = world
    with transaction.atomic():
        posts[0].author = b
        posts[0].save()
        RelComment.objects.create(post=posts[0], approved=True)
        RelPost.objects.filter(pk=posts[0].pk).update(author=c, published=False)
        RelComment.objects.filter(post=posts[0]).update(approved=True)
    with pytest.raises(RuntimeError), transaction.atomic():
        RelPost.objects.update(author=a)
        raise RuntimeError
    assert_related_exact()


def test_rebuild_and_audit_truth(world):
    _a, _b, c, _posts = world
    with counters.paused():  # uncounted: the stored rows drift
        RelPost.objects.update(author=c)
    rebuild_all(confirm_delay=QUICK_CONFIRM)  # no writer runs: nothing is on its way
    assert_related_exact()
    assert stored("author_comments") == truths("author_comments")


def test_durable_mode_and_the_audit(world, settings):
    a, _b, c, posts = world
    settings.COUNTERS_DURABLE = True
    posts[0].author = c
    posts[0].save()
    RelPost.objects.filter(pk=posts[2].pk).update(editor=c, published=False)
    RelComment.objects.create(post=posts[1], approved=True, points=7)
    assert_related_exact()
    with counters.paused():  # drift the audit must find and repair
        RelComment.objects.filter(post=posts[1]).update(approved=False)
    result = audit(names=["author_comments"], confirm_delay=0.05)
    repaired = {(r.counter, d.key): d.error for r in result.counters for d in r.repaired}
    assert repaired == {("author_comments", a.pk): 3}  # posts[1] had 2 approved, +1 new
    assert_related_exact()


def test_uncounted_middle_is_refused():
    with pytest.raises(TrackingError) as caught:
        counters.track(
            "loose_comments",
            RelLooseComment,
            key="post__author",
            into="blog.RelAuthorStats.comments",
        )
    assert caught.value.check_id == "counters.E056"
    assert "RelLoosePost" in str(caught.value)


def test_paths_through_two_relations_are_refused():
    with pytest.raises(TrackingError) as caught:
        counters.track(
            "two_relations",
            RouteEntry,
            key="owner__id",
            into="blog.RelAuthorStats.comments",
            where=Q(keeper__id__gt=0),
        )
    assert caught.value.check_id == "counters.E056"
    assert "two relations" in str(caught.value)


def test_a_related_path_to_a_generated_column_is_refused():
    with pytest.raises(TrackingError) as caught:
        counters.track(
            "generated_path",
            RelVote,
            key="target__post",
            into="blog.PostStats.comments",
            where=Q(target__doubled__gt=2),
        )
    assert caught.value.check_id == "counters.E051"
    assert "related path 'doubled' is a GeneratedField" in str(caught.value)


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("post__comments", id="reverse"),
        pytest.param("post__author__rel_posts", id="reverse-deeper"),
        pytest.param("post__published__author", id="column-then-more"),
        pytest.param("approved__author", id="not-a-relation"),
        pytest.param("post__nothing", id="unknown"),
    ],
)
def test_unsupported_paths_are_refused(key):
    with pytest.raises(TrackingError) as caught:
        counters.track("odd_path", RelComment, key=key, into="blog.RelAuthorStats.comments")
    assert caught.value.check_id == "counters.E010"
