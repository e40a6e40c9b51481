"""Ground truth and assertions shared by the tests."""

from __future__ import annotations

import counters
from notifications.models import Notification, UnreadCounter


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


def in_redis(user) -> int:
    """Pending plus in-flight deltas of the user's unread counter in Redis."""
    from counters.client import get_buffer

    member = f"unread:{user.pk}"
    snap = get_buffer().snapshot([member])
    return snap.pending[member] + snap.inflight[member]
