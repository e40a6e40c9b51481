"""A process that toggles users' unread counts: +1, then -1, again and again.

Run as ``python -m tests.toggle_writer --users 7,8 --seconds 6 --seed 1`` with
the environment of :func:`tests.procs.project_env` and the per-process sender
on (``COUNTERS_SEND_DELAY_MS``): each step picks one of the users at random and
creates a notification for them, or marks read the one it created for them
before, one commit each, with a short random pause after, so each key's value
in Redis keeps coming back to the same numbers while some of its deltas wait
in the sender's queue. At the end every notification it created is read. It
prints one JSON line: the commits made.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", required=True, help="comma-separated user ids")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause-ms", type=float, default=20.0, help="most a pause lasts")
    args = parser.parse_args()

    import django

    django.setup()
    from notifications.models import Notification

    rnd = random.Random(args.seed)
    users = [int(u) for u in args.users.split(",")]
    unread: dict[int, Notification] = {}
    commits = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        user = rnd.choice(users)
        note = unread.pop(user, None)
        if note is None:
            unread[user] = Notification.objects.create(recipient_id=user, verb="toggle")
        else:
            note.mark_read()
        commits += 1
        time.sleep(rnd.uniform(0, args.pause_ms) / 1000)
    for note in unread.values():
        note.mark_read()
    print(json.dumps({"commits": commits}), flush=True)


if __name__ == "__main__":
    main()
