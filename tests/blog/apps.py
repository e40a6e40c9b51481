from django.apps import AppConfig
from django.db.models import Q


class BlogConfig(AppConfig):
    """A small app that counts its own rows with two ``counters.track()`` calls."""

    name = "tests.blog"
    label = "blog"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .models import Comment, RouteBase, RouteChild, RouteEntry

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
        for name, model, key, where in (
            ("route_entries", RouteEntry, "owner", None),
            ("route_kept", RouteEntry, "keeper", None),
            ("route_backed", RouteEntry, "backup", None),
            ("route_edited", RouteEntry, "owner", Q(editor__isnull=False)),
            ("route_base_flagged", RouteBase, "owner", Q(flag=True)),
            ("route_child_flagged", RouteChild, "owner", Q(flag=True)),
        ):
            column = name.removeprefix("route_")
            counters.track(name, model, key=key, into=f"blog.RouteStats.{column}", where=where)
