"""With the per-process sender on, a difference is repaired only after a quiet window.

A hot key toggled (+1, -1) by writers whose deltas wait in their senders'
queues comes back to the same values in Redis and in the truth again and
again, while some delta is always on its way: equal readings prove nothing.
The audit and the rebuild must never repair it, and must still repair a key
that was corrupted and is quiet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from django.db import connection

import counters
from counters.models import AuditRepair
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, truth
from tests.procs import ROOT, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

DELAY_MS = 50
SOCKET_TIMEOUT = 0.1
WRITERS = 3
WRITE_SECONDS = 8.0
#: Keys the writers toggle: each is a chance for a wrong confirmation in every reading.
HOT_KEYS = 6


@pytest.fixture
def sender_on(settings):
    settings.COUNTERS_SEND_DELAY_MS = DELAY_MS
    settings.COUNTERS_SOCKET_TIMEOUT = SOCKET_TIMEOUT


def toggle_writers(users) -> list[subprocess.Popen]:
    env = project_env(
        COUNTERS_SEND_DELAY_MS=str(DELAY_MS), COUNTERS_SOCKET_TIMEOUT=str(SOCKET_TIMEOUT)
    )
    return [
        subprocess.Popen(
            [
                *(
                    sys.executable,
                    "-m",
                    "tests.toggle_writer",
                    "--users",
                    ",".join(str(u.pk) for u in users),
                ),
                *("--seconds", str(WRITE_SECONDS), "--seed", str(seed)),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(WRITERS)
    ]


@pytest.mark.serial
@pytest.mark.parametrize("check", ["rebuild", "audit"])
def test_a_hot_key_toggled_through_the_senders_is_never_repaired(sender_on, make_user, check):
    hot = [make_user() for _ in range(HOT_KEYS)]
    calm = make_user()
    for user in (*hot, *hot, calm):
        Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    keys = [u.pk for u in (*hot, calm)]
    writers = toggle_writers(hot)
    runs = []
    try:
        time.sleep(1.0)  # the writers are up and writing
        while all(w.poll() is None for w in writers):
            if check == "rebuild":
                report = rebuild("unread", keys=keys, confirm_delay=0.05)
                runs.append((report.repaired, report.wrong, report.unstable))
            else:
                result = audit(names=["unread"], confirm_delay=0.05)
                runs.append((result.repaired, result.as_dict(), None))
    finally:
        outputs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0] * WRITERS, outputs
    assert all(json.loads(out)["commits"] > 20 for out, _ in outputs), outputs
    assert len(runs) >= 2
    assert [r[0] for r in runs] == [0] * len(runs), runs
    assert AuditRepair.objects.count() == 0
    assert_exact(*hot, calm)
    assert [truth(u) for u in (*hot, calm)] == [2] * HOT_KEYS + [1]


@pytest.mark.parametrize("check", ["rebuild", "audit"])
def test_raw_sql_corruption_of_a_quiet_key_is_repaired_with_the_sender_on(
    sender_on, make_user, check
):
    users = [make_user() for _ in range(3)]
    for user in users:
        for _ in range(2):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    table = connection.ops.quote_name(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET count = count + 5 WHERE user_id = %s", [users[1].pk])
    assert UnreadCounter.objects.get_count(users[1]) == truth(users[1]) + 5
    if check == "rebuild":
        report = rebuild("unread", keys=[u.pk for u in users], confirm_delay=0.05)
        assert (report.repaired, report.unstable) == (1, [])
        assert [(d.key, d.error) for d in report.wrong] == [(users[1].pk, 5)]
    else:
        result = audit(names=["unread"], confirm_delay=0.05)
        assert result.repaired == 1, result.as_dict()
        repairs = [(r.key, r.delta) for r in AuditRepair.objects.all()]
        assert repairs == [(str(users[1].pk), -5)]
    assert_exact(*users)
