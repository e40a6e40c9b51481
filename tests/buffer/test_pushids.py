"""Push ids (writer id + sequence number) and the per-writer high-water marks on fakeredis."""

from __future__ import annotations

import os
import threading
from unittest import mock

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base.exceptions import NotConnected
from counters.buffer import pushids
from counters.buffer.pushids import PushId
from counters.buffer.store import PUSH_MARKER_TTL_MS, Buffer
from counters.write import delivery

# With 4 shards: c:1 and c:3 live in shard 0, c:2 in shard 2.


@pytest.fixture
def buf(client) -> Buffer:
    return Buffer(client, "t", shards=4)


@pytest.fixture(autouse=True)
def empty_pool():
    pushids._after_fork_in_child()  # the same reset a forked child gets
    yield
    pushids._after_fork_in_child()


def pending(client, shard: int) -> dict[str, int]:
    rows = client.zrange(f"t:{{s{shard}}}:pending", 0, -1, withscores=True)
    return {m.decode(): int(s) for m, s in rows}


# -- PushId -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "push_id", [PushId("3fa9c0d1e2b4a5f6", 1), PushId("w-undo", 42), PushId("a:b", 7)], ids=str
)
def test_a_push_id_round_trips_through_its_text(push_id):
    assert PushId.parse(str(push_id)) == push_id
    assert PushId.of(str(push_id)) == push_id


def test_a_push_id_reads_as_writer_colon_seq():
    assert str(PushId("abc", 12)) == "abc:12"
    assert PushId.parse("abc:12") == PushId("abc", 12)
    assert PushId("abc", 12).undo() == PushId("abc-undo", 12)


@pytest.mark.parametrize("text", ["abc", "abc:", ":3", "abc:x", "abc:0", "abc:-1", "abc:\u0661"])
def test_text_that_is_not_a_push_id_is_refused_by_parse(text):
    with pytest.raises(ValueError):
        PushId.parse(text)


@pytest.mark.parametrize(
    ("writer", "seq"), [("", 1), ("a b", 1), ("a", 0), ("a", -3), ("a", True), ("a", "1")]
)
def test_a_bad_push_id_is_refused(writer, seq):
    with pytest.raises(ValueError):
        PushId(writer, seq)


def test_other_text_names_a_writer_that_pushes_once():
    assert PushId.of("0f3c9a7e5b1d4c2a8e6f") == PushId("0f3c9a7e5b1d4c2a8e6f", 1)


# -- the scripts ----------------------------------------------------------------------


def test_a_repeated_push_adds_nothing_twice(buf, client):
    assert buf.push({"c:1": 2, "c:2": 3}, PushId("w", 1)) == {0, 2}
    assert buf.push({"c:1": 2, "c:2": 3}, PushId("w", 1)) == set()
    assert (pending(client, 0), pending(client, 2)) == ({"c:1": 2}, {"c:2": 3})


def test_a_writer_pushes_in_order_and_an_older_push_is_refused(buf, client):
    assert buf.push({"c:1": 1}, PushId("w", 1)) == {0}
    assert buf.push({"c:1": 10}, PushId("w", 3)) == {0}  # a gap is fine
    assert buf.push({"c:1": 100}, PushId("w", 2)) == set()  # older, delivered late
    assert buf.push({"c:1": 1000}, PushId("other", 2)) == {0}  # another writer
    assert pending(client, 0) == {"c:1": 1011}
    assert client.hget("t:{s0}:w:w", "seq") == b"3"


def test_marks_are_per_shard(buf, client):
    assert buf.push({"c:1": 1}, PushId("w", 5)) == {0}
    # Shard 2 never saw writer w: a lower number still applies there.
    assert buf.push({"c:2": 1}, PushId("w", 2)) == {2}
    assert client.hget("t:{s2}:w:w", "seq") == b"2"


def test_one_key_per_writer_and_shard_however_many_pushes(buf, client):
    for seq in range(1, 201):
        buf.push({"c:1": 1, "c:2": 1}, PushId("w", seq))
    assert sorted(k.decode() for k in client.keys("t:*:w:*")) == ["t:{s0}:w:w", "t:{s2}:w:w"]
    assert pending(client, 0) == {"c:1": 200}


def test_the_mark_lives_its_ttl_after_each_push(buf, client):
    buf.push({"c:1": 1}, PushId("w", 1))
    client.pexpire("t:{s0}:w:w", 1000)
    buf.push({"c:1": 1}, PushId("w", 2))
    assert 1000 < client.pttl("t:{s0}:w:w") <= PUSH_MARKER_TTL_MS


def test_fence_before_the_push_arrives_refuses_it_for_good(buf, client):
    assert buf.fence(["c:1", "c:2"], PushId("w", 4)) == set()
    assert client.hgetall("t:{s0}:w:w") == {b"fenced": b"4"}
    assert 0 < client.pttl("t:{s0}:w:w") <= PUSH_MARKER_TTL_MS
    assert buf.push({"c:1": 1, "c:2": 1}, PushId("w", 4)) == set()  # the late delivery
    assert buf.push({"c:1": 1}, PushId("w", 9)) == set()  # nothing after it either
    assert buf.fence(["c:1"], PushId("w", 4)) == set()  # fencing twice is harmless
    assert (pending(client, 0), pending(client, 2)) == ({}, {})


def test_fence_keeps_what_the_writer_applied_before(buf, client):
    buf.push({"c:1": 1}, PushId("w", 3))
    assert buf.fence(["c:1"], PushId("w", 4)) == set()
    assert client.hgetall("t:{s0}:w:w") == {b"seq": b"3", b"fenced": b"4"}
    assert buf.push({"c:1": 1}, PushId("w", 4)) == set()
    assert pending(client, 0) == {"c:1": 1}


def test_fence_after_the_push_applied_reports_it_where_it_landed(buf, client):
    buf.push({"c:1": 1, "c:2": 1}, PushId("w", 4))
    client.delete("t:{s2}:w:w", "t:{s2}:pending")  # as if shard 2 never got it
    assert buf.fence(["c:1", "c:2"], PushId("w", 4)) == {0}
    assert buf.fence(["c:1", "c:2"], PushId("w", 4)) == {0}  # and again
    assert buf.push({"c:2": 1}, PushId("w", 4)) == set()  # shard 2 is fenced now
    assert client.hgetall("t:{s0}:w:w") == {b"seq": b"4"}


def test_fence_of_an_id_from_before_writer_ids_reads_its_old_marker(buf, client):
    client.set("t:{s0}:push:0f3c9a7e", "1", px=PUSH_MARKER_TTL_MS)  # an old push landed
    assert buf.fence(["c:1", "c:2"], "0f3c9a7e") == {0}
    assert client.get("t:{s2}:push:0f3c9a7e") == b"fenced"  # old writers refuse it there


def test_snapshot_reads_the_marks_of_a_push_and_of_its_take_back(buf, client):
    push_id = PushId("w", 2)
    buf.push({"c:1": 5, "c:2": 1}, push_id)
    buf.push({"c:1": -5}, push_id.undo())
    snap = buf.snapshot(["c:1", "c:2"], push_ids=[push_id, "other:1"])
    assert snap.hwms[(0, "w")] == snap.hwms[(0, "w-undo")] == snap.hwms[(2, "w")] == 2
    assert snap.hwms[(2, "w-undo")] == snap.hwms[(0, "other")] == 0
    assert snap.applied(0, push_id) and snap.applied(0, push_id.undo())
    assert snap.applied(2, push_id) and not snap.applied(2, push_id.undo())
    assert not snap.applied(0, PushId("w", 3))


# -- the pool -------------------------------------------------------------------------


def test_a_released_writer_pushes_its_next_number():
    first = pushids.allocate()
    pushids.release(first)
    second = pushids.allocate()
    assert second == PushId(first.writer, first.seq + 1)
    assert len(first.writer) == 2 * pushids.WRITER_ID_BYTES


def test_a_busy_writer_is_not_handed_out_twice():
    a, b = pushids.allocate(), pushids.allocate()
    assert a.writer != b.writer
    assert pushids.pool_size() == (0, 2)


def test_a_retired_writer_is_never_used_again():
    first = pushids.allocate()
    pushids.retire(first)
    assert pushids.pool_size() == (0, 0)
    assert pushids.allocate().writer != first.writer


def test_ending_an_id_twice_changes_nothing():
    first = pushids.allocate()
    pushids.release(first)
    second = pushids.allocate()  # the same writer, busy again
    pushids.retire(first)  # a stale end: ignored
    pushids.release(first)
    assert pushids.pool_size() == (0, 1)
    pushids.release(second)
    assert pushids.allocate() == PushId(first.writer, 3)


def test_pushing_retires_the_writer_when_the_block_raises():
    with pytest.raises(RuntimeError), pushids.pushing() as push_id:
        raise RuntimeError("boom")
    assert pushids.pool_size() == (0, 0)
    with pushids.pushing() as other:
        assert other.writer != push_id.writer
    assert pushids.pool_size() == (1, 0)


def test_threads_never_share_a_writer_and_each_writer_counts_up():
    seen: dict[str, list[int]] = {}
    in_use: set[str] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def work() -> None:
        for _ in range(300):
            push_id = pushids.allocate()
            with guard:
                if push_id.writer in in_use:
                    errors.append(f"{push_id.writer} handed out twice")
                in_use.add(push_id.writer)
                seen.setdefault(push_id.writer, []).append(push_id.seq)
            with guard:
                in_use.discard(push_id.writer)
            pushids.release(push_id)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert 1 <= len(seen) <= 4
    for seqs in seen.values():
        assert seqs == list(range(1, len(seqs) + 1))
    assert sum(len(s) for s in seen.values()) == 1200


def test_a_forked_child_starts_with_an_empty_pool():
    idle, busy = pushids.allocate(), pushids.allocate()
    pushids.release(idle)
    assert pushids.pool_size() == (1, 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its pool and a fresh id, then leave at once
        try:
            size = pushids.pool_size()
            fresh = pushids.allocate()
            os.write(write, f"{size[0]} {size[1]} {fresh}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        idle_count, busy_count, fresh = pipe.read().split()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (idle_count, busy_count) == ("0", "0")
    assert PushId.parse(fresh).writer not in {idle.writer, busy.writer}
    assert PushId.parse(fresh).seq == 1
    assert pushids.pool_size() == (1, 1)  # the parent's pool is untouched


# -- send: retirement ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "retired", "unsettled"),
    [
        pytest.param(RedisTimeoutError("timed out"), True, True, id="may-have-left"),
        pytest.param(NotConnected("refused"), False, False, id="never-sent"),
    ],
)
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_push_that_may_have_left_retires_its_writer(buf, error, retired, unsettled):
    direct = []
    with (
        mock.patch.object(delivery, "get_buffer", return_value=buf),
        mock.patch.object(Buffer, "push", side_effect=error),
        mock.patch.object(delivery, "write_direct", lambda d, u, **kw: direct.append((d, kw))),
    ):
        delivery.send({"c:1": 3}, "default")
    [(deltas, kwargs)] = direct
    push_id = kwargs["push_id"]
    assert (deltas, kwargs["unsettled"]) == ({"c:1": 3}, unsettled)
    assert pushids.pool_size() == (0, 0) if retired else (1, 0)
    assert (pushids.allocate().writer == push_id.writer) is not retired


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_push_completed_by_its_repeat_still_retires_its_writer(buf, client):
    real_push = Buffer.push
    calls = []

    def lost_reply(self, deltas, push_id):
        calls.append(push_id)
        real_push(self, deltas, push_id)
        if len(calls) == 1:
            raise RedisTimeoutError("reply lost")
        return set()

    with (
        mock.patch.object(delivery, "get_buffer", return_value=buf),
        mock.patch.object(Buffer, "push", lost_reply),
    ):
        delivery.send({"c:1": 3}, "default")
    assert calls[0] == calls[1]
    assert pending(client, 0) == {"c:1": 3}
    assert pushids.pool_size() == (0, 0)


def test_send_with_a_given_id_uses_it_and_ends_it(buf, client):
    push_id = pushids.allocate()
    with mock.patch.object(delivery, "get_buffer", return_value=buf):
        delivery.send({"c:1": 3}, "default", push_id=push_id)
    assert client.hget(f"t:{{s0}}:w:{push_id.writer}", "seq") == str(push_id.seq).encode()
    assert pushids.pool_size() == (1, 0)
    pushids.retire(push_id)  # the caller ending it again changes nothing
    assert pushids.allocate() == PushId(push_id.writer, push_id.seq + 1)
