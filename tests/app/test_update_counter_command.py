"""`manage.py notification_update_counter`: one line, honest exit codes, and kill -9 safety."""

from __future__ import annotations

import json
import signal
import time

import pytest
from django.db import connection, transaction

from counters.client import get_buffer
from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.conftest import has_row_locks
from tests.helpers import assert_exact, stored, truth
from tests.procs import manage, project_env, run_manage

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend", "per_commit"),  # a command in another process
]


def test_flush_command_prints_one_summary_line_and_exits_zero(make_user):
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
        Notification.objects.create(recipient=user, verb="v")
    code, out, err = run_manage("notification_update_counter")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("flushed ")
    assert ", 3 keys, 6 deltas in " in lines[0]
    assert [stored(u) for u in users] == [truth(u) for u in users] == [2, 2, 2]


def test_flush_command_json_output(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    code, out, err = run_manage("notification_update_counter", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["keys"], data["deltas"], data["incomplete"]) == (1, 1, False)
    assert stored(alice) == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            # no sentinels either: nothing answers, whatever the backend of the test
            {"COUNTERS_REDIS_URL": "redis://127.0.0.1:1/0", "COUNTERS_REDIS_SENTINELS": ""},
            "Redis unreachable",
            id="redis",
        ),
        pytest.param(
            {"DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere"},
            "database error",
            id="database",
        ),
    ],
)
def test_flush_command_fails_with_one_readable_line(env, expected):
    code, _, err = run_manage("notification_update_counter", env=project_env(**env))
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert expected in lines[0]
    assert "Traceback" not in err


def test_bad_argument_exits_non_zero_with_one_line():
    code, _, err = run_manage("notification_update_counter", "--time-budget", "-1")
    assert code != 0
    assert err.strip().splitlines() == ["CommandError: --time-budget must be greater than 0"]


@pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections")
def test_flusher_killed_inside_its_transaction_loses_nothing(make_user):
    """SIGKILL a real flusher while it waits on a counter row inside its DB transaction."""
    alice, bob = make_user(), make_user()
    for _ in range(3):
        Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=bob, verb="v")
    import counters

    counters.flush()  # rows exist now, so the next flush updates them
    ledger_before = FlushBatch.objects.count()
    Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=bob, verb="v")

    with transaction.atomic():
        # hold alice's row so the flusher blocks in its UPDATE, after the move and
        # after its ledger insert, inside its transaction
        list(UnreadCounter.objects.select_for_update().filter(user=alice))
        # A lane waiting for its turn does not renew its lease: long enough to outlast the
        # steps below on a loaded machine, short enough to wait for.
        proc = manage("notification_update_counter", env=project_env(COUNTERS_LEASE_TIMEOUT="5"))
        deadline = time.monotonic() + 20
        while not get_buffer().inflight_ids():
            assert time.monotonic() < deadline, "the flusher never moved a batch"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    connection.close()
    buffer = get_buffer()
    # Alice's batch stays in flight; so may bob's, moved by the other lane of the flush
    # (COUNTERS_FLUSH_LANES) while it waited for its turn to apply.
    inflight = buffer.inflight_ids()
    assert buffer.shard_of(f"unread:{alice.pk}") in inflight
    assert 1 <= len(inflight) <= 2
    assert not FlushBatch.objects.filter(pk__in=inflight.values()).exists()
    assert FlushBatch.objects.count() - ledger_before in (0, 1)  # bob's shard may be done
    assert_exact(alice, bob, flush=False)
    shards = sorted(inflight)
    assert sorted(counters.flush().busy_shards) == shards  # the dead flusher's leases hold
    while any(buffer.client.exists(buffer.key(shard, "lease")) for shard in shards):
        assert time.monotonic() < deadline + 10, "the dead flusher's lease never expired"
        time.sleep(0.1)
    assert counters.flush().recovered == len(shards)
    assert_exact(alice, bob)
    assert (stored(alice), stored(bob)) == (4, 2)
