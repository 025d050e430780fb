"""Ring behaviour within one process: records, wrap-around, errors, views, lifecycle."""

from __future__ import annotations

import os
import stat
import threading
import time

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlord.errors import RingClosed, RingError, RingFullError, RingTimeout
from overlord.shm import Ring, decode_batch, segment_name, write_batch


def pattern(seed: int, i: int, n: int) -> bytes:
    """Deterministic record bytes, so any side can check every byte of record i."""
    return np.random.default_rng([seed, i]).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def ring(job):
    r = Ring.create(segment_name(job, "n0", "ring"), 4096)
    yield r
    r.close()
    r.unlink()


def test_round_trip_in_order(ring):
    records = [b"", b"a", pattern(0, 1, 7), pattern(0, 2, 1000), pattern(0, 3, 8)]
    for rec in records:
        ring.write(rec, timeout=1)
    ring.write([b"ab", bytearray(b"cd"), memoryview(b"ef"), np.arange(2, dtype=np.uint16)], timeout=1)
    view = ring.reserve(5, timeout=1)
    view[:] = b"hello"
    ring.commit()
    expected = records + [b"abcdef\x00\x00\x01\x00", b"hello"]
    got = [bytes(ring.read(timeout=1)) for _ in expected]
    assert got == expected
    ring.release()
    assert ring.pending() == 0
    assert ring.try_read() is None


def test_capacity_is_rounded_to_power_of_two(job):
    for asked, cap in [(1, 4096), (4096, 4096), (5000, 8192), (1 << 20, 1 << 20)]:
        with Ring.create(segment_name(job, "n0", f"c{asked}"), asked) as r:
            assert (r.capacity, r.max_record) == (cap, cap - 8)
            r.unlink()


def test_max_record_fits_and_wraps(ring):
    big = pattern(1, 0, ring.max_record)  # must wrap to offset 0 and fill the whole ring
    got = []

    def consume():
        got.append(bytes(ring.read(timeout=5)))
        got.append(bytes(ring.read(timeout=5)))  # skips the wrap pad while waiting
        ring.release()

    reader = threading.Thread(target=consume)
    reader.start()
    ring.write(b"x" * 100, timeout=1)
    ring.write(big, timeout=5)  # waits for the reader to free the first record and the pad
    reader.join(timeout=10)
    assert got == [b"x" * 100, big]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 4088), max_size=40), seed=st.integers(0, 2**16))
def test_any_size_sequence_round_trips(job, sizes, seed):
    """Interleaved writes and reads of arbitrary sizes (wrap-around included) keep every byte."""
    name = segment_name(job, "n0", f"h{seed}")
    with Ring.create(name, 4096) as r:
        r.unlink()
        outstanding = []
        for i, n in enumerate(sizes):
            while True:
                try:
                    r.write(pattern(seed, i, n), timeout=0)
                    outstanding.append(i)
                    break
                except RingTimeout:
                    if outstanding:
                        j = outstanding.pop(0)
                        assert bytes(r.read(timeout=0)) == pattern(seed, j, sizes[j])
                    else:  # only the held view or a wrap pad is left: the consumer frees it
                        assert r.try_read() is None
        for j in outstanding:
            assert bytes(r.read(timeout=0)) == pattern(seed, j, sizes[j])
        r.release()
        assert r.pending() == 0


def test_oversized_record_raises_immediately(ring):
    t0 = time.monotonic()
    with pytest.raises(RingFullError) as e:
        ring.write(b"x" * 4089, timeout=10)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "4089 B" in msg and "capacity 4096 B" in msg and "raise BatchSpec.ring_bytes" in msg
    with pytest.raises(RingFullError):
        ring.reserve(1 << 20, timeout=10)


def test_read_times_out_on_empty_ring(ring):
    t0 = time.monotonic()
    with pytest.raises(RingTimeout, match=ring.name):
        ring.read(timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5  # generous upper bound: CI machines are busy


def test_write_times_out_on_full_ring(ring):
    ring.write(b"x" * 3000, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(RingTimeout, match="no space"):
        ring.write(b"y" * 2000, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5  # generous upper bound: CI machines are busy


def test_blocked_read_wakes_on_write_from_another_thread(ring):
    threading.Timer(0.1, lambda: ring.write(b"late", timeout=1)).start()
    t0 = time.monotonic()
    assert bytes(ring.read(timeout=5)) == b"late"
    assert time.monotonic() - t0 < 4  # woken, not timed out (5 s)


def test_close_writer_drains_then_closed(ring):
    ring.write(b"one", timeout=1)
    ring.write(b"two", timeout=1)
    ring.close_writer()
    assert ring.closed
    assert bytes(ring.read(timeout=1)) == b"one"
    assert bytes(ring.try_read()) == b"two"
    with pytest.raises(RingClosed):
        ring.read(timeout=1)
    with pytest.raises(RingClosed):
        ring.try_read()
    with pytest.raises(RingClosed, match="after close_writer"):
        ring.write(b"three", timeout=1)


def test_error_slot_surfaces_after_ready_records(ring):
    assert ring.error is None
    ring.write(b"before", timeout=1)
    ring.set_error("loader 3 on node n0: source 'web' file f.parquet row 7: bad UTF-8")
    ring.set_error("a later consequence")  # first error wins
    assert bytes(ring.read(timeout=1)) == b"before"
    with pytest.raises(RingError, match=r"source .web. file f\.parquet row 7") as e:
        ring.read(timeout=1)
    assert type(e.value) is RingError
    with pytest.raises(RingError, match="source 'web'"):
        ring.try_read()


def test_error_message_is_truncated_on_a_character_boundary(ring):
    ring.set_error("é" * 2000)  # 4000 bytes of UTF-8
    msg = ring.error
    assert msg == "é" * 1023 and len(msg.encode()) <= 2047


def test_segment_mode_is_0600(ring):
    mode = os.stat("/dev/shm/" + ring.name[1:]).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_create_refuses_existing_segment(ring):
    with pytest.raises(RingError, match="already exists"):
        Ring.create(ring.name, 4096)


def test_attach_waits_for_creator(job):
    name = segment_name(job, "n0", "late")
    made = []
    threading.Timer(0.2, lambda: made.append(Ring.create(name, 8192))).start()
    with Ring.attach(name, timeout=5) as r:
        assert r.capacity == 8192 and r.creator_pid == os.getpid()
    made[0].close()
    made[0].unlink()


def test_attach_times_out_naming_segment(job):
    name = segment_name(job, "n0", "never")
    t0 = time.monotonic()
    with pytest.raises(RingTimeout, match=name):
        Ring.attach(name, timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_attach_rejects_foreign_segment(job):
    name = segment_name(job, "n0", "junk")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=8192)
    os.write(shm.fd, b"not a ring" * 100)
    shm.close_fd()
    try:
        with pytest.raises(RingError, match="not a usable Overlord ring"):
            Ring.attach(name, timeout=1)
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_previous_view_is_invalidated_by_next_read(ring):
    ring.write(b"first", timeout=1)
    ring.write(b"second", timeout=1)
    first = ring.read(timeout=1)
    ring.read(timeout=1)
    with pytest.raises(ValueError):
        bytes(first)  # released: a stale read fails loudly instead of seeing new bytes


def test_close_with_live_arrays_does_not_crash(job):
    r = Ring.create(segment_name(job, "n0", "views"), 4096)
    r.unlink()
    write_batch(r, {"x": np.arange(10, dtype=np.int32)}, timeout=1)
    tensors, _ = decode_batch(r.read(timeout=1))
    r.close()  # the array still exports the mapping: unmapping is deferred, not an error
    r.close()
    assert tensors["x"].sum() == 45
    with pytest.raises(RingError, match="closed"):
        r.read(timeout=0)


def test_claims_record_pids_and_refuse_a_second_live_claimant(ring):
    assert ring.producer_pid is None and ring.consumer_pid is None
    ring.claim_producer()
    ring.claim_consumer(os.getpid())
    assert ring.producer_pid == ring.consumer_pid == os.getpid()
    with pytest.raises(RingError, match="already claimed"):
        ring.claim_producer(1)  # this process is alive and holds it
    ring.claim_producer(os.getpid())  # re-claiming one's own side is fine
