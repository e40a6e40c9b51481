from django.apps import AppConfig
from django.db.models import Q


class BlogConfig(AppConfig):
    """A small app that counts its own rows with two ``counters.track()`` calls."""

    name = "tests.blog"
    label = "blog"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .models import Comment, RelComment

        counters.track(
            "post_comments",
            Comment,
            key="post",
            into="blog.PostStats.comments",
            where=Q(approved=True),
        )
        counters.track(
            "post_points",
            Comment,
            key="post",
            into="blog.PostStats.points",
            where=Q(approved=True),
            amount="points",
        )
        # Related keys and conditions (tests/tracking/test_related_*.py)
        counters.track(
            "author_comments",
            RelComment,
            key="post__author",
            into="blog.RelAuthorStats.comments",
            where=Q(approved=True),
        )
        counters.track(
            "editor_points",
            RelComment,
            key="post__editor",
            into="blog.RelAuthorStats.points",
            where=Q(approved=True, post__published=True),
            amount="points",
        )
        counters.track(
            "post_published_comments",
            RelComment,
            key="post",
            into="blog.RelPostStats.published_comments",
            where=Q(approved=True, post__published=True),
        )
