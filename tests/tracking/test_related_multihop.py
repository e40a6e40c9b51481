"""Related paths of several relations (``key="post__blog__owner"``): exact on every path.

The counters of ``tests.blog`` over ``HopComment -> HopPost -> HopBlog -> HopOwner``
count approved comments of published posts per owner of their blog (the owner
``SET_NULL``), the points of approved comments in public blogs per founder of
the blog (``CASCADE``), comments of published posts per blog, comments per
owner while the owner is active (a path of three relations), and published
posts per owner of their blog. After each path, and after a seeded random mix
of all of them, ``get_value`` of every key equals the SQL truth over the joins,
and after a flush so do the stored rows.
"""

from __future__ import annotations

import random

import pytest
from django.db import OperationalError, connection, transaction
from django.db.models import Q

import counters
from counters.base.exceptions import TrackingError
from counters.tracking.paths import resolve
from counters.tracking.refusals import uncounted_middle
from counters.tracking.where import WhereError, compile_where
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild
from tests.blog.hops import COUNTERS, assert_hops_exact, stored, truths
from tests.blog.models import HopBlog, HopComment, HopOwner, HopPost
from tests.conftest import has_row_locks
from tests.helpers import deadlocked, race

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def world():
    owners = [HopOwner.objects.create(name=n) for n in "abcd"]
    blogs = [
        HopBlog.objects.create(owner=owners[0], founder=owners[1], public=True),
        HopBlog.objects.create(owner=owners[1], founder=owners[2], public=False),
        HopBlog.objects.create(owner=None, founder=owners[0], public=True),
    ]
    posts = [HopPost.objects.create(blog=blogs[i % 3], published=i % 4 != 3) for i in range(5)]
    for i, post in enumerate(posts):
        for j in range(3):
            HopComment.objects.create(post=post, approved=(i + j) % 3 != 0, points=j + 1)
    return owners, blogs, posts


def test_comment_paths(world):
    _owners, _blogs, posts = world
    assert_hops_exact()
    comment = HopComment.objects.create(post=posts[0], approved=True, points=4)
    comment.approved = False
    comment.save()
    comment.approved = True
    comment.post = posts[1]
    comment.save(update_fields=["approved", "post"])
    HopComment.objects.filter(post=posts[3]).update(approved=True)
    HopComment.objects.filter(post=posts[0]).update(post=posts[2])
    HopComment.objects.bulk_create([HopComment(post=p, approved=True) for p in posts])
    some = list(HopComment.objects.filter(post=posts[2]))
    for obj in some:
        obj.approved = not obj.approved
        obj.points += 1
    HopComment.objects.bulk_update(some, ["approved", "points"])
    assert_hops_exact()
    comment.delete()
    HopComment.objects.filter(points=2).delete()
    assert_hops_exact()


def test_changes_at_depth_one(world):
    _owners, blogs, posts = world
    post = posts[0]
    post.blog = blogs[1]  # every comment below moves to the new blog's owner and founder
    post.save()
    assert_hops_exact(flush=False)
    post.published = False
    post.save(update_fields=["published"])
    HopPost.objects.filter(pk=posts[1].pk).update(blog=blogs[2], published=True)
    HopPost.objects.filter(blog=blogs[0]).update(blog=blogs[1])
    assert_hops_exact()
    HopPost.objects.bulk_update(
        [HopPost(pk=p.pk, blog=blogs[i % 3], published=i % 2 == 0) for i, p in enumerate(posts)],
        ["blog", "published"],
    )
    blogs[2].posts.add(posts[0], posts[1])  # a related manager: the base manager's update
    assert_hops_exact()
    # through a multi-valued join: each post moves once, however many comments match
    HopPost.objects.filter(comments__approved=True).update(blog=blogs[0])
    assert_hops_exact()


@pytest.mark.usefixtures("redis_backend")
def test_changes_at_depth_two_and_three(world):
    owners, blogs, _posts = world
    blog = blogs[0]
    blog.owner = owners[3]
    blog.save()
    assert_hops_exact(flush=False)
    blog.public = False
    blog.founder = owners[2]
    blog.save(update_fields=["public", "founder"])
    HopBlog.objects.filter(pk=blogs[1].pk).update(owner=None, public=True)
    HopBlog.objects.filter(founder=owners[2]).update(founder=owners[0], owner=owners[1])
    assert_hops_exact()
    HopBlog.objects.bulk_update(
        [HopBlog(pk=b.pk, owner=owners[i], founder=owners[3 - i]) for i, b in enumerate(blogs)],
        ["owner", "founder"],
    )
    owners[2].owned_blogs.add(blogs[1])  # a related manager
    owners[0].owned_blogs.clear()  # SET NULL through the related manager
    assert_hops_exact()
    owners[1].active = False  # depth three: post__blog__owner__active
    owners[1].save()
    HopOwner.objects.filter(pk__in=[owners[0].pk, owners[2].pk]).update(active=False)
    HopOwner.objects.update(active=True)
    assert_hops_exact()


def test_middle_and_end_deletes(world):
    owners, blogs, posts = world
    posts[0].delete()  # a middle row at depth one: its comments cascade
    assert_hops_exact(flush=False)
    blogs[1].delete()  # depth two: its posts and their comments cascade
    assert_hops_exact(flush=False)
    owners[0].delete()  # the end: SET_NULL as an owner, CASCADE as a founder
    assert_hops_exact()
    assert HopBlog.objects.get(pk=blogs[0].pk).owner_id is None
    assert not HopBlog.objects.filter(pk=blogs[2].pk).exists()
    HopBlog.objects.filter(pk__in=[b.pk for b in blogs]).delete()
    HopOwner.objects.all().delete()
    assert_hops_exact()
    assert truths("hop_owner_comments") == {}


def test_in_one_transaction_and_rolled_back(world):
    owners, blogs, posts = world
    with transaction.atomic():
        blogs[0].owner = owners[2]
        blogs[0].save()
        posts[0].blog = blogs[1]
        posts[0].save()
        HopComment.objects.create(post=posts[0], approved=True)
        HopBlog.objects.filter(pk=blogs[1].pk).update(owner=owners[3], public=True)
        HopPost.objects.filter(pk=posts[0].pk).update(blog=blogs[0], published=True)
    with pytest.raises(RuntimeError), transaction.atomic():
        HopBlog.objects.update(owner=owners[0])
        HopPost.objects.update(blog=blogs[2])
        raise RuntimeError
    assert_hops_exact()


def test_rebuild_and_audit_truth(world, settings):
    owners, blogs, posts = world
    with counters.paused():  # uncounted: the stored rows drift
        HopBlog.objects.update(owner=owners[3])
    for name in COUNTERS:
        rebuild(name, confirm_delay=0.05)
    assert_hops_exact()
    assert stored("hop_owner_comments") == truths("hop_owner_comments")
    settings.COUNTERS_DURABLE = True
    posts[1].blog = blogs[0]
    posts[1].save()
    assert_hops_exact()
    lost = HopComment.objects.filter(post=posts[1], approved=True).count()
    with counters.paused():  # drift the audit must find and repair
        HopPost.objects.filter(pk=posts[1].pk).update(published=False)
    result = audit(names=list(COUNTERS), confirm_delay=0.05)
    repaired = {(r.counter, d.key): d.error for r in result.counters for d in r.repaired}
    assert lost and repaired[("hop_owner_comments", owners[3].pk)] == lost
    assert_hops_exact()


def test_a_where_over_several_relations_is_decided_from_the_row_and_its_path_values():
    hops: dict = {}
    where = Q(approved=True, post__blog__public__in=[True]) & ~Q(post__blog__owner__isnull=True)
    test, attnames = compile_where(HopComment, where, hops=hops)
    assert attnames == {"approved"}
    assert sorted(hops) == ["post__blog__owner", "post__blog__public"]
    row = {"approved": True, "post__blog__public": True, "post__blog__owner": 3}
    assert test(row)
    assert not test({**row, "post__blog__owner": None})
    assert not test({**row, "post__blog__public": False})
    with pytest.raises(WhereError, match="follows a relation"):
        compile_where(HopComment, Q(post__blog__public=True))  # not accepted without hops
    with pytest.raises(WhereError, match="lookup 'startswith' is not supported"):
        compile_where(HopComment, Q(post__blog__owner__name__startswith="a"), hops={})
    with pytest.raises(WhereError, match="'post__blog' leads to no field 'nothing'") as caught:
        compile_where(HopComment, Q(post__blog__nothing__owner=1), hops={})
    assert caught.value.unknown_field
    with pytest.raises(WhereError, match="nullable post__blog__owner"):  # NULL on MySQL
        compile_where(HopComment, Q(post__blog__owner=1) ^ Q(approved=True), mysql=True, hops={})


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        pytest.param(
            {"key": "post__archive__owner"},
            "goes through blog.HopArchive (at depth 2)",
            id="uncounted-at-depth-2",
        ),
        pytest.param(
            {"key": "post__blog__archive__owner"},
            "goes through blog.HopArchive (at depth 3)",
            id="uncounted-at-depth-3",
        ),
        pytest.param(
            {"key": "post__parent__blog__owner"},
            "goes through blog.HopPost twice (at depths 1 and 2)",
            id="cycle",
        ),
        pytest.param(
            {"key": "post__blog__owner", "where": Q(post__parent__published=True)},
            "through post__blog and post__parent: paths through two relations",
            id="paths-part-ways",
        ),
    ],
)
def test_paths_that_cannot_be_counted_are_refused(kwargs, words):
    with pytest.raises(TrackingError) as caught:
        counters.track("hop_refused", HopComment, into="blog.HopOwnerStats.comments", **kwargs)
    assert caught.value.check_id == "counters.E056"
    assert words in str(caught.value)


def test_the_model_at_the_end_need_not_be_counted():
    # HopArchive's default manager is Django's: fine where the path ends at its key
    assert uncounted_middle(HopComment, [resolve(HopComment, "post__blog__archive")]) is None
    hops = [resolve(HopComment, p) for p in ("post__blog__owner", "post__published")]
    assert uncounted_middle(HopComment, hops) is None  # paths sharing their first relations


# -- a seeded random mix of every path -----------------------------------------------------


def _comment_step(rng: random.Random, choice: int, posts: list, comments: list) -> None:
    post = rng.choice(posts)
    if choice == 0 or not comments:
        HopComment.objects.create(post=post, approved=rng.random() < 0.7, points=rng.randrange(5))
    elif choice == 1:
        HopComment.objects.bulk_create(
            [HopComment(post=rng.choice(posts), approved=True) for _ in range(3)]
        )
    elif choice == 2:
        comment = rng.choice(comments)
        comment.approved = not comment.approved
        comment.post = post
        comment.save()
    elif choice == 3:
        HopComment.objects.filter(pk=rng.choice(comments).pk).update(post=post, points=3)
    elif choice == 4:
        some = rng.sample(comments, min(3, len(comments)))
        for obj in some:
            obj.approved = rng.random() < 0.5
            obj.post = rng.choice(posts)
        HopComment.objects.bulk_update(some, ["approved", "post"])
    elif choice == 5:
        rng.choice(comments).delete()
    else:
        HopComment.objects.filter(pk__in=[c.pk for c in comments[::5]]).delete()


def _post_step(rng: random.Random, choice: int, blogs: list, posts: list) -> None:
    post = rng.choice(posts)
    if choice == 0:
        post.blog = rng.choice(blogs)
        post.published = rng.random() < 0.6
        post.save()
    elif choice == 1:
        HopPost.objects.filter(pk__in=[p.pk for p in posts[::2]]).update(blog=rng.choice(blogs))
    elif choice == 2:
        post.published = not post.published
        post.save(update_fields=["published"])
    elif choice == 3:
        HopPost.objects.bulk_update(
            [HopPost(pk=p.pk, blog=rng.choice(blogs), published=rng.random() < 0.5) for p in posts],
            ["blog", "published"],
        )
    elif choice == 4:
        rng.choice(blogs).posts.add(post)
    else:
        post.delete()


def _blog_step(rng: random.Random, choice: int, owners: list, blogs: list) -> None:
    blog = rng.choice(blogs)
    if choice == 0:
        blog.owner = rng.choice([*owners, None])
        blog.public = rng.random() < 0.6
        blog.save()
    elif choice == 1:
        HopBlog.objects.filter(owner=rng.choice(owners)).update(
            owner=rng.choice(owners), founder=rng.choice(owners)
        )
    elif choice == 2:
        HopBlog.objects.bulk_update(
            [HopBlog(pk=b.pk, owner=rng.choice([*owners, None])) for b in blogs], ["owner"]
        )
    elif choice == 3:
        owner = rng.choice(owners)
        owner.active = not owner.active
        owner.save()
    elif choice == 4:
        HopOwner.objects.filter(pk=rng.choice(owners).pk).update(active=rng.random() < 0.5)
    elif choice == 5:
        blog.delete()
    else:
        victim = rng.choice(owners)
        victim.delete()  # SET_NULL as an owner, CASCADE as a founder
        owners.remove(victim)
        owners.append(HopOwner.objects.create(name=f"n{rng.randrange(10**6)}"))


def step(rng: random.Random, owners: list[HopOwner]) -> None:
    """One random change, through one of the paths of comments, posts, blogs and owners."""
    blogs = list(HopBlog.objects.order_by("pk"))
    if not blogs or rng.random() < 0.06:
        HopBlog.objects.create(
            owner=rng.choice([*owners, None]), founder=rng.choice(owners), public=rng.random() < 0.6
        )
        return
    posts = list(HopPost.objects.order_by("pk"))
    if not posts or rng.random() < 0.08:
        HopPost.objects.create(blog=rng.choice(blogs), published=rng.random() < 0.6)
        return
    comments = list(HopComment.objects.order_by("pk"))
    layer = rng.randrange(10)
    if layer < 5:
        _comment_step(rng, rng.randrange(7), posts, comments)
    elif layer < 8:
        _post_step(rng, rng.choice([0, 0, 1, 2, 3, 4, 5]), blogs, posts)
    else:
        _blog_step(rng, rng.choice([0, 0, 1, 2, 3, 4, 5, 6]), owners, blogs)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_mix_of_every_path_stays_exact(seed):
    rng = random.Random(seed)
    owners = [HopOwner.objects.create(name=f"o{i}") for i in range(4)]
    for batch in range(8):
        for _ in range(14):
            if rng.random() < 0.25:
                with transaction.atomic():
                    step(rng, owners)
                    step(rng, owners)
            else:
                step(rng, owners)
        assert_hops_exact(flush=batch % 2 == 1)
    assert_hops_exact()
    assert HopComment.objects.exists() or HopPost.objects.exists()


# -- writers racing on the middle rows at every depth ----------------------------------------

THREADS = 16
ROUNDS = 10


@pytest.mark.serial
@pytest.mark.postgres
@pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections")
def test_racing_deep_changes_post_moves_and_new_comments_end_exact():
    owners = [HopOwner.objects.create(name=f"r{i}") for i in range(4)]
    blogs = [
        HopBlog.objects.create(owner=owners[i], founder=owners[(i + 1) % 4], public=i != 1)
        for i in range(3)
    ]
    posts = [HopPost.objects.create(blog=blogs[i % 3], published=True) for i in range(4)]
    ids = {
        "owners": [o.pk for o in owners],
        "blogs": [b.pk for b in blogs],
        "posts": [p.pk for p in posts],
    }

    def write(i: int, barrier) -> int:
        rng = random.Random(i)
        victims = 0
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)
            try:
                _race_step((i + round_) % 8, rng, ids)
            except OperationalError as exc:
                # InnoDB breaks a deadlock between index entries locked in opposite orders
                # (tests.helpers.deadlocked), counted or not: the victim's step rolls back
                # whole and counts nothing. PostgreSQL never picks one here.
                if not (connection.vendor == "mysql" and deadlocked(exc)):
                    raise
                victims += 1
        return victims

    victims = sum(race(THREADS, write, timeout=300))
    assert victims <= THREADS * ROUNDS // 4  # most steps of the race ran
    assert HopComment.objects.filter(approved=True).exists()
    assert_hops_exact()


def _race_step(route: int, rng: random.Random, ids: dict[str, list[int]]) -> None:
    owner, blog, post = (rng.choice(ids[k]) for k in ("owners", "blogs", "posts"))
    if route == 0:  # depth two, by save()
        row = HopBlog.objects.get(pk=blog)
        row.owner_id = rng.choice([owner, None])
        row.public = rng.random() < 0.7
        row.save()
    elif route == 1:  # depth two, by update()
        HopBlog.objects.filter(pk=blog).update(owner=owner, founder=rng.choice(ids["owners"]))
    elif route == 2:  # depth one: the post moves to another blog, by save()
        row = HopPost.objects.get(pk=post)
        row.blog_id = blog
        row.published = rng.random() < 0.8
        row.save()
    elif route == 3:  # depth one, by update()
        HopPost.objects.filter(pk=post).update(blog=blog)
    elif route == 4:  # depth three
        HopOwner.objects.filter(pk=owner).update(active=rng.random() < 0.6)
    elif route == 5:
        HopComment.objects.create(post_id=post, approved=rng.random() < 0.8, points=2)
    elif route == 6:
        with transaction.atomic():
            comment = HopComment.objects.create(post_id=post, approved=False)
            HopComment.objects.filter(pk=comment.pk).update(approved=True, points=3)
    else:  # existing comments: approved, or moved to another post
        first = list(HopComment.objects.filter(post_id=post).values_list("pk", flat=True)[:3])
        HopComment.objects.filter(pk__in=first).update(
            approved=rng.random() < 0.5, post=rng.choice(ids["posts"])
        )
