"""Leased reading: a record stays intact while anything references it, leases end in any
order, a consumer that holds more than the ring gets copies (never overwritten bytes,
never a deadlock), and a producer in another process sees the same."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlord.errors import RingClosed
from overlord.shm import Ring, segment_name
from overlord.shm._lease import LeasedReader


def pattern(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def pair(job):
    name = segment_name(job, "n0", "lease")
    producer = Ring.create(name, 16384)
    consumer = Ring.attach(name, timeout=1)
    consumer.claim_consumer()
    producer.claim_producer()
    yield producer, consumer, LeasedReader(consumer)
    consumer.close()
    producer.close()
    producer.unlink()


def test_a_held_record_keeps_its_bytes_while_later_ones_are_read(pair):
    producer, _, reader = pair
    held = []
    for i in range(40):  # 40 x 3000 B through a 16 KiB ring: it wraps many times
        producer.write(pattern(i, 3000), timeout=1)
        rec = reader.read(timeout=1)
        held.append((i, rec))
        if len(held) > 3:  # hold the last three, like a loop with prefetch and a logger
            j, old = held.pop(0)
            assert bytes(old) == pattern(j, 3000)
            del old
    for j, rec in held:
        assert bytes(rec) == pattern(j, 3000)
    assert reader.copies == 0, "four 3 KiB records fit a 16 KiB ring: nothing needed a copy"


def test_leases_end_in_any_order_and_the_tail_follows_the_oldest(pair):
    producer, consumer, reader = pair
    for i in range(3):
        producer.write(pattern(i, 1000), timeout=1)
    a, b, c = (reader.read(timeout=1) for _ in range(3))
    used = consumer.pending()
    del b
    assert consumer.pending() == used, "b ended, but a before it is still held"
    del a
    assert 0 < consumer.pending() < used, "a and b ended: only c is held"
    assert bytes(c) == pattern(2, 1000)
    del c
    assert consumer.pending() == 0


def test_derived_views_and_tensors_hold_the_lease(pair):
    import torch

    producer, consumer, reader = pair
    producer.write(pattern(7, 4096), timeout=1)
    rec = reader.read(timeout=1)
    tensor = torch.from_numpy(rec[64:128].view(np.int64))
    expected = tensor.clone()
    del rec
    gc.collect()
    assert consumer.pending() > 0, "the tensor still references the record"
    for i in range(20):  # the producer would reuse the space if the lease had ended
        try:
            producer.write(pattern(100 + i, 2000), timeout=0.05)
            del_ = reader.read(timeout=1)
            del del_
        except Exception:  # noqa: BLE001 - RingTimeout: the ring is full, as it should be
            break
    assert torch.equal(tensor, expected)
    del tensor
    gc.collect()
    assert reader.held() == 0


def test_a_consumer_holding_more_than_the_ring_gets_copies_not_a_deadlock(pair):
    producer, _, reader = pair
    done = threading.Event()

    def produce():
        for i in range(30):
            producer.write(pattern(i, 5000), timeout=10)
        producer.close_writer()
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    kept = []
    while True:  # keeps every record: 150 KB through a 16 KiB ring
        try:
            kept.append(reader.read(timeout=10))
        except RingClosed:
            break
    t.join(timeout=10)
    assert done.is_set()
    assert [bytes(r) for r in kept] == [pattern(i, 5000) for i in range(30)]
    assert reader.copies >= 25 and reader.copied_bytes >= 25 * 5000


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 6000), st.integers(0, 4)), min_size=1, max_size=60))
def test_any_sizes_and_holding_pattern_delivers_every_byte(job, plan):
    """Records of any size, each held for 0-4 further reads: every record reads back
    intact at the end of its hold, whatever wrapped, ended out of order or was copied."""
    name = segment_name(job, "n0", f"prop{len(plan)}-{plan[0][0]}")
    producer = Ring.create(name, 16384)
    consumer = Ring.attach(name, timeout=1)
    reader = LeasedReader(consumer)
    try:

        def produce():
            for i, (n, _) in enumerate(plan):
                producer.write(pattern(i, n), timeout=10)
            producer.close_writer()

        t = threading.Thread(target=produce)
        t.start()
        held: list[tuple[int, int, np.ndarray]] = []
        for i, (_n, hold) in enumerate(plan):
            held.append((i + hold, i, reader.read(timeout=10)))
            for entry in [e for e in held if e[0] <= i]:
                assert bytes(entry[2]) == pattern(entry[1], plan[entry[1]][0])
                held.remove(entry)
        for _, j, rec in held:
            assert bytes(rec) == pattern(j, plan[j][0])
        held.clear()
        with pytest.raises(RingClosed):
            reader.read(timeout=5)
        t.join(timeout=10)
    finally:
        consumer.close()
        producer.close()
        producer.unlink()


def test_a_producer_in_another_process_never_overwrites_a_held_record(job, spawn):
    name = segment_name(job, "n0", "xproc")
    consumer = Ring.create(name, 65536)
    consumer.claim_consumer()
    child = spawn(
        """
        import sys
        import numpy as np
        from overlord.shm import Ring
        ring = Ring.attach(sys.argv[1], timeout=5)
        ring.claim_producer()
        print("ready", flush=True)
        for i in range(200):
            ring.write(np.random.default_rng(i).integers(0, 256, 9000, dtype=np.uint8).tobytes(), timeout=30)
        ring.close_writer()
        """,
        name,
    )
    child.ready()
    reader = LeasedReader(consumer)
    held, kept = [], []
    try:
        for i in range(200):
            held.append((i, reader.read(timeout=30)))
            if i % 50 == 0:
                kept.append(held[-1])  # held for the rest of the run
            if len(held) > 5:
                j, rec = held.pop(0)
                assert bytes(rec) == pattern(j, 9000)
        for j, rec in held + kept:
            assert bytes(rec) == pattern(j, 9000)
        assert reader.copies > 0, "records kept for the whole run must have been copied out"
        child.finish()
    finally:
        held.clear()
        kept.clear()
        consumer.close()
        consumer.unlink()


def test_a_second_open_reader_of_one_ring_in_a_process_is_refused(pair):
    from overlord.errors import RingError

    _, consumer, reader = pair
    again = Ring.attach(consumer.name, timeout=1)
    try:
        with pytest.raises(RingError, match="already read by another open reader in this process"):
            LeasedReader(again)
        reader.close()
        LeasedReader(again).close()  # once the first is closed, a new one may read
    finally:
        again.close()


def test_a_forked_child_never_ends_its_parents_leases(pair):
    import os

    producer, consumer, reader = pair
    for i in range(2):
        producer.write(pattern(i, 3000), timeout=1)
    held = [reader.read(timeout=1) for _ in range(2)]
    used = consumer.pending()
    pid = os.fork()
    if pid == 0:  # the child drops its copies of the records and collects them
        held.clear()
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    assert consumer.pending() == used, "the child's copies died: the parent's leases must stand"
    assert [bytes(r) for r in held] == [pattern(i, 3000) for i in range(2)]


def test_a_tail_moved_under_the_leases_is_an_error_not_silence(pair):
    from overlord.errors import RingError

    producer, consumer, reader = pair
    for i in range(3):
        producer.write(pattern(i, 1000), timeout=1)
    a = reader.read(timeout=1)
    b = reader.read(timeout=1)
    consumer._handle().release_to(consumer._handle().tail + 2 * 1008 + 16)  # someone else consumed past both
    del a, b
    with pytest.raises(RingError, match="tail moved past .* batches held here may have been overwritten"):
        reader.read(timeout=1)
