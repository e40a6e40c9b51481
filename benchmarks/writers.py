"""Writer processes: notification inserts under ten counter strategies, timed in parallel.

Modes:

- ``off``: the insert alone: ``Notification.objects.create()``, the call of ``tally``,
  inside ``counters.paused()`` so nothing is counted;
- ``naive``: the same insert plus ``UPDATE ... SET count = count + 1`` of the
  recipient's counter row in the same transaction;
- ``trigger``: the insert of ``off``, with a PostgreSQL trigger installed for
  the run that upserts the recipient's counter row (``benchmarks.trigger``);
- ``tally``: ``Notification.objects.create()``, the real counted path with the
  process's own ``COUNTERS_SEND_DELAY_MS`` (above 0, the per-process sender
  merges the commits of that many milliseconds into one push), ``COUNTERS_DURABLE`` off;
- ``per_commit``: ``tally`` with ``COUNTERS_SEND_DELAY_MS`` 0: one push after
  each COMMIT;
- ``durable``: the same with ``COUNTERS_DURABLE`` on: one outbox row INSERTed
  before the COMMIT (the flush deletes it once its push applied);
- ``sender``: ``tally`` with the per-process sender on
  (``COUNTERS_SEND_DELAY_MS`` = ``--send-delay``, 5 ms by default): a COMMIT queues its
  delta, a thread pushes the queue in one round trip;
- ``batched`` and ``waited`` push after each COMMIT, like ``per_commit``:
- ``batched``: ``per_commit`` with ``COUNTERS_WRITE_BATCH`` = 16: outside a request, a
  writer's pushes are written to Redis 16 at a time (or within 50 ms), which a
  process killed before the write loses until the audit repairs them;
- ``waited``: ``per_commit`` with ``COUNTERS_DEFER_ACKS`` off, the write path before
  deferred acknowledgements: the committing thread reads each push's reply;
- ``floor``: the least a buffered counter with Tally's guarantees can do: the
  insert of ``off``, then one pre-encoded ``INCR`` sent to Redis on a socket of
  its own after the COMMIT, its replies read 50 at a time (:class:`Floor`). No
  Python of Tally's and no Lua: what it adds to ``off`` is the send alone.
- ``floor_push``: the least a writer can do that keeps Tally's guarantees, with no
  Python of Tally's: a ``post_save`` receiver, connected for the mode's runs only,
  has each created unread notification sent after its COMMIT (at once when the
  save committed already, else by ``transaction.on_commit``) as one push of
  Tally's own push script (its push id makes a repeat or a late delivery
  harmless, its fence and score limit are checked in Redis), encoded from a
  head kept per shard and written to a socket of its own, to keys of its own;
  replies read 50 at a time (:class:`PushFloor`).
- ``floor_durable``: the least durable mode can do for the same insert (a change
  without a transaction): the insert of ``off``, the INSERT of one outbox row
  of the same shape as Tally's (its own statement, committed before the push),
  then the send of ``floor`` (:func:`durable_floor`). Its rows are deleted after
  each run, outside its time.
- ``live``: ``tally`` with the unread counter live (in every other mode it is not):
  each push also publishes the member on its channel, which nobody watches;
- ``watched``: ``live`` with every key the writers write watched by a process of
  its own (:mod:`benchmarks.watchers`), so each push's message is delivered.

``live`` and ``watched`` run only when asked for (``--modes``); :data:`DEFAULT_MODES`
are the others.

Each writer is a spawned process with its own database connection and Redis
client, set up once and then driven over a pipe: every run starts at the same
wall-clock instant in all writers and lasts the same number of seconds. A
writer reports its operations, their latencies and the CPU time it spent (all
its threads: the sender's included); at start, the pid of the PostgreSQL
backend serving its connection.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import random
import socket
import time
from binascii import crc32
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from .child import ChildContext
from .config import BATCHED_WRITE, SENDER_DELAY_MS
from .errors import BenchError
from .pushes import push_setting

MODES = (
    "off",
    "naive",
    "trigger",
    "tally",
    "per_commit",
    "durable",
    "sender",
    "batched",
    "waited",
    "floor",
    "floor_push",
    "floor_durable",
    "live",
    "watched",
)
#: Modes of a live unread counter: only these publish its changes.
LIVE_MODES = ("live", "watched")
#: Modes measured unless ``--modes`` names others.
DEFAULT_MODES = tuple(m for m in MODES if m not in LIVE_MODES)
#: Modes whose operation is a :class:`Floor`: begun before each of their runs, finished
#: after every run.
FLOOR_MODES = ("floor", "floor_push", "floor_durable")
#: The value of COUNTERS_DURABLE each mode runs with (the others do not count through Tally).
DURABLE = {"tally": False, "durable": True}
#: Modes that wait for each push's reply after the COMMIT (``COUNTERS_DEFER_ACKS`` off).
WAITED = {"waited"}
#: Modes that push after each COMMIT whatever the process's ``COUNTERS_SEND_DELAY_MS``.
PER_COMMIT = {"per_commit", "batched", "waited"}
_defer_acks: bool | None = None
_write_batch: int | None = None
_send_delay: float | None = None


def set_mode(mode: str, send_delay_ms: float) -> None:
    """The settings ``mode`` runs with, announced as ``override_settings`` would.

    The write path reads its switches once and keeps them until ``setting_changed``,
    so assigning to ``settings`` alone would not reach it. ``COUNTERS_DEFER_ACKS``
    keeps the value the process started with (its setting or environment), except
    in the modes of :data:`WAITED`, ``COUNTERS_WRITE_BATCH`` its own, except in
    ``batched`` (:data:`~benchmarks.config.BATCHED_WRITE`), and ``COUNTERS_SEND_DELAY_MS``
    its own, except in ``sender`` (``send_delay_ms``) and the modes of :data:`PER_COMMIT` (0).
    """
    from django.conf import settings
    from django.test.signals import setting_changed

    from .internals import conf

    global _defer_acks, _write_batch, _send_delay
    if _defer_acks is None:
        _defer_acks = conf.defer_acks()
    if _write_batch is None:
        _write_batch = conf.write_batch()
    if _send_delay is None:
        _send_delay = float(conf.get("COUNTERS_SEND_DELAY_MS") or 0)
    delay = send_delay_ms if mode == "sender" else 0 if mode in PER_COMMIT else _send_delay
    values = {
        "COUNTERS_DURABLE": DURABLE.get(mode, False),
        "COUNTERS_SEND_DELAY_MS": delay,
        "COUNTERS_DEFER_ACKS": (_defer_acks and mode not in WAITED) or mode == "batched",
        "COUNTERS_WRITE_BATCH": BATCHED_WRITE if mode == "batched" else _write_batch,
    }
    for name, value in values.items():
        setattr(settings, name, value)
        setting_changed.send(sender=type(settings), setting=name, value=value, enter=True)


WORKLOADS = ("spread", "hot")

#: Seconds between sending a run to the writers and its start in all of them.
START_DELAY = 0.05


class WriterError(BenchError):
    """A writer process failed or vanished."""


@dataclass(frozen=True)
class Run:
    mode: str
    workload: str
    start_at: float
    seconds: float


@dataclass(frozen=True)
class Done:
    ops: int
    seconds: float
    #: Seconds each operation took, in the order they ran.
    latencies: list[float]
    #: CPU seconds of the writer process over the run (every thread), queue tail included.
    cpu_s: float = 0.0
    #: The mode's merged-push setting in this writer (:func:`benchmarks.pushes.push_setting`).
    push: str = ""


@dataclass(frozen=True)
class Totals:
    """One run of every writer: operations per second, operations, CPU seconds."""

    rate: float
    ops: int
    cpu_s: float


class Floor:
    """The ``floor`` mode: ``insert(uid)``, then ``INCR <key>:<uid>`` written to Redis's
    socket, its reply read later with the others (every :data:`WINDOW` commands and by
    :meth:`read_replies`). Plain Redis only, over TCP or a Unix socket (the buffer's client's).
    """

    #: Replies read at once.
    WINDOW = 50

    def __init__(self, insert: Callable[[int], None]) -> None:
        self.insert = insert
        self.sock: socket.socket | None = None
        self.key = ""
        self.unread = 0

    def connect(self) -> socket.socket:
        from counters import get_buffer

        buffer = get_buffer()
        address = floor_address(buffer.client)
        if address is None:
            raise BenchError("the floor mode needs a plain Redis (TCP or a Unix socket)")
        if isinstance(address, str):  # a Unix socket
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(address)
        else:
            sock = socket.create_connection(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.key = sock, floor_prefix(buffer.prefix)
        return sock

    def __call__(self, uid: int) -> None:
        self.insert(uid)
        if self.sock is None:
            self.connect()
        key = f"{self.key}{uid}".encode()
        self.send(b"*2\r\n$4\r\nINCR\r\n$%d\r\n%s\r\n" % (len(key), key))

    def send(self, command: bytes, replies: int = 1) -> None:
        """Write ``command`` (RESP: ``replies`` commands); read the replies once
        :data:`WINDOW` are unread."""
        assert self.sock is not None, "connected first"
        self.sock.sendall(command)
        self.unread += replies
        if self.unread >= self.WINDOW:
            self.read_replies()

    def begin(self) -> None:
        """Before a run of this mode."""

    def close(self) -> None:
        """Close the socket (a writer process's exit does)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def finish(self) -> None:
        """After a run, outside its time: read the replies still unread."""
        self.read_replies()

    def read_replies(self) -> None:
        """Read the reply of every command sent (one line each: ``:<n>``)."""
        seen = 0
        while seen < self.unread and self.sock is not None:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise BenchError("Redis closed the floor mode's connection")
            seen += chunk.count(b"\n")
        self.unread = 0


class PushFloor(Floor):
    """The ``floor_push`` mode: :class:`Floor` that sends what Tally's guarantees need.

    Its receiver sees each saved row of ``model`` (a label; notifications by
    default), as a program must that counts every save. The members and
    deltas of a created row (``deltas``: by default +1 to its recipient's
    unread count if it is unread, None for nothing) are pushed after its
    COMMIT, as one call of Tally's push script (:data:`PUSH_SCRIPT`) per
    shard of :data:`SHARDS` they fall on: under this writer's next sequence
    number, so that a repeat, an older push or a fenced one is refused, with
    its send time, so that a late delivery is refused, and the score limit
    checked. Its keys are ``<prefix>:floor_push:{s<shard>}:...``
    (:func:`push_floor_prefix`).
    """

    #: Shards of the pushes' keys, as Tally's buffer has by default.
    SHARDS = 16

    def __init__(
        self,
        insert: Callable[[int], None],
        model: str = "notifications.Notification",
        deltas: Callable[[Any], dict[str, int] | None] | None = None,
    ) -> None:
        super().__init__(insert)
        self.model = model
        self.deltas = deltas or unread_delta
        self.writer = f"bench-push-floor-{os.getpid()}"
        self.seq = 0
        #: Per shard, the start of its pushes' command after the array's length (RESP).
        self.heads: list[str] = []
        self.max_age = ""
        self.on_commit: Callable[[Callable[[], None]], None] = lambda func: func()
        self.conn: Any = None

    def __call__(self, uid: int) -> None:
        self.insert(uid)  # the receiver pushes

    def connect(self) -> socket.socket:
        from django.db import transaction

        from counters import get_buffer

        from .internals import PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS, PUSH_SCRIPT

        buffer = get_buffer()
        sock = super().connect()
        self.on_commit, self.conn = transaction.on_commit, transaction.get_connection()
        sha = buffer.client.script_load(PUSH_SCRIPT)
        prefix = push_floor_prefix(buffer.prefix)
        shards = [f"{prefix}{{s{n}}}:" for n in range(self.SHARDS)]
        # EVALSHA, 4 keys, then the push's arguments: ttl, sent_at, max_age, seq, members
        self.heads = [
            resp("EVALSHA", sha, 4, *(f"{s}{n}" for n in ("pending", f"w:{self.writer}", "since")))
            + resp(f"{s}suspects")
            + resp(PUSH_MARKER_TTL_MS)
            for s in shards
        ]
        self.max_age = resp(PUSH_MAX_AGE_MS)
        return sock

    def begin(self) -> None:
        from django.apps import apps
        from django.db.models.signals import post_save

        if self.sock is None:
            self.connect()
        self.conn.ensure_connection()
        post_save.connect(self.saved, sender=apps.get_model(self.model), dispatch_uid=self.writer)

    def finish(self) -> None:
        from django.apps import apps
        from django.db.models.signals import post_save

        post_save.disconnect(sender=apps.get_model(self.model), dispatch_uid=self.writer)
        super().finish()

    def saved(self, sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        """``post_save``: a created row's deltas, pushed once its transaction commits: now,
        when the save committed already."""
        if created and (deltas := self.deltas(instance)):
            conn = self.conn  # this writer's: read without Django's lookup and its checks
            if conn.in_atomic_block or not conn.autocommit:
                self.on_commit(lambda: self.push(deltas))
            else:
                self.push(deltas)

    def push(self, deltas: dict[str, int]) -> None:
        """Send the push of ``deltas``: per shard, one command encoded from its fixed start."""
        self.seq += 1
        sent, seq = str(int(time.time() * 1000)), str(self.seq)
        if len(deltas) == 1:  # one member: one command
            ((member, delta),) = deltas.items()
            head, d = self.heads[crc32(member.encode()) % self.SHARDS], str(delta)
            self.send(
                f"*13\r\n{head}${len(sent)}\r\n{sent}\r\n{self.max_age}${len(seq)}\r\n{seq}\r\n"
                f"${len(member)}\r\n{member}\r\n${len(d)}\r\n{d}\r\n".encode()
            )
            return
        shards: dict[int, list[str]] = {}
        for member, delta in deltas.items():
            d = str(delta)
            shards.setdefault(crc32(member.encode()) % self.SHARDS, []).append(
                f"${len(member)}\r\n{member}\r\n${len(d)}\r\n{d}\r\n"
            )
        commands = (
            f"*{11 + 2 * len(pairs)}\r\n{self.heads[shard]}${len(sent)}\r\n{sent}\r\n"
            f"{self.max_age}${len(seq)}\r\n{seq}\r\n{''.join(pairs)}"
            for shard, pairs in shards.items()
        )
        self.send("".join(commands).encode(), len(shards))  # one write for every shard


def unread_delta(notification: Any) -> dict[str, int] | None:
    """+1 to the unread count of a notification's recipient, if it is unread."""
    return None if notification.is_read else {f"unread:{notification.recipient_id}": 1}


def resp(*parts: object) -> str:
    """``parts`` as RESP bulk strings (ASCII)."""
    return "".join(f"${len(str(p))}\r\n{p}\r\n" for p in parts)


class DurableFloor(Floor):
    """The ``floor_durable`` mode: :class:`Floor` whose insert also INSERTs an outbox row."""

    #: Push ids of its rows start so; :meth:`finish` deletes them.
    ROW_PREFIX = "bench-floor-"

    def __init__(self, insert: Callable[[int], None]) -> None:
        super().__init__(self._insert_and_row)
        self.plain = insert
        self.seq = 0
        self.writer = f"{self.ROW_PREFIX}{os.getpid()}"

    def _insert_and_row(self, uid: int) -> None:
        from django.db import connection
        from django.utils import timezone

        self.plain(uid)
        self.seq += 1
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO counters_outbox (push_id, deltas, created_at) VALUES (%s, %s, %s)",
                [f"{self.writer}:{self.seq}", f'{{"floor:{uid}": 1}}', timezone.now()],
            )

    def finish(self) -> None:
        from django.db import connection

        super().finish()
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM counters_outbox WHERE push_id LIKE %s", [f"{self.ROW_PREFIX}%"]
            )


def floor_address(client: Any) -> tuple[str, int] | str | None:
    """(host, port) of a plain Redis client over TCP, the path of its Unix socket; None for
    a cluster or Sentinel."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {})
    if "sentinel" in type(pool).__name__.lower():
        return None
    if "path" in kwargs:
        return str(kwargs["path"])
    if "host" not in kwargs:
        return None
    return str(kwargs["host"]), int(kwargs.get("port", 6379))


def floor_prefix(buffer_prefix: str) -> str:
    """Keys of the ``floor`` mode: ``<prefix>:floor:<uid>``, under the bench's key prefix."""
    return f"{buffer_prefix}:floor:"


def push_floor_prefix(buffer_prefix: str) -> str:
    """Keys of the ``floor_push`` mode, under the bench's key prefix."""
    return f"{buffer_prefix}:floor_push:"


def drop_floor_keys(client: Any, buffer_prefix: str) -> None:
    """Delete the keys the ``floor`` and ``floor_push`` modes wrote."""
    for prefix in (floor_prefix(buffer_prefix), push_floor_prefix(buffer_prefix)):
        for keys in batched_scan(client, f"{prefix}*"):
            client.delete(*keys)


def batched_scan(client: Any, pattern: str, size: int = 500) -> Iterator[list]:
    batch: list = []
    for key in client.scan_iter(match=pattern, count=size):
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def operations() -> dict[str, Callable[[int], None]]:
    """One insert per mode for recipient id ``uid``. Django must be set up."""
    from django.db import transaction
    from django.db.models import F

    from counters import paused
    from notifications.models import Notification, UnreadCounter

    def off(uid: int) -> None:
        with paused():  # the call of tally, counting nothing
            Notification.objects.create(recipient_id=uid, verb="bench")

    def naive(uid: int) -> None:
        with transaction.atomic():
            off(uid)
            UnreadCounter.objects.filter(pk=uid).update(count=F("count") + 1)

    def tally(uid: int) -> None:
        Notification.objects.create(recipient_id=uid, verb="bench")

    # trigger: the insert of off; the trigger the bench installs for the run counts it
    return {
        "floor": Floor(off),
        "floor_push": PushFloor(off),
        "floor_durable": DurableFloor(off),
        "off": off,
        "naive": naive,
        "trigger": off,
        "tally": tally,
        "per_commit": tally,
        "durable": tally,
        "sender": tally,
        "batched": tally,
        "waited": tally,
        "live": tally,
        "watched": tally,
    }


def perform(run: Run, op: Callable[[int], None], pick: Callable[[], int]) -> Done:
    time.sleep(max(0.0, run.start_at - time.time()))
    latencies: list[float] = []
    clock = time.perf_counter
    started = now = clock()
    end = started + run.seconds
    while True:
        key = pick()
        before = now
        op(key)
        now = clock()
        latencies.append(now - before)
        if now >= end:
            return Done(len(latencies), now - started, latencies)


def backend_pid() -> int | None:
    """``pg_backend_pid()`` of this process's connection (opened now); None off PostgreSQL."""
    from django.db import connection

    connection.ensure_connection()
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def writer_main(
    conn: Connection,
    context: ChildContext,
    users: list[int],
    hot: int,
    seed: int,
    send_delay_ms: float = SENDER_DELAY_MS,
) -> None:
    """Body of one writer process: answer every :class:`Run` with a :class:`Done`."""
    context.setup()
    from django.db import connection

    import counters

    ops = operations()
    rng = random.Random(seed)
    pickers = {"hot": lambda: hot, "spread": lambda: users[rng.randrange(len(users))]}
    conn.send(("ready", backend_pid()))
    while (run := conn.recv()) is not None:
        try:
            # Set for the whole run: ``tally`` and ``durable`` share one operation.
            set_mode(run.mode, send_delay_ms)
            cpu = time.process_time()
            op = ops[run.mode]
            if isinstance(op, Floor):
                op.begin()
            done = perform(run, op, pickers[run.workload])
            counters.push_queued()  # the queue's tail, before the next run
            for floor in FLOOR_MODES:
                ops[floor].finish()  # type: ignore[attr-defined]
            done = replace(done, cpu_s=time.process_time() - cpu, push=push_setting(run.mode))
            conn.send(("done", done))
        except Exception as exc:
            conn.send(("error", f"{run.mode}/{run.workload}: {type(exc).__name__}: {exc}"))
    connection.close()


class WriterPool:
    """``processes`` writer processes, started once and driven run by run."""

    def __init__(
        self,
        processes: int,
        context: ChildContext,
        users: list[int],
        hot: int,
        timeout: float,
        send_delay_ms: float = SENDER_DELAY_MS,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.ops: dict[str, int] = dict.fromkeys(MODES, 0)
        #: Seconds per operation of every recorded run, by (workload, mode).
        self.latencies: dict[tuple[str, str], list[float]] = {}
        #: ``pg_backend_pid()`` of each writer's connection (None: not PostgreSQL).
        self.backend_pids: list[int | None] = []
        #: The merged-push setting each mode ran with, as its writers reported it.
        self.push: dict[str, str] = {}
        try:
            for i in range(processes):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=writer_main,
                    args=(child, context, users, hot, i + 1, send_delay_ms),
                    name=f"bench-writer-{i}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self.backend_pids = self._collect(timeout + 60)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float) -> list:
        replies = []
        deadline = time.monotonic() + timeout
        for i, conn in enumerate(self.conns):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise WriterError(f"writer {i} did not answer within {timeout:.0f}s")
                kind, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise self._exited(i) from exc
            if kind == "error":
                raise WriterError(value)
            replies.append(value)
        return replies

    def _exited(self, i: int) -> WriterError:
        self.procs[i].join(timeout=5)  # its pipe closes a moment before it can be reaped
        return WriterError(f"writer {i} exited (status {self.procs[i].exitcode})")

    def run(self, mode: str, workload: str, seconds: float, record: bool = True) -> Totals:
        """Run every writer for ``seconds``; operations per second, operations and CPU time.

        ``record`` keeps the latency of each operation (not for warm-up runs).
        """
        run = Run(mode, workload, time.time() + START_DELAY, seconds)
        for i, conn in enumerate(self.conns):
            try:
                conn.send(run)
            except OSError as exc:
                raise self._exited(i) from exc
        done: list[Done] = self._collect(START_DELAY + seconds + self.timeout)
        self.ops[mode] += sum(d.ops for d in done)
        self.push[mode] = " | ".join(sorted({d.push for d in done}))  # one, unless they differ
        if record:
            kept = self.latencies.setdefault((workload, mode), [])
            for d in done:
                kept.extend(d.latencies)
        return Totals(
            sum(d.ops / d.seconds for d in done),
            sum(d.ops for d in done),
            sum(d.cpu_s for d in done),
        )

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def percentile(values: list[float], share: float) -> float:
    """The ``share`` (0..1) percentile of ``values``, nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]
