"""Measure the continuous audit on a large table: seconds per run, and one sweep's duration.

Builds (once) a PostgreSQL database with ``--users`` users, ``--per-user``
notifications each (half of them unread) and their exact ``UnreadCounter``
rows, then times ``--runs`` audit runs of the ``unread`` counter with the
default ``COUNTERS_AUDIT_SLICE``, started from cursor positions spread over
the whole key range. A sweep takes ``users / slice`` runs, one every
``COUNTERS_AUDIT_INTERVAL`` seconds (a run longer than the interval makes the
next beat send find the lease taken, so it waits for the following one)::

    python scripts/audit_sweep.py --users 1000000

The Redis buffer is a database and prefix of its own (``--redis-url``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--per-user", type=int, default=4, help="notifications per user")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--database", default="tally_audit_sweep")
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    args = parser.parse_args()

    import psycopg

    with psycopg.connect(f"{args.postgres}/postgres", autocommit=True) as admin:
        exists = admin.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [args.database]
        ).fetchone()
        if not exists:
            admin.execute(f'CREATE DATABASE "{args.database}"')

    os.environ["DATABASE_URL"] = f"{args.postgres}/{args.database}"
    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    import counters
    from counters.models import AuditCursor
    from notifications.apps import UNREAD_COUNTER

    call_command("migrate", verbosity=0)
    counters.get_buffer().client.flushdb()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM auth_user")
        have = cur.fetchone()[0]
        if have != args.users:
            started = time.monotonic()
            print(f"building {args.users:,} users x {args.per_user} notifications ...", flush=True)
            cur.execute(
                "TRUNCATE notifications_unreadcounter, notifications_notification, auth_user"
                " CASCADE"
            )
            cur.execute(
                "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name,"
                " email, is_staff, is_active, date_joined)"
                " SELECT '!', false, 'u' || g, '', '', '', false, true, now()"
                " FROM generate_series(1, %s) g",
                [args.users],
            )
            cur.execute(
                "INSERT INTO notifications_notification"
                " (recipient_id, verb, description, created_at, is_read)"
                " SELECT u.id, 'x', '', now(), (n %% 2 = 0) FROM auth_user u,"
                " generate_series(1, %s) n",
                [args.per_user],
            )
            cur.execute(
                "INSERT INTO notifications_unreadcounter (user_id, count)"
                " SELECT recipient_id, count(*) FROM notifications_notification"
                " WHERE NOT is_read GROUP BY recipient_id"
            )
            cur.execute("VACUUM ANALYZE")
            print(f"built in {time.monotonic() - started:.0f}s", flush=True)
        cur.execute("SELECT min(id), max(id) FROM auth_user")
        low, high = cur.fetchone()

    status = io.StringIO()
    call_command("counters_status", "--json", stdout=status)  # the audit settings in effect
    schedule = json.loads(status.getvalue())["audit"]
    slice_size, interval = schedule["slice"], schedule["interval"]
    seconds: list[float] = []
    for i in range(args.runs):
        after = low + (high - low) * i // args.runs
        AuditCursor.objects.update_or_create(
            counter=UNREAD_COUNTER, defaults={"after": str(after), "checked": 0}
        )
        started = time.monotonic()
        result = counters.audit(names=[UNREAD_COUNTER])
        seconds.append(time.monotonic() - started)
        if result.checked != slice_size or result.repaired:
            print(f"run {i}: checked {result.checked}, repaired {result.repaired}", file=sys.stderr)
            return 1
    seconds.sort()
    median = statistics.median(seconds)
    p95 = seconds[min(len(seconds) - 1, math.ceil(0.95 * len(seconds)) - 1)]
    runs = math.ceil(args.users / slice_size)
    period = interval * max(1, math.ceil(p95 / interval))
    sweep = runs * period
    print(
        f"{args.users:,} users, {args.users * args.per_user:,} notifications; "
        f"COUNTERS_AUDIT_SLICE={slice_size}, COUNTERS_AUDIT_INTERVAL={interval}s"
    )
    print(
        f"one run ({slice_size} keys): median {median * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
        f"max {seconds[-1] * 1000:.0f} ms over {len(seconds)} runs"
    )
    print(
        f"one sweep: {runs:,} runs, one every {period}s: {sweep / 3600:.2f} h "
        f"({sweep // 3600:.0f} h {sweep % 3600 // 60:.0f} min); "
        f"database time {runs * median / 60:.1f} min"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
