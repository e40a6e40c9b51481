"""A process that commits counted changes with the per-process sender on, then ends.

Run as ``python -m tests.sender_writer --user 7 --notifications 3 --end exit``
with the environment of :func:`tests.procs.project_env` and a long
``COUNTERS_SEND_DELAY_MS``, so the deltas are still queued when it ends:

- ``exit``: the interpreter exits normally (``atexit`` pushes the queue);
- ``multiprocessing``: the changes are made in a ``multiprocessing`` child,
  forked, which ends with ``os._exit()`` after its finalizers (no ``atexit``);
- ``fork``: the parent queues the changes, then forks a child that exits
  normally; only the parent may push them;
- ``sigkill``: the process kills itself with the deltas queued (they are lost
  until the audit repairs them);
- ``linger``: the process stays alive for ``--linger`` seconds, so its sender's
  thread pushes the queue once the delay is over, then exits.

It prints ``queued <n>`` once the changes are committed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def create(user: int, count: int) -> None:
    import django

    django.setup()
    from counters.write import sender
    from notifications.models import Notification

    for i in range(count):
        Notification.objects.create(recipient_id=user, verb=f"queued {i}")
    queued = sender._senders["default"].queued([f"unread:{user}"])
    print(f"queued {sum(queued.values())}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--user", type=int, required=True)
    parser.add_argument("--notifications", type=int, default=1)
    parser.add_argument("--end", choices=["exit", "multiprocessing", "fork", "sigkill", "linger"])
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    if args.end == "multiprocessing":
        child = multiprocessing.get_context("fork").Process(
            target=create, args=(args.user, args.notifications)
        )
        child.start()
        child.join()
        sys.exit(child.exitcode)
    create(args.user, args.notifications)
    if args.end == "fork":
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # atexit runs here: it must not push the parent's queue
        os.waitpid(pid, 0)
    elif args.end == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.end == "linger":
        time.sleep(args.linger)


if __name__ == "__main__":
    main()
