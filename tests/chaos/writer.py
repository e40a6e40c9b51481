"""A chaos writer process: a random mix of counted notification changes for a bounded time.

Run as ``python -m tests.chaos.writer --seconds 20 --seed 1 --users 3,4,5 --hot 2``
with the environment of :func:`tests.procs.project_env`. Every path that can
change unread state is used, over many users and one hot user that gets a
large share of the traffic. It stops by itself after ``--seconds`` (or
``--max-ops``) and prints one JSON line: operations per kind and errors.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from collections import Counter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

from django.core.exceptions import ObjectDoesNotExist  # noqa: E402
from django.db import DatabaseError, connection, transaction  # noqa: E402

from notifications.models import Notification, UnreadCounter  # noqa: E402

#: Relative weight of each operation.
WEIGHTS = {
    "create": 20,
    "create_read": 2,
    "notify": 2,
    "mark_read": 18,
    "mark_unread": 8,
    "mark_all_read": 4,
    "mark_all_unread": 2,
    "qs_update": 5,
    "move": 3,
    "stale_save": 5,
    "delete": 12,
    "qs_delete": 4,
    "savepoint": 2,
    "read": 4,
}
HOT_SHARE = 0.3


class RolledBack(Exception):
    """Raised inside a savepoint on purpose."""


class Writer:
    def __init__(self, users: list[int], hot: int, seed: int) -> None:
        self.users = users
        self.hot = hot
        self.rnd = random.Random(seed)
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stale: list[Notification] = []
        self.names = list(WEIGHTS)
        self.weights = list(WEIGHTS.values())

    def user(self) -> int:
        return self.hot if self.rnd.random() < HOT_SHARE else self.rnd.choice(self.users)

    def ids(self, uid: int, is_read: bool | None = None, limit: int = 30) -> list[int]:
        qs = Notification.objects.filter(recipient_id=uid)
        if is_read is not None:
            qs = qs.filter(is_read=is_read)
        return list(qs.order_by("-pk").values_list("pk", flat=True)[:limit])

    def one(self, uid: int, is_read: bool | None = None) -> Notification | None:
        ids = self.ids(uid, is_read)
        if not ids:
            return None
        n = Notification.objects.filter(pk=self.rnd.choice(ids)).first()
        if n is not None and len(self.stale) < 20:
            self.stale.append(copy.copy(n))  # saved much later as a stale instance
        return n

    # -- operations -----------------------------------------------------------
    def create(self, uid: int) -> None:
        Notification.objects.create(recipient_id=uid, verb="chaos")

    def create_read(self, uid: int) -> None:
        Notification.objects.create(recipient_id=uid, verb="chaos read", is_read=True)

    def notify(self, uid: int) -> None:
        users = {uid, self.hot, *self.rnd.sample(self.users, 4)}
        Notification.objects.notify(sorted(users), verb="fan-out", batch_size=3)

    def mark_read(self, uid: int) -> None:
        if n := self.one(uid, is_read=False):
            n.mark_read()

    def mark_unread(self, uid: int) -> None:
        if n := self.one(uid, is_read=True):
            n.mark_unread()

    def mark_all_read(self, uid: int) -> None:
        Notification.objects.filter(recipient_id=uid).mark_all_read()

    def mark_all_unread(self, uid: int) -> None:
        ids = self.ids(uid, is_read=True, limit=5)
        Notification.objects.filter(pk__in=ids).mark_all_unread()

    def qs_update(self, uid: int) -> None:
        ids = self.ids(uid)
        ids = self.rnd.sample(ids, k=min(3, len(ids)))
        Notification.objects.filter(pk__in=ids).update(is_read=self.rnd.random() < 0.5)

    def move(self, uid: int) -> None:
        if n := self.one(uid):
            Notification.objects.filter(pk=n.pk).update(recipient_id=self.user())

    def stale_save(self, uid: int) -> None:
        if not self.stale:
            self.one(uid)
            return
        n = self.stale.pop(self.rnd.randrange(len(self.stale)))
        n.is_read = not n.is_read
        if self.rnd.random() < 0.5:
            n.save()  # inserts the row again if another writer deleted it
            return
        try:
            n.save(update_fields=["is_read"])
        except DatabaseError as exc:
            if "did not affect any rows" not in str(exc):
                raise
            self.ops["stale_save_of_deleted_row"] += 1

    def delete(self, uid: int) -> None:
        if n := self.one(uid):
            n.delete()

    def qs_delete(self, uid: int) -> None:
        ids = self.ids(uid)
        Notification.objects.filter(pk__in=ids[: self.rnd.randint(1, 8)]).delete()

    def savepoint(self, uid: int) -> None:
        with transaction.atomic():
            Notification.objects.create(recipient_id=uid, verb="kept")
            try:
                with transaction.atomic():
                    Notification.objects.create(recipient_id=self.hot, verb="rolled back")
                    Notification.objects.filter(recipient_id=uid).mark_all_read()
                    raise RolledBack
            except RolledBack:
                pass
            if n := self.one(uid, is_read=False):
                n.mark_read()

    def read(self, uid: int) -> None:
        UnreadCounter.objects.get_count(uid)

    # -- loop -----------------------------------------------------------------
    def step(self) -> None:
        name = self.rnd.choices(self.names, self.weights)[0]
        try:
            getattr(self, name)(self.user())
            self.ops[name] += 1
        except ObjectDoesNotExist:
            self.errors["vanished"] += 1  # another writer deleted the row first
        except DatabaseError as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:60]
            self.errors[f"{type(exc).__name__}: {first}"] += 1
            connection.close_if_unusable_or_obsolete()

    def run(self, seconds: float, max_ops: int, pause: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.ops.total() < max_ops:
            self.step()
            if pause:
                time.sleep(pause)


def parse_users(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-ops", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--users", required=True, help="comma-separated user ids")
    parser.add_argument("--hot", type=int, required=True)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between operations")
    parser.add_argument("--name", default="writer")
    args = parser.parse_args(argv)
    writer = Writer(parse_users(args.users), args.hot, args.seed)
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
