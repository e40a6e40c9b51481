from django.apps import AppConfig
from django.db.models import Q


class BlogConfig(AppConfig):
    """A small app that counts its own rows with two ``counters.track()`` calls."""

    name = "tests.blog"
    label = "blog"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .models import Comment

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
