"""Notes under posts under blogs, every kind of ``on_delete`` between a note and its post.

``Note`` has one foreign key to ``Post`` per deletion route (``hard``: ``CASCADE``, not
null; ``post``: ``CASCADE``, null; ``loose``: ``SET_NULL``; ``dflt``: ``SET_DEFAULT``;
``kept``: ``SET()``; ``guard``: ``PROTECT``; ``rule``: ``RESTRICT``): a test sets the
one it counts through and leaves the others to ``None`` (``hard`` to a post never deleted).
``Post.blog`` is a nullable ``CASCADE`` too, so Django orders none of these deletes.
"""

from __future__ import annotations

from django.db import models

import counters


class Person(models.Model):
    code = models.CharField(max_length=20, unique=True)

    def __str__(self) -> str:
        return self.code


class PersonStats(models.Model):
    """Counters per person (by primary key): one column per counter of a test."""

    person = models.OneToOneField(Person, primary_key=True, on_delete=models.CASCADE)
    n = models.BigIntegerField(default=0)
    m = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


class CodeStats(models.Model):
    """Counters per person code: a natural key, kept in tombstones while the person is gone."""

    person = models.OneToOneField(
        Person, to_field="code", primary_key=True, on_delete=models.CASCADE
    )
    n = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


class PairStats(models.Model):
    """A composite counter per (writer, post), in fields of the team's own names."""

    who = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="+")
    on = models.ForeignKey("Post", on_delete=models.CASCADE, related_name="+")
    n = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["who", "on"], name="deletes_pair_unique")]

    def __str__(self) -> str:
        return str(self.pk)


class TwoWayStats(models.Model):
    """Two unique constraints that could each store a (writer, post) key: ambiguous."""

    a = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="+")
    b = models.ForeignKey("Post", on_delete=models.CASCADE, related_name="+")
    c = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="+")
    d = models.ForeignKey("Post", on_delete=models.CASCADE, related_name="+")
    n = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["a", "b"], name="deletes_two_ab"),
            models.UniqueConstraint(fields=["c", "d"], name="deletes_two_cd"),
        ]

    def __str__(self) -> str:
        return str(self.pk)


class Blog(models.Model):
    owner = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="blogs")

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class Post(models.Model):
    author = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="posts")
    blog = models.ForeignKey(Blog, null=True, on_delete=models.CASCADE, related_name="posts")
    published = models.BooleanField(default=True)
    anchor = models.BooleanField(default=False)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


def anchor_post() -> int | None:
    """The post that ``SET_DEFAULT`` and ``SET()`` move notes to (never deleted)."""
    return Post.objects.filter(anchor=True).values_list("pk", flat=True).first()


def _fk(on_delete, name: str, **kwargs) -> models.ForeignKey:
    return models.ForeignKey(
        Post, null=True, blank=True, on_delete=on_delete, related_name=name, **kwargs
    )


class Note(models.Model):
    writer = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="notes")
    hard = models.ForeignKey(Post, on_delete=models.CASCADE, related_name="hard_notes")
    post = _fk(models.CASCADE, "notes")
    loose = _fk(models.SET_NULL, "loose_notes")
    dflt = _fk(models.SET_DEFAULT, "dflt_notes", default=anchor_post)
    kept = _fk(models.SET(anchor_post), "kept_notes")
    guard = _fk(models.PROTECT, "guard_notes")
    rule = _fk(models.RESTRICT, "rule_notes")
    tags: models.ManyToManyField = models.ManyToManyField(
        "Tag", through="Tagging", related_name="notes"
    )

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class Tag(models.Model):
    owner = models.ForeignKey(Person, on_delete=models.CASCADE, related_name="tags")

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class Tagging(models.Model):
    """The through model of ``Note.tags``, counted per owner of the tag."""

    note = models.ForeignKey(Note, on_delete=models.CASCADE)
    tag = models.ForeignKey(Tag, on_delete=models.CASCADE)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)


class Shelf(models.Model):
    """A parent keyed by a natural key, deleted and created again."""

    code = models.CharField(max_length=20, unique=True)

    def __str__(self) -> str:
        return self.code


class ShelfStats(models.Model):
    shelf = models.OneToOneField(Shelf, to_field="code", primary_key=True, on_delete=models.CASCADE)
    n = models.BigIntegerField(default=0)
    m = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return str(self.pk)


class Book(models.Model):
    shelf = models.ForeignKey(Shelf, to_field="code", null=True, on_delete=models.CASCADE)
    placed = models.BooleanField(default=True)

    objects = counters.CountedManager()

    def __str__(self) -> str:
        return str(self.pk)
