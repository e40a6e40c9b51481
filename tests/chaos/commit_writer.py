"""A writer process that commits counted notifications for one user until it is killed.

Run as ``python -m tests.chaos.commit_writer --user 7 --tx atomic`` with the environment of
:func:`tests.procs.project_env`. Every commit creates one unread notification for ``--user``:
in ``transaction.atomic()`` (``--tx atomic``), or as a statement that commits by itself
(``--tx autocommit``). It prints ``ready`` once its first commit returned, then writes as
fast as it can. It is meant to die by SIGKILL; after ``--seconds`` it exits with status 3,
so that a test that failed before killing it leaves no process behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

from django.db import transaction  # noqa: E402

from notifications.models import Notification  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--user", type=int, required=True)
    parser.add_argument("--tx", choices=["atomic", "autocommit"], required=True)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()

    def commit() -> None:
        if args.tx == "atomic":
            with transaction.atomic():
                Notification.objects.create(recipient_id=args.user, verb="until killed")
        else:
            Notification.objects.create(recipient_id=args.user, verb="until killed")

    commit()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        commit()
    return 3


if __name__ == "__main__":
    sys.exit(main())
