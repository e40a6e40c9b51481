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
