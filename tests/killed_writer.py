"""A writer process that dies by SIGKILL right after the COMMIT of one counted change.

Run as ``python -m tests.killed_writer --user 7 --at on_commit`` with the
environment of :func:`tests.procs.project_env`. It creates one unread
notification for the user in ``transaction.atomic()`` and kills itself:

- ``--at on_commit``: an ``on_commit`` callback registered before the counted
  change sends SIGKILL, so the process dies right after the COMMIT, in
  Django's commit hooks;
- ``--at push``: the Redis push of the committed deltas sends SIGKILL before
  anything is written to Redis (a fault injected by wrapping ``Buffer.push``
  and, for deferred acknowledgements, ``Line.send``), so the process dies
  between the COMMIT and the push;
- ``--at pushed``: the push reaches Redis, then the process dies before it
  returns (durable mode: before the outbox row is deleted; deferred: once
  its reply is read).

It never exits normally: a return code other than -9 means it did not get
that far.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

from django.db import transaction  # noqa: E402

from counters.buffer.line import Line  # noqa: E402
from counters.buffer.store import Buffer  # noqa: E402
from notifications.models import Notification  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_push(self: Buffer, *args: Any, **kwargs: Any) -> Any:
    die()


_real_push = Buffer.push
_real_send = Line.send


def kill_after_push(self: Buffer, *args: Any, **kwargs: Any) -> Any:
    _real_push(self, *args, **kwargs)
    die()


def kill_after_send(self: Line, *args: Any, **kwargs: Any) -> Any:
    _real_send(self, *args, **kwargs)
    self.receive()  # the push reached Redis
    die()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--user", type=int, required=True)
    parser.add_argument("--at", choices=["on_commit", "push", "pushed"], required=True)
    args = parser.parse_args()
    if args.at == "push":
        Buffer.push = kill_in_push  # type: ignore[method-assign]
        Line.send = kill_in_push  # type: ignore[method-assign, assignment]
    elif args.at == "pushed":
        Buffer.push = kill_after_push  # type: ignore[method-assign]
        Line.send = kill_after_send  # type: ignore[method-assign]
    with transaction.atomic():
        if args.at == "on_commit":
            transaction.on_commit(die)
        Notification.objects.create(recipient_id=args.user, verb="killed after commit")
    raise SystemExit("still alive after the commit")


if __name__ == "__main__":
    main()
