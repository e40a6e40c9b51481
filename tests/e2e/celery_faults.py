"""The project's Celery app with a fault injected into the flush, for worker subprocesses.

``celery -A tests.e2e.celery_faults worker --pool=solo`` is the project's
worker (``config.celery.app``). ``TALLY_TEST_FAULT`` names the fault; without
it nothing is changed. ``TALLY_TEST_FAULT_LOG`` is a file that gets one JSON
line per faulted batch: ``{"pid", "shard", "batch", "event", "at"}``.

- ``slow-apply:<s>``: every batch sleeps ``s`` seconds inside its DB
  transaction, after its ledger row (events ``apply-start`` and ``apply-end``).
- ``hang-apply``: the first batch that any worker of the test applies
  (decided by a Redis ``SET NX`` under the test's key prefix) hangs inside its
  DB transaction (event ``hang``); the test kills the worker.
- ``hang-ack``: the same after COMMIT, before the batch is acknowledged in Redis
  (by ``Buffer.ack``, or by the move of the next batch).
- ``slow-first-apply:<s>``: the first batch applied sleeps ``s`` seconds
  inside its transaction (``apply-start``, ``apply-end``), the others do not.

Installed in the worker process before its first task (the solo pool runs
tasks in that process).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.signals import task_prerun

from config.celery import app

__all__ = ["app"]

_installed = False


def _log(event: str, batch: Any) -> None:
    path = os.environ.get("TALLY_TEST_FAULT_LOG")
    if not path:
        return
    line = {
        "pid": os.getpid(),
        "shard": batch.shard,
        "batch": batch.batch_id,
        "event": event,
        "at": time.time(),
    }
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")


def _first() -> bool:
    """True in the one process (of every worker of this test) that asks first."""
    from counters import get_client
    from counters.base import conf

    key = f"{conf.key_prefix()}:test-fault-once"
    return bool(get_client().set(key, os.getpid(), nx=True))


def _install() -> None:
    from counters.buffer.store import Buffer
    from counters.flushing import ledger

    fault = os.environ.get("TALLY_TEST_FAULT", "")
    name, _, arg = fault.partition(":")
    if not name:
        return
    record_batch = ledger.record_batch  # inside the batch's transaction: its ledger row

    if name in ("slow-apply", "slow-first-apply"):
        seconds = float(arg)

        def slow(batch, using):
            record_batch(batch, using)
            if name == "slow-apply" or _first():
                _log("apply-start", batch)
                time.sleep(seconds)
                _log("apply-end", batch)

        ledger.record_batch = slow
    elif name == "hang-apply":

        def hang(batch, using):
            record_batch(batch, using)
            if _first():
                _log("hang", batch)
                time.sleep(3600)

        ledger.record_batch = hang
    elif name == "hang-ack":
        ack = Buffer.ack

        def hang_ack(self, shard, batch_id):
            if _first():
                _log("hang", type("B", (), {"shard": shard, "batch_id": batch_id}))
                time.sleep(3600)
            return ack(self, shard, batch_id)

        move = Buffer.move

        def hang_move(self, shard, batch_id, limit, only=(), ack=None):
            if ack is not None and _first():
                _log("hang", type("B", (), {"shard": shard, "batch_id": ack}))
                time.sleep(3600)
            return move(self, shard, batch_id, limit, only=only, ack=ack)

        Buffer.ack = hang_ack  # type: ignore[method-assign]
        Buffer.move = hang_move  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown TALLY_TEST_FAULT {fault!r}")


@task_prerun.connect
def _install_once(**kwargs: Any) -> None:
    global _installed
    if not _installed:
        _installed = True
        _install()
