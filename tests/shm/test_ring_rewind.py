"""A ring's memory follows what is in it, not its capacity.

The producer rewinds to the start of the data area once twice its peak fill fits in
front of the consumer (native/ring.h), and reserves /dev/shm pages only as its records
reach them (overlord/shm/_segment.py). So a ring sized for a burst holds in /dev/shm
about three times its peak fill. The segment's allocated blocks (st_blocks of
its tmpfs file) are what the ring costs the machine.
"""

from __future__ import annotations

import os
import random

import pytest

from overlord.errors import RingTimeout
from overlord.shm import Ring, segment_name
from overlord.shm._segment import RESERVE_STEP

pytestmark = pytest.mark.timeout(60)

HEADER = 4096


def _allocated(ring: Ring) -> int:
    return os.stat("/dev/shm/" + ring.name.lstrip("/")).st_blocks * 512


def _record(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


@pytest.fixture
def big_ring(job):
    ring = Ring.create(segment_name(job, "n0", "rewind"), 16 << 20)
    yield ring
    ring.close()
    ring.unlink()


def test_a_ring_read_as_it_is_written_stays_in_its_first_pages(big_ring):
    assert _allocated(big_ring) == HEADER + RESERVE_STEP
    for i in range(4000):  # 40 MB through a 16 MiB ring: without rewinding it would touch all of it
        record = _record(i, 10_000 + i % 700)
        big_ring.write(record, timeout=1)
        assert bytes(big_ring.read(timeout=1)) == record
    big_ring.release()
    assert _allocated(big_ring) == HEADER + RESERVE_STEP


def test_a_ring_with_records_in_it_rewinds_once_twice_its_peak_fits_in_front(big_ring):
    held, n = [], 0
    for _ in range(8):  # 8 records of 64 KiB stay in the ring while 2,000 go through
        record = _record(n, 64 << 10)
        big_ring.write(record, timeout=1)
        held.append(record)
        n += 1
    for _ in range(2000):
        record = _record(n, 64 << 10)
        big_ring.write(record, timeout=1)
        held.append(record)
        n += 1
        assert bytes(big_ring.read(timeout=1)) == held.pop(0)
    big_ring.release()
    peak = 9 * ((64 << 10) + 8)
    # positions stay below three times the peak fill and a record, plus the reservation step
    assert _allocated(big_ring) <= HEADER + 3 * peak + (64 << 10) + 2 * RESERVE_STEP
    assert _allocated(big_ring) < (16 << 20) // 4


def test_a_burst_reserves_pages_and_any_interleaving_reads_back_in_order(big_ring):
    rng = random.Random(7)
    queue, n = [], 0
    for _ in range(3000):
        if queue and rng.random() < 0.5:
            assert bytes(big_ring.read(timeout=1)) == queue.pop(0)
            continue
        size = rng.choice((0, 1, 8, 4088, 65_536, 1 << 20, rng.randrange(0, 3 << 20)))
        record = _record(n, size)
        try:
            big_ring.write(record, timeout=0)
        except RingTimeout:
            continue  # no room: this thread is also the consumer, so waiting would wait for ever
        queue.append(record)
        n += 1
    while queue:
        assert bytes(big_ring.read(timeout=1)) == queue.pop(0)
    big_ring.release()
    assert big_ring.pending() == 0
    assert _allocated(big_ring) > HEADER + RESERVE_STEP  # the bursts reached further pages, reserved first
