"""A process that commits counted changes with deferred acknowledgements, then ends at once.

Run as ``python -m tests.acks_writer --user 7 --notifications 3 --end exit`` with the
environment of :func:`tests.procs.project_env`: its pushes are written and their replies
unread when it ends (no reply is old enough for its acknowledging thread to read it):

- ``exit``: the interpreter exits normally (the exit hooks read the replies);
- ``os-exit``: ``os._exit()``, as a server's worker may end, skipping every hook;
- ``sigkill``: the process kills itself.

Written pushes are in the kernel's socket buffer, which outlives the process: each ends
with the changes in Redis once. It prints ``unread <n>`` once the changes are committed.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--user", type=int, required=True)
    parser.add_argument("--notifications", type=int, default=1)
    parser.add_argument("--end", choices=["exit", "os-exit", "sigkill"], required=True)
    args = parser.parse_args()

    import django

    django.setup()
    from counters.write import acks, replies
    from notifications.models import Notification

    replies.ACK_AFTER = 3600.0  # replies are left for the end to deal with
    for i in range(args.notifications):
        Notification.objects.create(recipient_id=args.user, verb=f"written {i}")
    unread = sum(len(line.waiting) for line in acks._lines())
    print(f"unread {unread}", flush=True)
    if args.end == "os-exit":
        os._exit(0)
    elif args.end == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
