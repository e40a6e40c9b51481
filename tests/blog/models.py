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
