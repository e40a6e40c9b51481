"""What a SIGKILL costs in each write mode: writers killed under load, their loss measured.

:data:`WRITERS` writer processes (:mod:`tests.chaos.commit_writer`) commit one unread
notification after another, each for a user of its own, on PostgreSQL and Redis. Each is
killed with SIGKILL at a random moment while all of them write. Once the killed writers'
backends are gone and the flush ran, and before any audit or rebuild, a writer lost
``COUNT(*)`` of its user's unread rows (the truth) minus the counter's exact read (the row,
pending and in-flight deltas): commits that are in the database and nowhere in the count.

Each mode's bound, as docs/operations.md states it, is asserted; then the audit repairs
every loss to the truth. ``-s`` prints each mode's figures: commits lost per killed writer,
and how long before the kill the oldest lost commit was made.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import pytest
from django.db import connection

import counters
from counters.models import Outbox
from notifications.models import Notification
from tests.helpers import assert_exact, truth
from tests.procs import ROOT, project_env

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="waits for the killed writers' backends in pg_stat_activity: PostgreSQL only",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
]

#: Writer processes killed in each mode.
WRITERS = 4
#: Seconds between two kills (uniform): each writer dies after some 0.1 to 1.6 s of writing.
KILL_GAP = (0.1, 0.4)
#: ``COUNTERS_SEND_DELAY_MS`` of the default mode (the per-process sender), its default.
SEND_DELAY_MS = 200
#: ``COUNTERS_OUTBOX_GRACE`` of durable mode: the flush pushes rows older than that.
GRACE = 0.5
#: The sender mode's lost commits must all be younger than the delay plus this (seconds):
#: the time the sender's thread may take to wake up and push on a busy machine.
SENDER_SLACK = 1.0


@dataclass(frozen=True)
class Mode:
    env: dict[str, str]
    tx: str  # how a writer commits: "atomic" or "autocommit"
    #: Most commits one killed writer may lose; None: the sender's bound, in time.
    most_lost: int | None


MODES = {
    # Commits queued in the process, pushed once the oldest waited the delay.
    "default": Mode({}, "atomic", None),
    # One push after each COMMIT: lost if killed between the COMMIT and the push.
    "per-commit": Mode({"COUNTERS_SEND_DELAY_MS": "0"}, "atomic", 1),
    # The outbox row commits with the change: the flush pushes what the writer could not.
    "durable": Mode({"COUNTERS_DURABLE": "1"}, "atomic", 0),
    # The outbox row is a statement of its own after the change's commit.
    "durable-autocommit": Mode({"COUNTERS_DURABLE": "1"}, "autocommit", 1),
}


@dataclass
class Writer:
    user: int
    proc: subprocess.Popen
    killed_at: datetime | None = None


@dataclass
class Loss:
    """What one killed writer committed, and lost."""

    commits: int
    lost: int
    behind: int  # truth minus the count right after the kill, before any flush
    #: Milliseconds from the oldest lost commit to the kill; None when nothing was lost.
    oldest_ms: float | None
    rate: float  # commits per second of this writer


@dataclass
class Figures:
    mode: str
    losses: list[Loss] = field(default_factory=list)

    def line(self) -> str:
        commits = sum(loss.commits for loss in self.losses)
        lost = [loss.lost for loss in self.losses]
        ages = ", ".join("-" if x.oldest_ms is None else f"{x.oldest_ms:.1f}" for x in self.losses)
        rate = sum(loss.rate for loss in self.losses) / len(self.losses)
        return (
            f"kill cost {self.mode}: {len(self.losses)} writers killed after {commits} commits "
            f"({rate:.0f}/s a writer); behind before the flush {[x.behind for x in self.losses]}; "
            f"lost after it {lost} (total {sum(lost)}); oldest lost commit [{ages}] ms "
            "before its kill"
        )


def start(users: list[int], mode: Mode, app: str) -> list[Writer]:
    env = project_env(application_name=app, COUNTERS_OUTBOX_GRACE=str(GRACE), **mode.env)
    return [
        Writer(
            user,
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.chaos.commit_writer", "--user", str(user)),
                    *("--tx", mode.tx, "--seconds", "60"),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for user in users
    ]


def kill_under_load(writers: list[Writer], rnd: random.Random) -> None:
    """Once every writer has committed, kill them one by one at random moments."""
    for w in writers:
        assert w.proc.stdout is not None
        line = w.proc.stdout.readline()
        assert line == "ready\n", (line, w.proc.stderr.read() if w.proc.stderr else "")
    for w in rnd.sample(writers, len(writers)):
        time.sleep(rnd.uniform(*KILL_GAP))
        w.killed_at = datetime.now().astimezone()
        os.kill(w.proc.pid, signal.SIGKILL)
    for w in writers:
        _, err = w.proc.communicate(timeout=30)
        assert w.proc.returncode == -signal.SIGKILL, err


def backends_gone(app: str, timeout: float = 30) -> None:
    """Wait until no backend of a killed writer is left: what it committed is final."""
    deadline = time.monotonic() + timeout
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [app]
            )
            if cursor.fetchone()[0] == 0:
                return
        assert time.monotonic() < deadline, f"backends of {app} still there after {timeout}s"
        time.sleep(0.05)


def loss_of(writer: Writer, behind: int) -> Loss:
    """The writer's commits and loss now: ``COUNT(*)`` minus the exact read. Its lost commits
    are its last ones (one writer per user, one commit after another)."""
    commits = truth(writer.user)
    lost = commits - counters.get_value("unread", writer.user)
    times = Notification.objects.filter(recipient_id=writer.user).order_by("pk")
    first = times.values_list("created_at", flat=True).first()
    last = times.values_list("created_at", flat=True).last()
    assert first is not None and last is not None and writer.killed_at is not None
    rate = commits / max((last - first).total_seconds(), 1e-3)
    oldest_ms = None
    if lost > 0:
        oldest = times.reverse().values_list("created_at", flat=True)[lost - 1]
        oldest_ms = (writer.killed_at - oldest).total_seconds() * 1000
    return Loss(commits, lost, behind, oldest_ms, rate)


def caught_up() -> None:
    """The flush, run until it has drained every outbox row (durable mode): the first may
    find them within the grace, or more than one flush takes."""
    time.sleep(GRACE + 0.2)
    for _ in range(20):
        counters.flush()
        if not Outbox.objects.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{Outbox.objects.count()} outbox rows left after 20 flushes")


def repair_all(figures: Figures, users: list[int]) -> None:
    """One sweep of the audit repairs every lost commit; then every count is the truth."""
    results: list = []
    while not (results and all(c.sweep_done for c in results[-1].counters)):
        assert len(results) < 10, "the audit did not finish a sweep"
        results.append(counters.audit(names=["unread"], confirm_delay=0.2))
    assert sum(r.repaired for r in results) == sum(1 for x in figures.losses if x.lost)
    assert [truth(u) - counters.get_value("unread", u) for u in users] == [0] * len(users)


@pytest.mark.parametrize("name", list(MODES))
def test_a_sigkill_costs_what_the_docs_say(name, make_user, settings, capsys):
    mode = MODES[name]
    settings.COUNTERS_OUTBOX_GRACE = GRACE  # the flush of this process pushes older rows
    users = [make_user() for _ in range(WRITERS)]
    app = f"tally-killcost-{os.getpid()}"
    rnd = random.Random()
    writers = start([u.pk for u in users], mode, app)
    try:
        kill_under_load(writers, rnd)
    finally:
        for w in writers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.communicate(timeout=30)  # its pipes closed
    backends_gone(app)
    behind = [truth(w.user) - counters.get_value("unread", w.user) for w in writers]
    caught_up()
    figures = Figures(name, [loss_of(w, b) for w, b in zip(writers, behind, strict=True)])
    with capsys.disabled():
        print(f"\n{figures.line()}")

    # Never counted twice, and the bound of the mode.
    assert all(x.lost >= 0 for x in figures.losses), figures.line()
    if mode.most_lost is not None:
        assert all(x.lost <= mode.most_lost for x in figures.losses), figures.line()
    else:
        # The queue of the sender: lost, and nothing older than its delay (and slack).
        assert sum(x.lost for x in figures.losses) > 0, figures.line()
        most_ms = SEND_DELAY_MS + SENDER_SLACK * 1000
        assert all((x.oldest_ms or 0) <= most_ms for x in figures.losses), figures.line()
    repair_all(figures, [u.pk for u in users])
    assert_exact(*users)
