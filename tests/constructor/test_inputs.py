"""A Data Constructor reads loader rings in place (one copy on the node): records are
views over the ring until the step that uses them is packed; a constructor that keeps
more than the ring holds, polling only, gets copies instead of a deadlock or an
overwritten sample; a ring taken from a live reader is read by copy."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid

import numpy as np
import pytest

from overlord.constructor.inputs import CopiedInput, LeasedInput, open_input
from overlord.shm import Ring, decode_batch, list_segments, segment_name, unlink_all, write_batch


@pytest.fixture
def ring():
    job = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    name = segment_name(job, "n0", "sample")
    producer = Ring.create(name, 16384)
    producer.claim_producer()
    consumer = Ring.attach(name, timeout=1)
    yield producer, consumer
    consumer.close()
    producer.close()
    producer.unlink()
    left = list_segments(job)
    unlink_all(job)
    assert not left, f"segments left behind: {left}"


def sample(i: int, n: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.random.default_rng(i).integers(0, 50_000, n, dtype=np.int64)}


def test_a_record_is_read_in_place_and_its_arrays_are_views_over_the_ring(ring):
    producer, consumer = ring
    source = open_input(consumer, take_over=False)
    assert isinstance(source, LeasedInput)
    write_batch(producer, sample(1, 300), {"k": "a:0:1"}, timeout=1)
    arrays, meta = decode_batch(source.try_read())
    mapping = np.frombuffer(consumer._mv, dtype=np.uint8)
    assert np.shares_memory(arrays["input_ids"], mapping), "the sample was copied out of the ring"
    assert np.array_equal(arrays["input_ids"], sample(1, 300)["input_ids"]) and meta == {"k": "a:0:1"}
    assert source.copies == 0


def test_a_poller_keeping_more_than_the_ring_holds_gets_copies_not_a_deadlock(ring):
    producer, consumer = ring
    source = open_input(consumer, take_over=False)
    done = threading.Event()

    def produce():  # 40 records of 2.4 KB through a 16 KiB ring
        for i in range(40):
            write_batch(producer, sample(i, 300), {"i": i}, timeout=10)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    kept = []
    deadline = threading.Event()
    timer = threading.Timer(20, deadline.set)
    timer.start()
    try:
        while len(kept) < 40 and not deadline.is_set():  # polling only, as the constructor between waits
            record = source.try_read()
            if record is not None:
                kept.append(decode_batch(record))
    finally:
        timer.cancel()
    t.join(timeout=10)
    assert done.is_set() and len(kept) == 40, "the producer waited for space the leases held"
    for i, (arrays, meta) in enumerate(kept):
        assert meta == {"i": i}
        assert np.array_equal(arrays["input_ids"], sample(i, 300)["input_ids"]), f"record {i} was overwritten"
    assert source.copies > 0


def test_a_ring_taken_from_a_live_reader_is_read_by_copy(ring):
    producer, consumer = ring
    other = subprocess.Popen(["sleep", "30"])  # a live process holding the consumer side
    try:
        consumer.claim_consumer(pid=other.pid)
        source = open_input(consumer, take_over=True)
        assert isinstance(source, CopiedInput)
        write_batch(producer, sample(2, 100), {"k": "b:0:2"}, timeout=1)
        arrays, _ = decode_batch(source.read(timeout=1))
        assert not np.shares_memory(arrays["input_ids"], np.frombuffer(consumer._mv, dtype=np.uint8))
        assert np.array_equal(arrays["input_ids"], sample(2, 100)["input_ids"])
        assert source.copies == 1 and consumer.pending() == 0, "the record was not released after its copy"
    finally:
        other.kill()
        other.wait()
