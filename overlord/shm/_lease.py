"""Leased reading of a ring: records stay valid for as long as anything references them.

A plain `Ring.read()` hands out a view that is valid until the next read, which is not
a contract a training loop can keep: Lightning holds batch i while it fetches i+1, a
logger keeps a batch, gradient accumulation keeps several. `LeasedReader` hands out
each record as a numpy uint8 array over the ring's mapping (zero-copy) and holds the
record's space as a *lease* until that array, and every array, tensor or view derived
from it, is garbage (a `weakref.finalize` on the array). Leases end in any order; the
ring's tail moves over the oldest records once they are all released.

Never overwritten bytes, never a deadlock. A consumer may hold more than the ring can
lease: it then waits for data while the producer waits for space its leases hold. The
producer wakes it when it starts waiting (native/ring.c `wait_space`), and the reader
*detaches* what it holds: the pages under every live lease get a private copy of their
bytes at the same address (anonymous memory, `Handle.detach`), the leases end, and the
ring is mapped again for later records (the old mapping lives while its arrays do).
Those copies are counted (`copies`, `copied_bytes`) for metrics and `overlord status`.

Threads: leases end on whichever thread drops the last reference (a prefetch thread, the
garbage collector inside any allocation). Ending one takes no lock that thread could
already hold: it queues the record and whoever holds the lock (or the next caller)
moves the tail.

Layout of the bookkeeping (counter values as in native/ring.h, `tail <= cursor`)::

    tail                                       cursor                    head
     | rec A (live) | WRAP | rec B (ended) | rec C (live) |  unread ...   |
       _held: [A.start, A.end, live] [A.end, C.start, ended] ... in ring order

A consumer that leases must not also use `Ring.read()` on the same ring, and one
process has at most one open reader of a ring: a second one would move the tail under
the first one's leases (refused). A forked child never ends its parent's leases (its
copies of the arrays die with it), and a tail that moved under the bookkeeping is an
error at the next read, never a silent overwrite.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque

import numpy as np

from overlord.errors import PeerDied, RingError, RingTimeout
from overlord.shm import _ring as _native
from overlord.shm._pyring import PEER_CHECK_S, Ring

_LIVE, _ENDED = True, False


class LeasedReader:
    """The consumer side of one ring, handing out records as leases.

    Args:
        ring: a Ring whose consumer side this process claimed.
    """

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        h = ring._handle()
        self._identity = (ring.name, h.creator_pid)
        ref = _READERS.get(self._identity)
        other = ref() if ref is not None else None
        if other is not None and other._open():
            raise RingError(
                f"ring {ring.name!r} is already read by another open reader in this process (pid {os.getpid()}); "
                "close the other DataLoader of this rank before making a new one"
            )
        _READERS[self._identity] = weakref.ref(self)
        self._pid = os.getpid()
        self._cursor = h.tail
        self._held: deque[list[int]] = deque()  # [start, end, live] per record, in ring order
        self._ended: deque[int] = deque()  # starts of records whose last reference died
        self._lock = threading.Lock()
        self._broken: str | None = None  # the tail moved under the leases: said at the next read
        self.leased = 0  # records handed out zero-copy
        self.copies = 0  # records copied out from under the consumer (it held too much)
        self.copied_bytes = 0

    # ------------------------------------------------------------------ reading
    def read(self, timeout: float) -> np.ndarray:
        """The next record as a uint8 array over the ring, leased until it is garbage.

        Raises:
            RingTimeout, RingClosed, RingError, PeerDied: as `Ring.read`.
        """
        ring = self.ring
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + PEER_CHECK_S
        while True:
            record = self.try_read()
            if record is not None:
                return record
            now = time.monotonic()
            if now >= next_check:
                try:
                    ring._check_peer("producer")
                except PeerDied:
                    record = self.try_read()  # its last record may have landed
                    if record is not None:
                        return record
                    raise
                next_check = now + PEER_CHECK_S
            h = ring._handle()
            if now >= deadline:
                raise RingTimeout(
                    f"ring {ring.name!r}: no record within {timeout:.3g} s "
                    f"(producer pid {h.producer_pid or 'unclaimed'})"
                )
            h.wait_data_at(self._cursor, bool(self._held), min(deadline - now, PEER_CHECK_S))

    def try_read(self) -> np.ndarray | None:
        """The next record as `read` hands it out, or None if none has landed; never
        waits. A producer waiting for space the leases hold gets it (they are detached).

        Raises:
            RingClosed, RingError: as `Ring.read` (a dead producer is `read`'s to find).
        """
        ring = self.ring
        while True:
            self._settle()
            if self._broken is not None:
                raise RingError(self._broken)
            h = ring._handle()
            status, off, n, nxt = h.peek(self._cursor)
            if status == _native.OK:
                return self._hand_out(off, n, nxt)
            if status == _native.EAGAIN and nxt != self._cursor:  # a lone WRAP record
                self._skip_to(nxt)
                continue
            ring._raise_read_status(status)
            if h.space_wanted and self._pinning():
                self._detach()
                continue
            return None

    def held(self) -> int:
        """Records handed out whose lease has not ended."""
        with self._lock:
            return sum(1 for e in self._held if e[2] is _LIVE)

    def close(self) -> None:
        """Stop tracking: live leases keep their mapping alive; the ring is the caller's."""
        with self._lock:
            self._held.clear()
            self._ended.clear()
            self._closed = True

    _closed = False

    def _open(self) -> bool:
        if self._closed:
            return False
        try:
            self.ring._handle()
        except RingError:
            return False  # its ring was closed in this process
        return True

    # ------------------------------------------------------------------ leases
    def _hand_out(self, off: int, n: int, nxt: int) -> np.ndarray:
        start = self._cursor
        view = self.ring._mv
        if view is None:
            raise RingError(f"ring {self.ring.name!r} was closed in this process")
        record = np.frombuffer(view, dtype=np.uint8, count=n, offset=off)
        with self._lock:
            self._held.append([start, nxt, _LIVE])
        self._cursor = nxt
        self.leased += 1
        end = weakref.finalize(record, _end_lease, weakref.ref(self), start, self._pid)
        end.atexit = False  # an exiting process does not tend the ring
        return record

    def _skip_to(self, nxt: int) -> None:
        with self._lock:
            self._held.append([self._cursor, nxt, _ENDED])
        self._cursor = nxt
        self._settle()  # nothing else may end before the producer needs the WRAP's space

    def _end(self, start: int) -> None:
        self._ended.append(start)  # atomic; never blocks the thread dropping the record
        self._settle()

    def _settle(self) -> None:
        """Mark ended leases and move the ring's tail over the ended prefix."""
        while True:
            if not self._lock.acquire(blocking=False):
                return  # its holder settles what we queued before it lets go
            try:
                ended = set()
                while self._ended:
                    ended.add(self._ended.popleft())
                for e in self._held:
                    if e[0] in ended:
                        e[2] = _ENDED
                tail = None
                while self._held and self._held[0][2] is _ENDED:
                    tail = self._held.popleft()[1]
                if tail is not None:
                    self._release_to(tail)
            finally:
                self._lock.release()
            if not self._ended:
                return

    def _release_to(self, tail: int) -> None:
        try:
            h = self.ring._handle()
        except RingError:
            return  # the ring was closed here; its space is no longer ours to manage
        if not h.release_to(tail) and self._broken is None:
            # someone else moved the tail (another consumer of this ring?): records this
            # process still holds may have been overwritten; never go on silently
            self._broken = (
                f"ring {self.ring.name!r}: its tail moved past {tail} under this reader's leases (now {h.tail}); "
                "another process or reader consumed this ring, so batches held here may have been overwritten"
            )

    def _pinning(self) -> bool:
        with self._lock:
            return bool(self._held)

    def _detach(self) -> None:
        """Copy every live lease's pages privately, end the leases, map the ring anew."""
        h = self.ring._handle()
        cap = h.capacity
        with self._lock:
            for start, end, live in self._held:
                if live is not _LIVE:
                    continue
                for off, length in _ranges(start, end, cap):
                    if not h.detach(_native.HEADER_SIZE + off, length):
                        raise RingError(
                            f"ring {self.ring.name!r}: the consumer holds {len(self._held)} records that fill the "
                            "ring and this system's pages are larger than the ring header, so they cannot be "
                            "copied out; release batches sooner, raise BatchSpec.ring_bytes, or pass copy=True"
                        )
                self.copies += 1
                self.copied_bytes += end - start
            tail = self._held[-1][1]
            self._held.clear()
            self._ended.clear()  # their records are private memory now
            self.ring._remap()
            self._release_to(tail)


_READERS: dict[tuple[str, int], weakref.ref[LeasedReader]] = {}  # (ring name, creator pid) -> its reader here


def _end_lease(reader_ref: weakref.ref[LeasedReader], start: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child's copy of the record died; the parent still holds it
    reader = reader_ref()
    if reader is not None:
        reader._end(start)


def _ranges(start: int, end: int, capacity: int) -> list[tuple[int, int]]:
    """The data-area ranges (offset, length) of counter range [start, end)."""
    lo, n = start % capacity, end - start
    if lo + n <= capacity:
        return [(lo, n)]
    return [(lo, capacity - lo), (0, n - (capacity - lo))]
