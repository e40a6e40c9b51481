"""The blog of the counters app's tests: comments per post and their points, tracked."""

from __future__ import annotations

from django.db import models

import counters


class Post(models.Model):
    title = models.CharField(max_length=200, default="")

    def __str__(self) -> str:
        return self.title


class PostStats(models.Model):
    post = models.OneToOneField(Post, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)
    points = models.BigIntegerField(default=0)
    thread_comments = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.comments} comments, {self.points} points"


class Comment(models.Model):
    post = models.ForeignKey(Post, on_delete=models.CASCADE)
    approved = models.BooleanField(default=False)
    points = models.IntegerField(default=1)
    text = models.CharField(max_length=200, default="")
    rating = models.IntegerField(null=True, blank=True)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return self.text


# Models of the declaration tests: what track() must count exactly, or refuse.


class DeclTally(models.Model):
    """Counter rows keyed by post with free columns, for declarations made in tests."""

    post = models.OneToOneField(Post, primary_key=True, on_delete=models.CASCADE)
    votes = models.BigIntegerField(default=0)
    first = models.BigIntegerField(default=0)
    second = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


class DeclStamped(models.Model):
    """Counter rows with columns Django fills on save: the flush must fill them too."""

    post = models.OneToOneField(Post, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)
    day = models.DateField(auto_now_add=True)

    def __str__(self) -> str:
        return str(self.pk)


class DeclStrict(models.Model):
    """Counter rows with a NOT NULL column and no default: the flush cannot create them."""

    post = models.OneToOneField(Post, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)
    label = models.CharField(max_length=20)

    def __str__(self) -> str:
        return str(self.pk)


class DeclShelf(models.Model):
    """A parent keyed by a natural key, which can be deleted and created again."""

    code = models.CharField(max_length=20, unique=True)

    def __str__(self) -> str:
        return str(self.pk)


class DeclShelfStats(models.Model):
    shelf = models.OneToOneField(
        DeclShelf, to_field="code", primary_key=True, on_delete=models.CASCADE
    )
    books = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


class DeclBook(models.Model):
    shelf = models.ForeignKey(DeclShelf, to_field="code", on_delete=models.CASCADE)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class DeclGenerated(models.Model):
    post = models.ForeignKey(Post, on_delete=models.CASCADE)
    points = models.IntegerField(default=1)
    doubled = models.GeneratedField(
        expression=models.F("points") * 2, output_field=models.IntegerField(), db_persist=True
    )

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class DeclPair(models.Model):
    pk = models.CompositePrimaryKey("post", "slot")
    post = models.ForeignKey(Post, on_delete=models.CASCADE)
    slot = models.IntegerField()

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class DeclPairStats(models.Model):
    pk = models.CompositePrimaryKey("post", "slot")
    post = models.OneToOneField(Post, on_delete=models.CASCADE)
    slot = models.IntegerField(default=0)
    comments = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


# -- the routes test: every way Django changes rows of a tracked model ------------------


class RouteOwner(models.Model):
    name = models.CharField(max_length=50, default="")

    def __str__(self) -> str:
        return self.name


def route_sentinel() -> RouteOwner:
    """The owner ``RouteEntry.keeper`` falls back to when its owner is deleted (``SET()``)."""
    return RouteOwner.objects.get_or_create(name="sentinel")[0]


def route_sentinel_pk() -> int:
    """The default of ``RouteEntry.backup`` (``SET_DEFAULT``): the sentinel's key."""
    return route_sentinel().pk


class RouteStats(models.Model):
    """One row per owner: a column per ``route_*`` counter."""

    owner = models.OneToOneField(RouteOwner, primary_key=True, on_delete=models.CASCADE)
    entries = models.BigIntegerField(default=0)
    kept = models.BigIntegerField(default=0)
    backed = models.BigIntegerField(default=0)
    edited = models.BigIntegerField(default=0)
    base_flagged = models.BigIntegerField(default=0)
    child_flagged = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}"


class RouteEntry(models.Model):
    """Counted per owner, keeper, backup; and per owner while it has an editor."""

    owner = models.ForeignKey(
        RouteOwner, on_delete=models.SET_NULL, null=True, blank=True, related_name="entries"
    )
    keeper = models.ForeignKey(
        RouteOwner, on_delete=models.SET(route_sentinel), null=True, blank=True, related_name="kept"
    )
    backup = models.ForeignKey(
        RouteOwner,
        on_delete=models.SET_DEFAULT,
        null=True,
        blank=True,
        default=route_sentinel_pk,
        related_name="backed",
    )
    editor = models.ForeignKey(
        RouteOwner, on_delete=models.SET_NULL, null=True, blank=True, related_name="edited"
    )

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"entry {self.pk}"


class RouteEntryProxy(RouteEntry):
    """A proxy with the counted manager it inherits."""

    class Meta:
        proxy = True


class RouteBase(models.Model):
    """A multi-table parent counted per owner while flagged; ``RouteChild`` is counted too."""

    owner = models.ForeignKey(
        RouteOwner, on_delete=models.CASCADE, null=True, blank=True, related_name="bases"
    )
    flag = models.BooleanField(default=False)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"base {self.pk}"


class RouteChild(RouteBase):
    extra = models.IntegerField(default=0)


# Models of the related-key tests: comments counted per author (and editor) of their post.


class RelAuthor(models.Model):
    name = models.CharField(max_length=50, default="")

    def __str__(self) -> str:
        return self.name


class RelAuthorStats(models.Model):
    author = models.OneToOneField(RelAuthor, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)
    points = models.BigIntegerField(default=0)
    thread_comments = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.comments} comments, {self.points} points"


class RelPost(models.Model):
    """A middle model: its author, editor and published flag decide its comments' counters."""

    author = models.ForeignKey(RelAuthor, on_delete=models.CASCADE, related_name="rel_posts")
    editor = models.ForeignKey(
        RelAuthor, on_delete=models.SET_NULL, null=True, blank=True, related_name="rel_edited"
    )
    published = models.BooleanField(default=False)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"post {self.pk}"


class RelPostStats(models.Model):
    post = models.OneToOneField(RelPost, primary_key=True, on_delete=models.CASCADE)
    published_comments = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.published_comments}"


class RelComment(models.Model):
    post = models.ForeignKey(RelPost, on_delete=models.CASCADE, related_name="comments")
    #: A nullable ``CASCADE`` middle: Django does not order its deletes.
    thread = models.ForeignKey(
        RelPost, on_delete=models.CASCADE, null=True, blank=True, related_name="thread_comments"
    )
    approved = models.BooleanField(default=False)
    points = models.IntegerField(default=1)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"comment {self.pk}"


class RelLoosePost(models.Model):
    """A middle model whose default manager is not counted: paths through it are refused."""

    author = models.ForeignKey(RelAuthor, on_delete=models.CASCADE, related_name="loose_posts")

    def __str__(self) -> str:
        return f"loose post {self.pk}"


class RelLooseComment(models.Model):
    post = models.ForeignKey(RelLoosePost, on_delete=models.CASCADE)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"loose comment {self.pk}"


class RelVote(models.Model):
    """Counted, below ``DeclGenerated``: a related path to its generated column is refused."""

    target = models.ForeignKey(DeclGenerated, on_delete=models.CASCADE)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"vote {self.pk}"


# -- many-to-many: memberships per group (auth's own through), per club (an explicit through) --


class GroupStats(models.Model):
    """One row per ``auth.Group``: its count of members (rows of ``User.groups.through``)."""

    group = models.OneToOneField("auth.Group", primary_key=True, on_delete=models.CASCADE)
    members = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.members} members"


class Club(models.Model):
    name = models.CharField(max_length=50, default="")
    posts = models.ManyToManyField(Post, through="Membership", related_name="clubs")

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """The explicit through of ``Club.posts``, a counted model."""

    club = models.ForeignKey(Club, on_delete=models.CASCADE)
    post = models.ForeignKey(Post, on_delete=models.CASCADE)

    objects = counters.CountedManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["club", "post"], name="blog_membership_club_post")
        ]

    def __str__(self) -> str:
        return f"{self.club_id}:{self.post_id}"


class ClubStats(models.Model):
    club = models.OneToOneField(Club, primary_key=True, on_delete=models.CASCADE)
    members = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.members} members"


# -- related paths of several relations: comments per owner of their post's blog ------------


class HopOwner(models.Model):
    """The end of the paths, and counted itself: ``post__blog__owner__active`` reads it."""

    name = models.CharField(max_length=50, default="")
    active = models.BooleanField(default=True)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return self.name


class HopOwnerStats(models.Model):
    owner = models.OneToOneField(HopOwner, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)
    points = models.BigIntegerField(default=0)
    active_comments = models.BigIntegerField(default=0)
    posts = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.comments} comments, {self.points} points"


class HopBlog(models.Model):
    """In the middle at depth 2: its owner (``SET_NULL``), founder (``CASCADE``) and public
    flag decide the counters of the comments of its posts."""

    owner = models.ForeignKey(
        HopOwner, on_delete=models.SET_NULL, null=True, blank=True, related_name="owned_blogs"
    )
    founder = models.ForeignKey(HopOwner, on_delete=models.CASCADE, related_name="founded_blogs")
    public = models.BooleanField(default=True)
    archive = models.ForeignKey(
        "HopArchive", on_delete=models.SET_NULL, null=True, blank=True, related_name="blogs"
    )

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"blog {self.pk}"


class HopBlogStats(models.Model):
    blog = models.OneToOneField(HopBlog, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.pk}: {self.comments}"


class HopArchive(models.Model):
    """Not counted: a path through it (``post__archive__owner``) is refused; a path may end
    at it (``post__blog__archive``)."""

    owner = models.ForeignKey(HopOwner, on_delete=models.CASCADE, related_name="archives")

    def __str__(self) -> str:
        return f"archive {self.pk}"


class HopPost(models.Model):
    """In the middle at depth 1 (and counted itself per owner of its blog)."""

    blog = models.ForeignKey(HopBlog, on_delete=models.CASCADE, related_name="posts")
    published = models.BooleanField(default=False)
    parent = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="children"
    )
    archive = models.ForeignKey(HopArchive, on_delete=models.SET_NULL, null=True, blank=True)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"post {self.pk}"


class HopComment(models.Model):
    post = models.ForeignKey(HopPost, on_delete=models.CASCADE, related_name="comments")
    approved = models.BooleanField(default=False)
    points = models.IntegerField(default=1)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return f"comment {self.pk}"
