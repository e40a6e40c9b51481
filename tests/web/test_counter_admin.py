"""``counters.admin.CounterAdmin`` on the blog's ``PostStats`` (two counters in one model), and
the admin page of every counter's state: rendered by the admin, checked against SQL."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

import counters
from counters.models import AuditRepair
from tests.blog.admin import PostStatsAdmin
from tests.blog.models import Comment, Post, PostStats

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

STATS = "/admin/blog/poststats/"
OVERVIEW = "/admin/counters/counterstate/"
PARTS = ("stored", "pending", "exact", "truth")


@pytest.fixture
def staff(make_member, logged_in):
    return logged_in(make_member("root", is_staff=True, is_superuser=True))


def column(html: str, name: str) -> list[str]:
    return re.findall(rf'<td class="field-{name}[^"]*">(.*?)</td>', html, re.S)


def sql(query: str) -> dict[int, int]:
    with connection.cursor() as cursor:
        cursor.execute(query)
        return {pk: int(n) for pk, n in cursor.fetchall()}


def truth() -> dict[str, dict[int, int]]:
    """Approved comments and their points per post, by SQL."""
    where = "FROM blog_comment WHERE approved GROUP BY post_id"
    return {
        "comments": sql(f"SELECT post_id, COUNT(*) {where}"),
        "points": sql(f"SELECT post_id, SUM(points) {where}"),
    }


def stored() -> dict[str, dict[int, int]]:
    return {
        "comments": sql("SELECT post_id, comments FROM blog_poststats"),
        "points": sql("SELECT post_id, points FROM blog_poststats"),
    }


def corrupt(post: Post, comments: int) -> None:
    """A stored value changed behind Tally's back, as raw SQL would."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE blog_poststats SET comments = %s WHERE post_id = %s", [comments, post.pk]
        )


@pytest.fixture
def posts() -> list[Post]:
    """Three posts with counter rows (flushed), then more comments still buffered."""
    posts = [Post.objects.create(title=t) for t in ("a", "b", "c")]
    for post, n in zip(posts, (3, 1, 2), strict=True):
        for i in range(n):
            Comment.objects.create(post=post, approved=True, points=i + 1)
    counters.flush()
    Comment.objects.create(post=posts[0], approved=True, points=5)
    Comment.objects.create(post=posts[2], approved=False, points=9)
    Comment.objects.filter(post=posts[1]).update(approved=False)
    return posts


def test_changelist_shows_each_counter_field_against_sql(staff, posts):
    html = staff.get(STATS, {"o": "1"}).content.decode()  # ordered by post
    pks = [p.pk for p in posts]
    sql_truth, sql_stored = truth(), stored()
    for field in ("comments", "points"):
        assert f"<span>{field.title()} pending (buffered)</span>" in html
        values = {part: column(html, f"{field}_{part}") for part in PARTS}
        assert values["stored"] == [str(sql_stored[field][pk]) for pk in pks]
        assert values["truth"] == [str(sql_truth[field].get(pk, 0)) for pk in pks]
        assert values["exact"] == values["truth"]  # stored + buffered is exact
        pairs = zip(values["stored"], values["pending"], strict=True)
        assert [str(int(s) + int(p)) for s, p in pairs] == values["exact"]
        assert all('alt="True"' in c for c in column(html, f"{field}_in_sync"))
    assert column(html, "comments_pending") == ["1", "-1", "0"]
    assert staff.get(f"{STATS}add/").status_code == 403
    assert 'value="delete_selected"' not in html and 'value="rebuild_selected"' in html


def test_the_truth_is_counted_for_the_page_shown_only(staff, posts, monkeypatch):
    monkeypatch.setattr(PostStatsAdmin, "list_per_page", 2)
    with CaptureQueriesContext(connection) as queries:
        html = staff.get(STATS, {"o": "1"}).content.decode()
    assert len(column(html, "comments_truth")) == 2
    counts = [q["sql"] for q in queries if "blog_comment" in q["sql"]]
    assert len(counts) == 2, counts  # one per counter field
    for query in counts:
        [keys] = re.findall(r"IN \(([^)]*)\)", query)
        assert sorted(int(k) for k in keys.split(",")) == [posts[0].pk, posts[1].pk]


def test_detail_page_and_filters(staff, posts):
    detail = staff.get(f"{STATS}{posts[0].pk}/change/").content.decode()
    for field in ("comments", "points"):
        value = truth()[field][posts[0].pk]
        assert re.search(
            rf"{field} truth \(SQL\):</label>\s*<div class=\"readonly\">{value}</div>",
            detail,
            re.I,
        )
    corrupt(posts[2], -7)
    html = staff.get(STATS, {"comments_sign": "neg"}).content.decode()
    assert column(html, "comments_stored") == ["-7"]
    assert 'alt="False"' in column(html, "comments_in_sync")[0]
    zero = staff.get(STATS, {"comments_sign": "zero"}).content.decode()
    assert column(zero, "comments_stored") == []
    assert "comments (stored)" in html  # the filter's title


def test_rebuild_selected_repairs_the_rows_through_the_delta_path(staff, posts):
    corrupt(posts[0], 40)
    corrupt(posts[1], -3)
    response = staff.post(
        STATS,
        {"action": "rebuild_selected", "_selected_action": [p.pk for p in posts]},
        follow=True,
    )
    page = response.content.decode()
    assert "6 counters checked; 2 repaired (" in page  # 3 rows, 2 counters each
    # exact before (stored + buffered) → truth: a has 1 comment buffered, b -1
    assert f"post_comments {posts[0].pk}: 41 → 4" in page
    assert f"post_comments {posts[1].pk}: -4 → 0" in page
    exact = counters.get_values("post_comments", [p.pk for p in posts])
    assert exact == {p.pk: truth()["comments"].get(p.pk, 0) for p in posts}
    counters.flush()
    assert stored() == {
        field: {p.pk: truth()[field].get(p.pk, 0) for p in posts}
        for field in ("comments", "points")
    }
    again = staff.post(
        STATS, {"action": "rebuild_selected", "_selected_action": [posts[0].pk]}, follow=True
    )
    assert "2 counters checked; all were exact." in again.content.decode()


def test_overview_lists_every_counter_with_its_state(staff, posts):
    index = staff.get("/admin/").content.decode()
    assert f'href="{OVERVIEW}"' in index
    AuditRepair.objects.create(
        counter="post_comments", key=str(posts[0].pk), stored=9, buffered=1, truth=4
    )
    html = staff.get(OVERVIEW).content.decode()
    rows = dict(re.findall(r'<tr class="counter-([\w.-]+)">(.*?)</tr>', html, re.S))
    assert set(rows) == {s.name for s in counters.base.registry.all_specs()}

    def cell(name: str, part: str) -> str:
        return re.search(rf'<td class="{part}">(.*?)</td>', rows[name], re.S)[1].strip()

    assert cell("post_comments", "stored_in") == "blog.PostStats.comments"
    assert cell("post_comments", "rows") == str(PostStats.objects.count()) == "3"
    # posts a and b have pending comment deltas (c's new comment is not approved)
    assert cell("post_comments", "pending") == "2"
    assert cell("post_points", "pending") == "2"
    assert cell("post_comments", "inflight") == cell("post_comments", "quarantined") == "0"
    assert float(cell("post_comments", "lag")) > 0
    assert cell("post_comments", "backfilling") == "no"
    assert cell("post_comments", "repairs").startswith(f"1<br>{posts[0].pk}: 10 &rarr; 4 (")
    assert "by Celery beat" in html
    counters.flush()
    html = staff.get(OVERVIEW).content.decode()
    rows = dict(re.findall(r'<tr class="counter-([\w.-]+)">(.*?)</tr>', html, re.S))
    assert cell("post_comments", "pending") == "0" and cell("post_comments", "lag") == "0.0"
