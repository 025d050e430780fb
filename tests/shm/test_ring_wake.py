"""Waking a ring's consumer once per run of records (`commit(wake=False)`, then `wake()`),
and a watcher of consumer marks when one moves (`wait_marks`).

The consumer here sleeps in one futex wait for the whole test (its peer-check slice is
raised to 30 s), so it returns only when the producer really wakes it: a record that
landed unannounced must not wake it, `wake()` must, and so must the producer's own
wait for space on another ring (the consumer of the first may be what it waits on).
"""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest

from overlord.errors import RingTimeout
from overlord.shm import Ring, _pyring, decode_batch, segment_name, wait_marks, write_batch


@pytest.fixture
def one_slice(monkeypatch):
    monkeypatch.setattr(_pyring, "PEER_CHECK_S", 30.0)


def _asleep_in(thread: threading.Thread, name: str) -> bool:
    """Whether `thread` sleeps in a futex wait on a word of the segment `name` (not on
    the GIL or anything else of this process): its current system call, by /proc."""
    with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
        call = f.read().split()
    if not call or call[0] != "202":  # futex, on x86-64
        return False
    word = int(call[1], 16)
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(f"/dev/shm/{name.lstrip('/')}"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= word < hi:
                    return True
    return False


class Reader:
    """A thread that reads one record of `ring` (a consumer's Ring object) and notes when."""

    def __init__(self, ring: Ring, name: str) -> None:
        self.got: list[bytes] = []
        self.at = 0.0
        self.thread = threading.Thread(target=self._read, args=(ring,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10  # not a fixed sleep: a busy machine may start it late
        while not _asleep_in(self.thread, name):
            assert self.thread.is_alive() and time.monotonic() < deadline, "the reader never slept on the ring"
            time.sleep(0.01)

    def _read(self, ring: Ring) -> None:
        self.got.append(bytes(ring.read(timeout=20)))
        self.at = time.monotonic()
        ring.release()


def test_a_quiet_commit_lands_unannounced_until_wake(job, one_slice):
    name = segment_name(job, "n0", "quiet")
    with Ring.create(name, 4096) as producer, Ring.attach(name, 1) as consumer:
        reader = Reader(consumer, name)
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
        reader = Reader(a_consumer, a_name)
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
        reader = Reader(consumer, name)
        producer.write(b"now", timeout=1)
        reader.thread.join(5)
        assert reader.got == [b"now"]
        producer.unlink()


# -- a watcher of consumer marks (a Data Constructor host's mark poller) ---------------

# one sleep on many futex words (futex_waitv) came with Linux 5.16; before, the watcher
# looks every `poll` seconds, and a wake-up long before that cannot be asked of it
_KERNEL = tuple(int(p) for p in re.findall(r"\d+", os.uname().release)[:2])
needs_waitv = pytest.mark.skipif(_KERNEL < (5, 16), reason="futex_waitv needs Linux 5.16")


@needs_waitv
def test_wait_marks_sleeps_until_a_mark_moves(job):
    names = [segment_name(job, "n0", f"m{i}") for i in range(3)]
    rings = [Ring.create(n, 4096) for n in names]
    try:
        assert wait_marks(rings, None, 5.0, 0.002) == (0, 0, 0)  # None: the marks now, at once
        t0 = time.monotonic()
        assert wait_marks(rings, (0, 0, 0), 0.3, 0.002) == (0, 0, 0)  # nothing moved: the timeout
        assert time.monotonic() - t0 >= 0.29
        threading.Timer(0.3, rings[2].set_consumer_mark, args=(7,)).start()
        t0 = time.monotonic()
        assert wait_marks(rings, (0, 0, 0), 20.0, 20.0) == (0, 0, 7)  # woken, not a look 20 s later
        assert 0.25 <= time.monotonic() - t0 < 5
        rings[0].set_consumer_mark(3)  # moved before the call: returns at once
        assert wait_marks(rings, (0, 0, 7), 20.0, 20.0) == (3, 0, 7)
    finally:
        for ring in rings:
            ring.close()
            ring.unlink()


MARKER = """
import sys, time
from overlord.shm import Ring
ring = Ring.attach(sys.argv[1], timeout=10)
print("ready", flush=True)
time.sleep(0.5)
ring.set_consumer_mark(int(sys.argv[2]))
ring.close()
"""


@needs_waitv
def test_a_consumer_in_another_process_wakes_the_watcher(job, spawn):
    """The mark words are shared futexes: a trainer process's mark wakes the host's watcher."""
    name = segment_name(job, "n0", "xmark")
    with Ring.create(name, 4096) as ring:
        child = spawn(MARKER, name, 41)
        child.ready()
        t0 = time.monotonic()
        assert wait_marks([ring], (0,), 20.0, 20.0) == (41,)
        assert time.monotonic() - t0 < 10
        child.finish()
        ring.unlink()
