"""counters.buffer.lease.Lease on fakeredis: exclusivity, token checks, expiry, context manager."""

from __future__ import annotations

import time

import pytest

from counters.base.exceptions import UnexpectedScriptReply
from counters.buffer.lease import Lease

KEY = "t:{s0}:lease"


def test_acquire_sets_the_token_with_the_ttl(client):
    lease = Lease(client, KEY, 30)
    assert lease.held is False
    assert lease.remaining() == 0.0
    assert lease.acquire() is True
    assert lease.held is True
    assert client.get(KEY) == lease.token.encode()
    assert 29_000 < client.pttl(KEY) <= 30_000
    assert 29.0 < lease.remaining() <= 30.0


def test_tokens_are_random_per_lease(client):
    assert Lease(client, KEY, 1).token != Lease(client, KEY, 1).token
    assert len(Lease(client, KEY, 1).token) == 32


@pytest.mark.parametrize(
    ("ttl", "ttl_ms"), [(30, 30_000), (0.05, 50), (0.0001, 1), (0, 1)], ids=str
)
def test_ttl_in_milliseconds_is_at_least_one(client, ttl, ttl_ms):
    assert Lease(client, KEY, ttl).ttl_ms == ttl_ms


def test_second_holder_cannot_acquire_while_held(client):
    first, second = Lease(client, KEY, 30), Lease(client, KEY, 30)
    assert first.acquire() is True
    assert second.acquire() is False
    assert second.held is False
    assert second.remaining() == 0.0
    assert client.get(KEY) == first.token.encode()


def test_acquire_again_by_the_holder_keeps_the_lease(client):
    lease = Lease(client, KEY, 30)
    assert lease.acquire() is True
    client.pexpire(KEY, 1_000)
    assert lease.acquire() is True
    assert lease.held is True
    assert 29_000 < client.pttl(KEY) <= 30_000
    assert lease.release() is True
    assert client.exists(KEY) == 0


def test_extend_renews_the_full_ttl(client):
    lease = Lease(client, KEY, 30)
    lease.acquire()
    client.pexpire(KEY, 1_000)
    assert lease.extend() is True
    assert lease.held is True
    assert 29_000 < client.pttl(KEY) <= 30_000


def test_another_token_cannot_extend_or_release(client):
    holder, intruder = Lease(client, KEY, 30), Lease(client, KEY, 30)
    holder.acquire()
    client.pexpire(KEY, 10_000)
    assert intruder.extend() is False
    assert intruder.held is False
    assert client.pttl(KEY) <= 10_000
    # release() does nothing for a lease it never held ...
    assert intruder.release() is False
    # ... and the script refuses even if the intruder believes it holds the lease.
    intruder.held = True
    assert intruder.release() is False
    assert intruder.held is False
    assert client.get(KEY) == holder.token.encode()


def test_release_deletes_only_our_lease_and_only_once(client):
    lease = Lease(client, KEY, 30)
    lease.acquire()
    assert lease.release() is True
    assert lease.held is False
    assert client.exists(KEY) == 0
    assert lease.release() is False
    assert Lease(client, KEY, 30).acquire() is True


def test_expired_lease_goes_to_the_next_holder_and_the_old_one_cannot_touch_it(client):
    old = Lease(client, KEY, 0.05)
    assert old.acquire() is True
    time.sleep(0.08)
    assert old.remaining() == 0.0
    assert client.exists(KEY) == 0
    new = Lease(client, KEY, 30)
    assert new.acquire() is True
    assert old.extend() is False
    assert old.held is False
    assert old.release() is False
    old.held = True  # even a stale belief of holding it must not delete the successor's lease
    assert old.release() is False
    assert client.get(KEY) == new.token.encode()
    assert 29_000 < client.pttl(KEY) <= 30_000


def test_extend_after_expiry_fails_even_without_successor(client):
    lease = Lease(client, KEY, 0.05)
    lease.acquire()
    time.sleep(0.08)
    assert lease.extend() is False
    assert lease.held is False
    assert client.exists(KEY) == 0


def test_context_manager_acquires_and_releases(client):
    with Lease(client, KEY, 30) as lease:
        assert lease.held is True
        assert client.get(KEY) == lease.token.encode()
    assert lease.held is False
    assert client.exists(KEY) == 0


def test_context_manager_releases_on_error(client):
    with pytest.raises(RuntimeError, match="boom"), Lease(client, KEY, 30) as lease:
        assert client.exists(KEY) == 1
        raise RuntimeError("boom")
    assert lease.held is False
    assert client.exists(KEY) == 0


def test_context_manager_that_did_not_get_the_lease_leaves_it_alone(client):
    holder = Lease(client, KEY, 30)
    holder.acquire()
    with Lease(client, KEY, 30) as other:
        assert other.held is False
    assert client.get(KEY) == holder.token.encode()


def test_context_manager_does_not_mask_the_original_error(client):
    lease = Lease(client, KEY, 30)

    def broken_release(**kwargs):
        raise ConnectionError("redis gone")

    with pytest.raises(RuntimeError, match="original"), lease:
        lease._release = broken_release
        raise RuntimeError("original")


def test_context_manager_reports_a_failed_release_when_there_is_no_error(client):
    lease = Lease(client, KEY, 30)

    def broken_release(**kwargs):
        raise ConnectionError("redis gone")

    with pytest.raises(ConnectionError, match="redis gone"), lease:
        lease._release = broken_release


@pytest.mark.parametrize("method", ["extend", "release"])
def test_unknown_script_reply_raises(client, method):
    lease = Lease(client, KEY, 30)
    lease.acquire()
    setattr(lease, f"_{method}", lambda **kwargs: 7)
    with pytest.raises(UnexpectedScriptReply) as info:
        getattr(lease, method)()
    assert (info.value.script, info.value.reply) == (f"{method.upper()}_SCRIPT", 7)


def test_acquire_again_after_silent_expiry_takes_the_free_lease(client):
    lease = Lease(client, KEY, 0.05)
    lease.acquire()
    time.sleep(0.08)
    assert lease.held is True  # nothing told it yet
    assert lease.acquire() is True
    assert client.get(KEY) == lease.token.encode()
