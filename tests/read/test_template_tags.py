"""``{% load counters %}``: ``{% counter %}`` and ``{% counters %}`` rendered by Django's template
engine, against the blog's comment counters in Redis and the database, checked with SQL."""

from __future__ import annotations

import pytest
from django.db import connection
from django.template import Context, Template
from django.test.utils import CaptureQueriesContext

import counters
from counters.templatetags.counters import CounterValues, counters_tag
from tests.blog.models import Comment, Post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def render(source: str, **context) -> str:
    return Template("{% load counters %}" + source).render(Context(context))


def sql_truth(posts: list[Post]) -> list[int]:
    """Approved comments per post, counted by SQL."""
    table = connection.ops.quote_name(Comment._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT post_id, COUNT(*) FROM {table} WHERE approved GROUP BY post_id")
        found = dict(cursor.fetchall())
    return [found.get(p.pk, 0) for p in posts]


@pytest.fixture
def posts() -> list[Post]:
    """Four posts with 3, 1, 0 and 2 approved comments; half flushed, half still buffered."""
    posts = [Post.objects.create(title=t) for t in ("a", "b", "c", "d")]
    for post, approved in zip(posts, (2, 1, 0, 0), strict=True):
        for _ in range(approved):
            Comment.objects.create(post=post, approved=True)
    Comment.objects.create(post=posts[2], approved=False)
    counters.flush()
    Comment.objects.create(post=posts[0], approved=True)
    Comment.objects.create(post=posts[3], approved=True)
    Comment.objects.create(post=posts[3], approved=True)
    return posts


def test_counter_renders_the_exact_value_of_an_object_or_a_key(posts):
    assert sql_truth(posts) == [3, 1, 0, 2]
    for post, truth in zip(posts, sql_truth(posts), strict=True):
        assert render('{% counter "post_comments" post %}', post=post) == str(truth)
        assert render('{% counter "post_comments" post.pk %}', post=post) == str(truth)
        assert render('{% counter "post_comments" pk %}', pk=str(post.pk)) == str(truth)
    kept = '{% counter "post_comments" post as n %}{% if n > 2 %}many{% endif %}:{{ n }}'
    assert render(kept, post=posts[0]) == "many:3"


def test_counter_of_a_new_post_without_a_row_is_zero(posts):
    new = Post.objects.create(title="new")
    assert not hasattr(new, "poststats")  # no counter row until its first flush
    assert render('{% counter "post_comments" post %}', post=new) == "0"


def test_counters_reads_every_object_of_a_list_at_once(posts):
    source = (
        '{% counters "post_comments" posts as comments %}'
        "{% for post in posts %}{{ post.title }}={{ comments|get:post }}/"
        "{{ comments|get:post.pk }} {% endfor %}|"
        "{% for pk, n in comments.items %}{{ pk }}:{{ n }};{% endfor %}"
    )
    with CaptureQueriesContext(connection) as queries:
        html = render(source, posts=posts)
    truth = sql_truth(posts)
    titles = [p.title for p in posts]
    assert html == (
        " ".join(f"{t}={n}/{n}" for t, n in zip(titles, truth, strict=True))
        + " |"
        + "".join(f"{p.pk}:{n};" for p, n in zip(posts, truth, strict=True))
    )
    # One read: the rows of all four posts in one statement (and the backfill state once).
    reads = [q for q in queries if "blog_poststats" in q["sql"]]
    assert len(reads) == 1, [q["sql"] for q in queries]


def test_counters_of_a_queryset_and_of_keys(posts):
    values = render(
        '{% counters "post_comments" posts as c %}{{ c|length }}:{{ c|get:missing }}',
        posts=Post.objects.order_by("pk"),
        missing=10**9,
    )
    assert values == "4:None"
    mapping = counters_tag("post_comments", posts)
    assert isinstance(mapping, CounterValues)
    assert dict(mapping) == {p.pk: n for p, n in zip(posts, sql_truth(posts), strict=True)}
    assert posts[0] in mapping and posts[0].pk in mapping and 10**9 not in mapping
