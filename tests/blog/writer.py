"""A blog writer process: a random mix of counted comment changes for a bounded time.

Run as ``python -m tests.blog.writer --seconds 6 --seed 1 --posts 3,4,5`` with
the environment of :func:`tests.procs.project_env` and
``DJANGO_SETTINGS_MODULE=tests.settings`` (the blog app is installed there).
Prints one JSON line: operations per kind and errors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.db import DatabaseError, connection, transaction  # noqa: E402
from django.db.models import F  # noqa: E402

from tests.blog.models import Comment  # noqa: E402


class RolledBack(Exception):
    """Raised inside a savepoint on purpose."""


class Writer:
    def __init__(self, posts: list[int], seed: int) -> None:
        self.posts = posts
        self.rnd = random.Random(seed)
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.kinds = [
            self.create,
            self.create,
            self.approve,
            self.points,
            self.move,
            self.stale_save,
            self.delete,
            self.bulk,
            self.savepoint,
        ]

    def post(self) -> int:
        return self.rnd.choice(self.posts)

    def some(self, limit: int = 3) -> list[int]:
        ids = list(
            Comment.objects.filter(post_id=self.post())
            .order_by("-pk")
            .values_list("pk", flat=True)[:20]
        )
        return self.rnd.sample(ids, k=min(limit, len(ids)))

    def create(self) -> None:
        Comment.objects.create(
            post_id=self.post(), approved=self.rnd.random() < 0.6, points=self.rnd.randint(-2, 9)
        )

    def approve(self) -> None:
        Comment.objects.filter(pk__in=self.some()).update(approved=self.rnd.random() < 0.5)

    def points(self) -> None:
        Comment.objects.filter(pk__in=self.some()).update(points=F("points") * 2 - 1)

    def move(self) -> None:
        Comment.objects.filter(pk__in=self.some(1)).update(post_id=self.post())

    def stale_save(self) -> None:
        for c in Comment.objects.filter(pk__in=self.some(1)):
            Comment.objects.filter(pk=c.pk).update(approved=not c.approved)
            c.points += 1
            c.save()  # inserts the row again if another writer deleted it

    def delete(self) -> None:
        if self.rnd.random() < 0.5:
            Comment.objects.filter(pk__in=self.some(2)).delete()
        else:
            for c in Comment.objects.filter(pk__in=self.some(1)):
                c.delete()

    def bulk(self) -> None:
        Comment.objects.bulk_create(
            [Comment(post_id=self.post(), approved=True, points=3) for _ in range(3)]
        )

    def savepoint(self) -> None:
        with transaction.atomic():
            Comment.objects.create(post_id=self.post(), approved=True, points=2)
            try:
                with transaction.atomic():
                    Comment.objects.filter(pk__in=self.some()).update(approved=False)
                    raise RolledBack
            except RolledBack:
                pass

    def run(self, seconds: float, pause: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            op = self.rnd.choice(self.kinds)
            try:
                op()
                self.ops[op.__name__] += 1
            except DatabaseError as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:60]
                self.errors[f"{type(exc).__name__}: {first}"] += 1
                connection.close_if_unusable_or_obsolete()
            time.sleep(pause)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--posts", required=True, help="comma-separated post ids")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between operations")
    args = parser.parse_args()
    writer = Writer([int(p) for p in args.posts.split(",") if p], args.seed)
    writer.run(args.seconds, args.pause)
    print(json.dumps({"ops": dict(writer.ops), "errors": dict(writer.errors)}))
    connection.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
