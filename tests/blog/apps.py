from django.apps import AppConfig
from django.db.models import Q


class BlogConfig(AppConfig):
    """A small app that counts its own rows with two ``counters.track()`` calls."""

    name = "tests.blog"
    label = "blog"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .models import Comment, HopComment, HopPost, RelComment

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
            "thread_author_comments",
            RelComment,
            key="thread__author",
            into="blog.RelAuthorStats.thread_comments",
            where=Q(approved=True),
        )
        counters.track(
            "post_published_comments",
            RelComment,
            key="post",
            into="blog.RelPostStats.published_comments",
            where=Q(approved=True, post__published=True),
        )
        # Related paths of several relations (tests/tracking/test_related_multihop.py)
        counters.track(
            "hop_owner_comments",
            HopComment,
            key="post__blog__owner",
            into="blog.HopOwnerStats.comments",
            where=Q(approved=True, post__published=True),
        )
        counters.track(
            "hop_founder_points",
            HopComment,
            key="post__blog__founder",
            into="blog.HopOwnerStats.points",
            where=Q(approved=True, post__blog__public=True),
            amount="points",
        )
        counters.track(
            "hop_blog_comments",
            HopComment,
            key="post__blog",
            into="blog.HopBlogStats.comments",
            where=Q(post__published=True),
        )
        counters.track(
            "hop_active_comments",
            HopComment,
            key="post__blog__owner",
            into="blog.HopOwnerStats.active_comments",
            where=Q(post__blog__owner__active=True),
        )
        counters.track(
            "hop_owner_posts",
            HopPost,
            key="blog__owner",
            into="blog.HopOwnerStats.posts",
            where=Q(published=True),
        )
