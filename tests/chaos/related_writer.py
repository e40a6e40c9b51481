"""A chaos writer of the related-key counters: comments, and the posts and authors above them.

Run as ``python -m tests.chaos.related_writer --seconds 20 --seed 1 --hot 7 --keepers 1,2``
with the environment of :func:`tests.procs.project_env` and
``DJANGO_SETTINGS_MODULE=tests.settings`` (the test blog declares the counters
``author_comments`` keyed by ``post__author``, ``editor_points`` keyed by
``post__editor`` and ``post_published_comments`` under ``post__published``).

A random mix of every counted path of ``RelComment`` (create, bulk create,
approve and unapprove by ``save()``, ``update()`` and ``bulk_update()``,
points, moves to another post, stale saves, instance and queryset deletes,
rolled-back savepoints) and of the middle rows: a post's author, editor and
published flag changed by ``save()``, ``update()``, ``bulk_update()`` and a
related manager; posts created and deleted (their comments cascade); authors
created and deleted (``CASCADE`` on their posts, ``SET_NULL`` as editors).
The posts and authors are read from the database at each step, since every
writer creates and deletes them.

Invariants: the hot post (``--hot``) gets a large share of the comments and is
never deleted, and its author is always one of ``--keepers``, authors that are
never deleted; between the ``MIN_*`` and ``MAX_*`` bounds, posts and authors
come and go. It stops by itself after ``--seconds`` (or ``--max-ops``) and
prints one JSON line: operations per kind and errors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.exceptions import ObjectDoesNotExist  # noqa: E402
from django.db import DatabaseError, connection, transaction  # noqa: E402
from django.db.models import F  # noqa: E402

import counters  # noqa: E402
from tests.blog.models import RelAuthor, RelComment, RelPost  # noqa: E402

#: Relative weight of each operation: about two thirds change comments, a third the middle.
WEIGHTS = {
    "create": 16,
    "bulk_create": 3,
    "approve_save": 8,
    "approve_update": 6,
    "points": 4,
    "bulk_update": 2,
    "move": 3,
    "stale_save": 2,
    "delete": 6,
    "qs_delete": 3,
    "savepoint": 2,
    "post_save": 4,
    "publish_save": 3,
    "post_update": 3,
    "posts_of_author_update": 2,
    "hot_update": 3,
    "posts_bulk_update": 1,
    "related_manager": 1,
    "post_create": 2,
    "post_delete": 1,
    "posts_qs_delete": 1,
    "author_create": 1,
    "author_delete": 1,
    "read": 3,
}
HOT_SHARE = 0.3
MIN_POSTS, MAX_POSTS = 5, 16
MAX_AUTHORS = 10


class RolledBack(Exception):
    """Raised inside a savepoint on purpose."""


class Writer:
    def __init__(self, hot: int, keepers: list[int], seed: int) -> None:
        self.hot = hot
        self.keepers = keepers
        self.rnd = random.Random(seed)
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stale: list[RelComment] = []
        self.names = list(WEIGHTS)
        self.weights = list(WEIGHTS.values())

    # -- choices ----------------------------------------------------------------
    def posts(self) -> list[int]:
        return list(RelPost.objects.order_by("pk").values_list("pk", flat=True))

    def authors(self) -> list[int]:
        return list(RelAuthor.objects.order_by("pk").values_list("pk", flat=True))

    def post(self) -> int:
        """The hot post (HOT_SHARE of the time) or any post."""
        return self.hot if self.rnd.random() < HOT_SHARE else self.rnd.choice(self.posts())

    def cold_posts(self, k: int) -> list[int]:
        """Up to ``k`` posts other than the hot one."""
        posts = [p for p in self.posts() if p != self.hot]
        return self.rnd.sample(posts, k=min(k, len(posts)))

    def author(self) -> int:
        return self.rnd.choice(self.authors())

    def editor(self) -> int | None:
        return None if self.rnd.random() < 0.2 else self.author()

    def comments(self, limit: int = 3) -> list[int]:
        ids = list(
            RelComment.objects.filter(post_id=self.post())
            .order_by("-pk")
            .values_list("pk", flat=True)[:20]
        )
        return self.rnd.sample(ids, k=min(limit, len(ids)))

    def comment(self) -> RelComment | None:
        found = RelComment.objects.filter(pk__in=self.comments(1)).first()
        if found is not None and len(self.stale) < 20:
            self.stale.append(RelComment(pk=found.pk, post_id=found.post_id, points=found.points))
        return found

    # -- the comments -----------------------------------------------------------
    def thread(self) -> int | None:
        """A post for a comment's nullable ``CASCADE`` thread, or None."""
        return self.post() if self.rnd.random() < 0.7 else None

    def create(self) -> None:
        RelComment.objects.create(
            post_id=self.post(),
            thread_id=self.thread(),
            approved=self.rnd.random() < 0.6,
            points=self.rnd.randint(-2, 9),
        )

    def bulk_create(self) -> None:
        RelComment.objects.bulk_create(
            [
                RelComment(
                    post_id=self.post(),
                    thread_id=self.thread(),
                    approved=self.rnd.random() < 0.7,
                    points=i,
                )
                for i in range(3)
            ]
        )

    def approve_save(self) -> None:
        if c := self.comment():
            c.approved = not c.approved
            c.save()

    def approve_update(self) -> None:
        RelComment.objects.filter(pk__in=self.comments()).update(approved=self.rnd.random() < 0.5)

    def points(self) -> None:
        if self.rnd.random() < 0.5:
            RelComment.objects.filter(pk__in=self.comments()).update(
                points=F("points") + self.rnd.randint(-3, 3)
            )
        elif c := self.comment():
            c.points = self.rnd.randint(-2, 9)
            c.save(update_fields=["points"])

    def bulk_update(self) -> None:
        some = list(RelComment.objects.filter(pk__in=self.comments(4)))
        for c in some:
            c.approved = not c.approved
            c.points += 1
        RelComment.objects.bulk_update(some, ["approved", "points"])

    def move(self) -> None:
        if self.rnd.random() < 0.5:
            RelComment.objects.filter(pk__in=self.comments(2)).update(
                post_id=self.post(), thread_id=self.thread()
            )
        elif c := self.comment():
            c.post_id = self.post()
            c.approved = True
            c.save()

    def stale_save(self) -> None:
        """Save an old copy: it inserts the row again if another writer deleted it."""
        if not self.stale:
            self.comment()
            return
        c = self.stale.pop(self.rnd.randrange(len(self.stale)))
        c.approved = self.rnd.random() < 0.5
        c.save()

    def delete(self) -> None:
        if c := self.comment():
            c.delete()

    def qs_delete(self) -> None:
        RelComment.objects.filter(pk__in=self.comments(self.rnd.randint(1, 5))).delete()

    def savepoint(self) -> None:
        with transaction.atomic():
            RelComment.objects.create(post_id=self.post(), approved=True)
            try:
                with transaction.atomic():
                    RelComment.objects.create(post_id=self.hot, approved=True, points=5)
                    RelPost.objects.filter(pk=self.hot).update(published=True)
                    raise RolledBack
            except RolledBack:
                pass
            RelComment.objects.filter(pk__in=self.comments()).update(approved=True)

    # -- the posts and authors above them ---------------------------------------
    def post_save(self) -> None:
        """``post.author = other; post.save()`` (the hot post's author: a keeper)."""
        post = RelPost.objects.get(pk=self.post())
        hot = post.pk == self.hot
        post.author_id = self.rnd.choice(self.keepers) if hot else self.author()
        if self.rnd.random() < 0.5:
            post.editor_id = self.editor()
        post.save()

    def publish_save(self) -> None:
        post = RelPost.objects.get(pk=self.post())
        post.published = not post.published
        post.save(update_fields=["published"])

    def post_update(self) -> None:
        RelPost.objects.filter(pk__in=self.cold_posts(3)).update(
            author=self.author(), published=self.rnd.random() < 0.6
        )

    def posts_of_author_update(self) -> None:
        changes = {"author_id": self.author()}
        if self.rnd.random() < 0.5:
            changes = {"editor_id": self.editor()}
        RelPost.objects.filter(author_id=self.author()).exclude(pk=self.hot).update(**changes)

    def hot_update(self) -> None:
        RelPost.objects.filter(pk=self.hot).update(
            author_id=self.rnd.choice(self.keepers),
            editor_id=self.editor(),
            published=self.rnd.random() < 0.7,
        )

    def posts_bulk_update(self) -> None:
        posts = list(RelPost.objects.filter(pk__in=self.cold_posts(3)))
        for post in posts:
            post.author_id, post.editor_id = self.author(), self.editor()
            post.published = not post.published
        RelPost.objects.bulk_update(posts, ["author", "editor", "published"])

    def related_manager(self) -> None:
        RelAuthor.objects.get(pk=self.author()).rel_posts.update(published=self.rnd.random() < 0.5)

    def post_create(self) -> None:
        if len(self.posts()) < MAX_POSTS:
            RelPost.objects.create(
                author_id=self.author(), editor_id=self.editor(), published=self.rnd.random() < 0.6
            )

    def post_delete(self) -> None:
        """One post and its comments (``CASCADE``)."""
        if len(self.posts()) > MIN_POSTS and (pks := self.cold_posts(1)):
            RelPost.objects.get(pk=pks[0]).delete()

    def posts_qs_delete(self) -> None:
        if len(self.posts()) > MIN_POSTS + 2:
            RelPost.objects.filter(pk__in=self.cold_posts(2)).delete()

    def author_create(self) -> None:
        if len(self.authors()) < MAX_AUTHORS:
            RelAuthor.objects.create(name=f"w{self.rnd.randrange(10**6)}")

    def author_delete(self) -> None:
        """``CASCADE`` on the author's posts and their comments, ``SET_NULL`` as an editor."""
        others = [a for a in self.authors() if a not in self.keepers]
        if others:
            RelAuthor.objects.get(pk=self.rnd.choice(others)).delete()

    def read(self) -> None:
        counters.get_values("author_comments", self.authors())
        counters.get_value("post_published_comments", self.hot)

    # -- loop -------------------------------------------------------------------
    def step(self) -> None:
        name = self.rnd.choices(self.names, self.weights)[0]
        try:
            getattr(self, name)()
            self.ops[name] += 1
        except ObjectDoesNotExist:
            self.errors["vanished"] += 1  # another writer deleted the row first
        except DatabaseError as exc:  # a deadlock, a post deleted under a comment written
            first = (str(exc).strip().splitlines() or [""])[0][:60]
            self.errors[f"{type(exc).__name__}: {first}"] += 1
            connection.close_if_unusable_or_obsolete()

    def run(self, seconds: float, max_ops: int, pause: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.ops.total() < max_ops:
            self.step()
            if pause:
                time.sleep(pause)


def parse_ids(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-ops", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hot", type=int, required=True, help="the hot post's id")
    parser.add_argument("--keepers", required=True, help="comma-separated author ids")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between operations")
    parser.add_argument("--name", default="writer")
    args = parser.parse_args(argv)
    keepers = parse_ids(args.keepers)
    if not keepers:
        parser.error("--keepers: at least one author id")
    writer = Writer(args.hot, keepers, args.seed)
    started = time.monotonic()
    writer.run(args.seconds, args.max_ops, args.pause)
    report = {
        "writer": args.name,
        "ops": dict(writer.ops),
        "total": writer.ops.total(),
        "errors": dict(writer.errors),
        "seconds": round(time.monotonic() - started, 3),
    }
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
