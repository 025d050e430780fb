"""Waking a ring's consumer once per run of records: `commit(wake=False)`, then `wake()`.

The consumer here sleeps in one futex wait for the whole test (its peer-check slice is
raised to 30 s), so it returns only when the producer really wakes it: a record that
landed unannounced must not wake it, `wake()` must, and so must the producer's own
wait for space on another ring (the consumer of the first may be what it waits on).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from overlord.errors import RingTimeout
from overlord.shm import Ring, _pyring, decode_batch, segment_name, write_batch


@pytest.fixture
def one_slice(monkeypatch):
    monkeypatch.setattr(_pyring, "PEER_CHECK_S", 30.0)


class Reader:
    """A thread that reads one record of `ring` (a consumer's Ring object) and notes when."""

    def __init__(self, ring: Ring) -> None:
        self.got: list[bytes] = []
        self.at = 0.0
        self.thread = threading.Thread(target=self._read, args=(ring,), daemon=True)
        self.thread.start()
        time.sleep(0.3)  # asleep on the empty ring by now

    def _read(self, ring: Ring) -> None:
        self.got.append(bytes(ring.read(timeout=20)))
        self.at = time.monotonic()
        ring.release()


def test_a_quiet_commit_lands_unannounced_until_wake(job, one_slice):
    name = segment_name(job, "n0", "quiet")
    with Ring.create(name, 4096) as producer, Ring.attach(name, 1) as consumer:
        reader = Reader(consumer)
        view = producer.reserve(3, timeout=1)
        view[:] = b"abc"
        producer.commit(wake=False)
        assert producer.pending() > 0  # published: a reader that looks sees it
        reader.thread.join(0.5)
        assert reader.thread.is_alive() and reader.got == []  # but the sleeping one was not woken
        producer.wake()
        reader.thread.join(5)
        assert not reader.thread.is_alive() and reader.got == [b"abc"]
        producer.wake()  # nothing left unwoken: no-op
        producer.unlink()


def test_a_wait_for_space_wakes_every_unwoken_ring_first(job, one_slice):
    """The producer waits on ring B while ring A holds a record it has not woken A's
    consumer for: the wait wakes A's consumer before it sleeps."""
    a_name, b_name = segment_name(job, "n0", "a"), segment_name(job, "n0", "b")
    with Ring.create(a_name, 4096) as a, Ring.attach(a_name, 1) as a_consumer, Ring.create(b_name, 4096) as b:
        reader = Reader(a_consumer)
        write_batch(a, {"ids": np.arange(5, dtype=np.int32)}, {"k": 1}, timeout=1, wake=False)
        b.write(b"x" * 3000, timeout=1)  # nobody reads B: the next write waits for space
        with pytest.raises(RingTimeout):
            b.write(b"y" * 3000, timeout=1.0)
        gave_up = time.monotonic()
        reader.thread.join(5)
        assert not reader.thread.is_alive() and len(reader.got) == 1
        assert reader.at < gave_up  # woken when the wait began, not after it
        tensors, meta = decode_batch(reader.got[0])
        assert tensors["ids"].tolist() == [0, 1, 2, 3, 4] and meta == {"k": 1}
        a.unlink()
        b.unlink()


def test_commit_wakes_by_default(job, one_slice):
    name = segment_name(job, "n0", "loud")
    with Ring.create(name, 4096) as producer, Ring.attach(name, 1) as consumer:
        reader = Reader(consumer)
        producer.write(b"now", timeout=1)
        reader.thread.join(5)
        assert reader.got == [b"now"]
        producer.unlink()
