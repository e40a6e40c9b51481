"""A Redis lease: one holder at a time, proven by a random token.

Acquire is ``SET key token NX PX ttl``; extend and release act only if the key
still holds our token, so a holder whose lease expired can never extend or
delete the lease of its successor. All three are Lua scripts flagged to run
when Redis is at maxmemory: a full Redis can only be drained under a lease.
"""

from __future__ import annotations

import secrets
import time
from types import TracebackType

from counters.base.exceptions import UnexpectedScriptReply
from counters.buffer.cluster import Client
from counters.buffer.scripts import ACQUIRE_SCRIPT, EXTEND_SCRIPT, RELEASE_SCRIPT, DrainScript


class Lease:
    """``with Lease(client, key, ttl) as lease:`` — ``lease.held`` says if we got it."""

    def __init__(self, client: Client, key: str, ttl: float) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = max(1, int(ttl * 1000))
        self.token = secrets.token_hex(16)
        self.held = False
        self.expires_at = 0.0
        self._acquire = DrainScript(client, ACQUIRE_SCRIPT)
        self._extend = DrainScript(client, EXTEND_SCRIPT)
        self._release = DrainScript(client, RELEASE_SCRIPT)

    def acquire(self) -> bool:
        # SET NX fails on our own key: renew it instead of forgetting that we hold it.
        if self.held and self.extend():
            return True
        started = time.monotonic()
        reply = self._acquire(keys=[self.key], args=[self.token, self.ttl_ms])
        if reply not in (0, 1):
            raise UnexpectedScriptReply("ACQUIRE_SCRIPT", reply)
        self.held = reply == 1
        if self.held:
            self.expires_at = started + self.ttl_ms / 1000
        return self.held

    def extend(self) -> bool:
        """Renew the full ttl. False (and ``held`` False) if the lease was lost."""
        started = time.monotonic()
        reply = self._extend(keys=[self.key], args=[self.token, self.ttl_ms])
        if reply not in (0, 1):
            raise UnexpectedScriptReply("EXTEND_SCRIPT", reply)
        self.held = reply == 1
        if self.held:
            self.expires_at = started + self.ttl_ms / 1000
        return self.held

    def remaining(self) -> float:
        """Seconds left before the lease expires, as far as this holder knows."""
        return max(0.0, self.expires_at - time.monotonic()) if self.held else 0.0

    def release(self) -> bool:
        if not self.held:
            return False
        reply = self._release(keys=[self.key], args=[self.token])
        if reply not in (0, 1):
            raise UnexpectedScriptReply("RELEASE_SCRIPT", reply)
        self.held = False
        return reply == 1

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.held:
            try:
                self.release()
            except Exception:
                # The lease expires by itself; never mask the original error.
                if exc is None:
                    raise
