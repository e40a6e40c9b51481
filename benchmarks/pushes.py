"""The merged-push setting of a write mode, as its writer process runs it.

Each writer reports it after the settings of a run are in place
(:func:`benchmarks.writers.set_mode`), so the table shows what the writes measured
ran with, not what the bench meant to set.
"""

from __future__ import annotations

#: Modes that count through Tally's write path (the others push nothing of Tally's).
TALLY_MODES = ("tally", "per_commit", "durable", "sender", "batched", "waited", "live", "watched")
#: How the modes of no Tally setting reach Redis.
OTHER_MODES = {
    "off": "no push",
    "naive": "no push",
    "trigger": "no push",
    "floor": "one INCR per commit, replies read 50 at a time",
    "floor_push": "one push per commit, replies read 50 at a time",
    "floor_durable": "an outbox row, then one INCR per commit, replies read 50 at a time",
}


def push_setting(mode: str) -> str:
    """How ``mode``'s commits reach Redis in this process now: the sender's delay and
    batch, or one push per commit (with the reply waited for, or its writes batched)."""
    from .internals import conf

    if mode not in TALLY_MODES:
        return OTHER_MODES.get(mode, "")
    delay = conf.get("COUNTERS_SEND_DELAY_MS") or 0
    if delay > 0 and not conf.durable():  # (an outbox row's push never waits in the sender)
        text = f"COUNTERS_SEND_DELAY_MS {delay:g} / COUNTERS_SEND_BATCH {conf.send_batch()}"
    elif not conf.defer_acks():
        text = "off: one push per commit, its reply waited for"
    elif conf.write_batch() > 1:
        text = f"off: one push per commit, COUNTERS_WRITE_BATCH {conf.write_batch()} a write"
    else:
        text = "off: one push per commit"
    text += "; outbox row per commit" if conf.durable() else ""
    return text + ("; live: each push publishes its member" if mode in ("live", "watched") else "")
