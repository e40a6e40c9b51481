"""Repair the unread counters of chosen users (the admin's rebuild action)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import counters

from .apps import UNREAD_COUNTER

#: Seconds between the two readings that confirm a drift (see counters.rebuild).
CONFIRM_DELAY = 0.5


def truth_counts(user_ids: Iterable[Any]) -> dict[Any, int]:
    """``COUNT(*)`` of unread notifications per user (0 for users with none)."""
    ids = list(user_ids)
    source = counters.get_spec(UNREAD_COUNTER).source
    assert source is not None, "the unread counter is tracked: it has a truth source"
    found = source.count_for(ids)
    return {pk: found.get(pk, 0) for pk in ids}


def repair_users(
    user_ids: Iterable[Any], confirm_delay: float = CONFIRM_DELAY
) -> list[tuple[Any, int, int]]:
    """Bring each user's exact count to the truth; returns ``(user_id, exact_before, truth)``.

    This is the shared rebuild limited to these users: a drift is repaired
    only when seen twice, through the normal delta path, so writers and
    flushers can keep running.
    """
    ids = list(dict.fromkeys(user_ids))
    report = counters.rebuild(UNREAD_COUNTER, keys=ids, confirm_delay=confirm_delay)
    wrong = {d.key: d for d in report.wrong}
    truth = truth_counts([pk for pk in ids if pk not in wrong])
    return [
        (pk, wrong[pk].stored + wrong[pk].pending, wrong[pk].truth)
        if pk in wrong
        else (pk, truth[pk], truth[pk])
        for pk in ids
    ]
