"""Ground truth, assertions and racing threads shared by the tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import OperationalError, connection

import counters
from notifications.models import Notification, UnreadCounter


def deadlocked(exc: BaseException) -> bool:
    """``exc`` is the database breaking a deadlock: its transaction rolled back.

    InnoDB (error 1213) and PostgreSQL (SQLSTATE 40P01) pick a victim among
    transactions that wait on each other. On MySQL and MariaDB an UPDATE or a
    ``FOR UPDATE`` reached through a secondary index (``mark_all_read()``)
    and a DELETE by primary key (``delete()``) of one of its rows lock the two
    index entries in opposite orders, counted or not. The victim counts
    nothing and can be retried.
    """
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__ or exc
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)  # psycopg 3 or 2
    return code == "40P01" or (bool(exc.args) and exc.args[0] == 1213)


def truth(user) -> int:
    """COUNT(*) of the user's unread notifications: the ground truth."""
    return Notification.objects.filter(recipient=user, is_read=False).count()


def stored(user) -> int:
    row = UnreadCounter.objects.filter(user=user).values_list("count", flat=True).first()
    return row or 0


def assert_exact(*users, flush: bool = True) -> None:
    """get_count equals the truth now; after a flush the stored rows equal it too."""
    for user in users:
        assert (user.pk, UnreadCounter.objects.get_count(user)) == (user.pk, truth(user))
    if flush:
        counters.flush()
        for user in users:
            assert (user.pk, stored(user)) == (user.pk, truth(user))
            assert (user.pk, UnreadCounter.objects.get_count(user)) == (user.pk, truth(user))


#: A Redis URL nothing answers at.
UNREACHABLE = "redis://127.0.0.1:1/0"


def cut_redis(settings, timeout: float = 0.2) -> dict[str, Any]:
    """Point the buffer at a Redis that does not answer, whatever the test's backend (one
    server, cluster nodes, or sentinels). Returns the settings as they were, for
    :func:`restore_redis`."""
    from counters.base import conf

    saved = {
        "COUNTERS_REDIS_URL": conf.redis_url(),
        "COUNTERS_REDIS_SENTINELS": conf.redis_sentinels(),
        "COUNTERS_SOCKET_TIMEOUT": conf.socket_timeout(),
    }
    settings.COUNTERS_REDIS_URL = UNREACHABLE
    if saved["COUNTERS_REDIS_SENTINELS"]:
        settings.COUNTERS_REDIS_SENTINELS = ["127.0.0.1:1"]
    settings.COUNTERS_SOCKET_TIMEOUT = timeout
    return saved


def restore_redis(settings, saved: dict[str, Any]) -> None:
    """The settings :func:`cut_redis` changed, back as they were (and the buffer with them)."""
    for name, value in saved.items():
        setattr(settings, name, value)


def in_redis(user) -> int:
    """Pending plus in-flight deltas of the user's unread counter in Redis."""
    from counters.client import get_buffer

    member = f"unread:{user.pk}"
    snap = get_buffer().snapshot([member])
    return snap.pending[member] + snap.inflight[member]


def race(count: int, target: Callable[[int, threading.Barrier], Any], timeout: float = 120) -> list:
    """Run ``target(i, barrier)`` for i in 0..count-1, each in a thread with its own connection.

    ``barrier`` (of ``count`` parties) lets the threads start each step at the same
    instant; it is aborted when a thread fails, so the others stop waiting. Returns the
    results in order; asserts that no thread raised.
    """
    barrier = threading.Barrier(count)
    results: list = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(i, barrier)
        except BaseException as exc:  # pragma: no cover - reported by the assertion
            errors.append(exc)
            barrier.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert [repr(e) for e in errors] == []
    return results


def backend_pid() -> int:
    """The server's id of this thread's connection (PostgreSQL, MySQL/MariaDB)."""
    sql = "SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]


def lock_poll() -> float:
    """Seconds between two calls of :func:`waits_on_lock`: InnoDB refreshes what
    ``information_schema.INNODB_TRX`` shows only when it was not read for 0.1 s."""
    return 0.15 if connection.vendor == "mysql" else 0.01


def waits_on_lock(pid: int) -> bool:
    """Whether the session ``pid`` (:func:`backend_pid`) is waiting on a row lock now
    (call it every :func:`lock_poll` seconds)."""
    if connection.vendor == "mysql":
        sql = "SELECT trx_state = 'LOCK WAIT' FROM information_schema.INNODB_TRX "
        sql += "WHERE trx_mysql_thread_id = %s"
    else:
        sql = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
    with connection.cursor() as cursor:
        cursor.execute(sql, [pid])
        row = cursor.fetchone()
    return bool(row and row[0])


#: Seconds any step of a race may take before the test gives up.
WAIT = 20


class Worker(threading.Thread):
    """Runs ``target`` on a DB connection of its own; keeps its result or error.

    With ``pause_on``, it stops right after its first statement whose SQL
    contains that text, until :meth:`resume`.
    """

    def __init__(self, target: Callable[[], Any], *, pause_on: str | None = None) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.pause_on = pause_on
        self.started_sql = threading.Event()
        self.paused = threading.Event()
        self.resumed = threading.Event()
        self.pid: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def _pause(self, execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if self.pause_on in sql and not self.paused.is_set():
            self.paused.set()
            self.resumed.wait(WAIT)
        return result

    def run(self) -> None:
        try:
            self.pid = backend_pid()
            self.started_sql.set()
            hook = connection.execute_wrapper(self._pause) if self.pause_on else None
            with hook or contextlib.nullcontext():
                self.result = self.target()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_sql.set()
            self.paused.set()
            connection.close()

    def wait_paused(self) -> None:
        assert self.paused.wait(WAIT) and self.is_alive() and self.error is None, self.error

    def resume(self) -> None:
        self.resumed.set()

    def finish(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "worker still running"
        if self.error is not None:
            raise self.error
        return self.result

    def wait_blocked_or_done(self) -> None:
        """Until this worker waits on a row lock, or has finished."""
        assert self.started_sql.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while self.is_alive():
            if waits_on_lock(self.pid):
                return
            assert time.monotonic() < deadline, "worker neither blocked nor finished"
            time.sleep(lock_poll())


@contextlib.contextmanager
def after_first(text: str, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` right after this connection's first statement containing ``text``."""
    done = threading.Event()

    def hook(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if text in sql and not done.is_set():
            done.set()
            action()
        return result

    with connection.execute_wrapper(hook):
        yield
    assert done.is_set(), f"no statement contained {text!r}"


#: Seconds between two readings of a suspect key in the tests that rebuild with no writer
#: running: nothing is on its way to Redis there, so the default wait is idle time.
QUICK_CONFIRM = 0.05
