"""The shared-memory ring, Python side: segment lifecycle, waiting policy, errors.

A `Ring` carries variable-size records from one producer process to one consumer
process on the same node (Source Loader -> Data Constructor -> Client). The segment is
a POSIX shared-memory object, mode 0600, named by `overlord.shm.names`. The protocol
(`native/ring.h`) is in C; this module maps the segment, slices zero-copy views out of
the mapping, and turns status codes into errors that name the ring and the peer.

Segment layout (see native/ring.h for every field)::

    0      4096                                                4096 + capacity
    +------+---------------------------------------------------+
    |header| data area (power of two)                          |
    +------+---------------------------------------------------+
    header: magic "OVLRING1", version, capacity, creator/producer/consumer pid,
            closed flag, error slot (first error wins, <= 2047 B UTF-8),
            head (64 B line), tail (64 B line), futex seq + waiter words
    record: | len u32 | flags u32 | payload (len B) | pad to 8 |
            a WRAP record pads to the end so no record straddles it

Waiting: a blocked call sleeps on a futex in slices of at most `PEER_CHECK_S`; between
slices it checks the peer's pid (producer for reads, consumer for writes) and raises
`PeerDied` when that process is gone, so a crash on the other side is an error, never a
hang. Slicing in Python (not C) also keeps Ctrl-C responsive.

Waking: `commit()` wakes a consumer asleep on the ring. A producer that writes several
records in a row commits them with `commit(wake=False)` and wakes the consumer once,
with `wake()` after the last: one futex wake (and one wake-up of the consumer, its
thread switch and its turn for the GIL) per run of records, not per record. A process
never waits for space on any ring while it holds commits it has not woken: the wait
wakes them first, so a consumer whose progress the producer waits on is never left
asleep on records that have landed. A consumer asleep on unwoken records wakes by
itself at its next slice (`PEER_CHECK_S`) at the latest.

Lifetime of views: `read()` returns a view valid until the next `read()`/`try_read()`
/`release()`/`close()`; then the bytes may be overwritten by the producer. Arrays built
on a view (`decode_batch`) follow the same rule: copy what must outlive it. A consumer that must hold records longer reads them
with `overlord.shm._lease.LeasedReader` instead.

One Ring object serves one producer thread and/or one consumer thread; it is not a
general thread-safe object.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from typing import Any

from overlord.errors import PeerDied, RingClosed, RingError, RingFullError, RingTimeout
from overlord.shm import _ring as _native
from overlord.shm._note import CONSUMER_NOTE, PRODUCER_NOTE, read_note, write_note
from overlord.shm._proc import peer_alive, self_identity
from overlord.shm._segment import (
    RESERVE_STEP,
    attach_segment,
    create_segment,
    first_reserved,
    reserve_pages,
    unlink_segment,
)

PEER_CHECK_S = 0.05  # how often a blocked call checks that its peer is alive
# rings this process committed to without waking their consumer (`Ring.commit(wake=False)`)
_UNWOKEN: set[Ring] = set()
_NEXT_HEADER = 16  # a record's end, 8-aligned, plus the header written there next (a record's or a WRAP's)


class Ring:
    """One side's handle on a shared-memory ring. Build with `create` or `attach`."""

    def __init__(self, name: str, mm: mmap.mmap, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("use Ring.create(name, capacity) or Ring.attach(name, timeout)")
        self._name = name
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._h: _native.Handle = _native.Handle(mm)
        self._read_view: memoryview | None = None
        self._res_view: memoryview | None = None
        self._next_poll_check = 0.0  # try_read's rate limit on peer checks
        self._reserved = first_reserved(len(mm))  # producer: segment bytes known reserved in /dev/shm

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, name: str, capacity: int) -> Ring:
        """Create and initialise a new ring segment (mode 0600).

        Args:
            name: Segment name from `overlord.shm.segment_name` (leading '/').
            capacity: Data bytes; rounded up to a power of two, at least 4096.

        Returns:
            The creator's Ring; the caller then claims the producer or consumer side.

        Raises:
            RingError: The segment already exists, or capacity is out of range.
        """
        return cls(name, create_segment(name, capacity), _token=_PRIVATE)

    @classmethod
    def attach(cls, name: str, timeout: float) -> Ring:
        """Map an existing ring, waiting until it exists and its header is initialised.

        Args:
            name: Segment name (leading '/').
            timeout: Seconds to wait for the creator.

        Raises:
            RingTimeout: The segment did not appear (initialised) within `timeout`.
            RingError: The segment is not an Overlord ring or has another version.
        """
        return cls(name, attach_segment(name, timeout), _token=_PRIVATE)

    def close(self) -> None:
        """Release this process's views and unmap the segment (idempotent).

        Views handed out by read()/reserve() are released first. If the caller still
        holds objects exporting them (e.g. numpy arrays from `decode_batch`), the
        mapping cannot be unmapped now; it is then unmapped when the last such object
        is garbage-collected. The segment itself stays until `unlink()`.
        """
        if self._mm is None:
            return
        self.wake()
        self._drop_read_view()
        _release_view(self._res_view)
        self._res_view = None
        self._h.close()  # raises BufferError if another thread is blocked in a call
        _release_view(self._mv)
        self._mv = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exported: munmap happens when they are collected
        self._mm = None

    def _remap(self) -> None:
        """Map the segment again for later records (a leasing consumer detached pages of
        this mapping; whatever still points into it keeps it alive)."""
        self._drop_read_view()
        try:
            mm = attach_segment(self._name, timeout=1.0)
        except RingTimeout:
            raise RingError(f"ring {self._name!r} was removed while its consumer held records") from None
        old = self._h
        self._mm, self._mv, self._h = mm, memoryview(mm), _native.Handle(mm)
        old.close()

    def unlink(self) -> None:
        """Remove the segment name (idempotent); mappings stay valid until closed."""
        unlink_segment(self._name)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"capacity={self.capacity}, pending={self.pending()}"
        return f"Ring({self._name!r}, {state})"

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        """The segment name."""
        return self._name

    @property
    def capacity(self) -> int:
        """Data-area bytes (a power of two)."""
        return self._handle().capacity

    @property
    def max_record(self) -> int:
        """Largest record payload this ring can hold (capacity - 8)."""
        return self._handle().max_record

    @property
    def creator_pid(self) -> int:
        """Pid of the process that created the segment."""
        return self._handle().creator_pid

    @property
    def producer_pid(self) -> int | None:
        """Pid that claimed the producer side, or None."""
        return self._handle().producer_pid or None

    @property
    def consumer_pid(self) -> int | None:
        """Pid that claimed the consumer side, or None."""
        return self._handle().consumer_pid or None

    def claim_producer(self, pid: int | None = None) -> None:
        """Record `pid` (default: this process) as the producer; the consumer watches it.

        Raises:
            RingError: Another live process already holds the producer side.
        """
        self._claim(False, pid)

    def claim_consumer(self, pid: int | None = None, *, take_over: bool = False) -> bool:
        """Record `pid` (default: this process) as the consumer; the producer watches it.

        Args:
            take_over: take the side from a live consumer that yields when it sees the
                claim change (a node's Flight endpoint, when a role that reads the ring
                directly moves to the node).

        Returns:
            True if the side was taken from another live process (which may still
            release a record it read before it saw the claim change).

        Raises:
            RingError: Another live process already holds the consumer side.
        """
        return self._claim(True, pid, take_over)

    def _claim(self, consumer: bool, pid: int | None, take_over: bool = False) -> bool:
        h = self._handle()
        pid = os.getpid() if pid is None else int(pid)
        current = h.consumer_pid if consumer else h.producer_pid
        current_ns = h.consumer_pidns if consumer else h.producer_pidns
        live = bool(current) and current != pid and peer_alive(current, current_ns)
        if live and not take_over:
            role = "consumer" if consumer else "producer"
            raise RingError(f"ring {self._name!r}: {role} side already claimed by live pid {current}")
        h.set_pid(consumer, pid, self_identity()[1])
        return live

    # ------------------------------------------------------------------ producer
    def reserve(self, nbytes: int, timeout: float) -> memoryview:
        """Reserve one record of `nbytes` and return a writable view to fill in place.

        The record becomes visible to the consumer on `commit()`. Reserving again
        without committing drops the earlier reservation.

        Args:
            nbytes: Payload size of the record.
            timeout: Seconds to wait for space (`math.inf`: no limit).

        Returns:
            A writable view of exactly `nbytes`, valid until `commit()`/`abort()`.

        Raises:
            RingFullError: The record can never fit this ring.
            RingTimeout: No space within `timeout` seconds.
            PeerDied: The consumer process exited while we waited.
            RingClosed: `close_writer()` was already called.
        """
        off = self._reserve_offset(int(nbytes), timeout)
        self._res_view = self._mv[off : off + nbytes]  # type: ignore[index]
        return self._res_view

    def commit(self, wake: bool = True) -> None:
        """Publish the reserved record and wake the consumer.

        Args:
            wake: False: publish it without waking the consumer; `wake()` does, after
                the last record of a run (see the module docstring).

        Raises:
            RingError: Nothing is reserved.
        """
        _release_view(self._res_view)
        self._res_view = None
        h = self._handle()
        if (h.commit() if wake else h.commit_quiet()) != _native.OK:
            raise RingError(f"ring {self._name!r}: commit() without a reserve()")
        if not wake:
            _UNWOKEN.add(self)

    def wake(self) -> None:
        """Wake the consumer for the records committed with `wake=False` (nothing if none)."""
        if self in _UNWOKEN:
            _UNWOKEN.discard(self)
            if self._mm is not None:
                self._h.wake_data()

    def abort(self) -> None:
        """Drop the reserved record unpublished (e.g. encoding it failed)."""
        _release_view(self._res_view)
        self._res_view = None
        self._handle().abort()

    def write(self, data: Any, timeout: float) -> None:
        """Write one record: a bytes-like object, or a sequence of them concatenated.

        Args:
            data: bytes-like object, or a sequence of them forming one record.
            timeout: Seconds to wait for space (`math.inf`: no limit).

        Raises:
            RingFullError, RingTimeout, PeerDied, RingClosed: as `reserve`.
        """
        try:
            parts = [memoryview(data)]
        except TypeError:
            if isinstance(data, str) or not isinstance(data, Sequence):
                raise TypeError(f"write() takes a bytes-like object or a sequence of them, not {type(data)}") from None
            parts = [memoryview(p) for p in data]
        # copy_into wants contiguous bytes; a strided view is flattened (one extra copy).
        parts = [p if p.c_contiguous else memoryview(p.tobytes()) for p in parts]
        total = sum(p.nbytes for p in parts)
        off = self._reserve_offset(total, timeout)
        h = self._h
        for p in parts:
            h.copy_into(off, p)
            off += p.nbytes
        h.commit()

    def close_writer(self) -> None:
        """Mark the end of the stream: the consumer drains, then gets `RingClosed`."""
        self._handle().close_writer()

    def _reserve_offset(self, nbytes: int, timeout: float) -> int:
        h = self._handle()
        if nbytes < 0:
            raise ValueError(f"record size must be >= 0, got {nbytes}")
        _release_view(self._res_view)  # a new reservation replaces an uncommitted one
        self._res_view = None
        wait = None
        while True:
            off = h.try_reserve(nbytes)
            if off >= 0:
                if off + nbytes + _NEXT_HEADER > self._reserved:
                    self._reserve_pages(off + nbytes + _NEXT_HEADER)
                return off
            if -off == _native.ETOOBIG:
                raise RingFullError(
                    f"record of {nbytes} B does not fit ring {self._name!r} (capacity {h.capacity} B, "
                    f"largest record {h.max_record} B); raise BatchSpec.ring_bytes"
                )
            if -off == _native.ECLOSED:
                raise RingClosed(f"write to ring {self._name!r} after close_writer()")
            wake_unwoken()  # the consumers this wait may depend on see what landed
            wait = wait or _Wait(self, "consumer", timeout)
            step = wait.next_slice()
            if step is None:
                raise RingTimeout(
                    f"ring {self._name!r}: no space for a {nbytes} B record within {timeout:.3g} s "
                    f"({h.pending} of {h.capacity} B in use; consumer pid {h.consumer_pid or 'unclaimed'})"
                )
            h.wait_space(nbytes, step)

    def _reserve_pages(self, end: int) -> None:
        """Reserve the segment's pages up to `end` (RESERVE_STEP at a time) before the
        record just reserved is written there; drops the reservation if /dev/shm is full."""
        size = len(self._mm)  # type: ignore[arg-type]
        upto = min(size, -(-end // RESERVE_STEP) * RESERVE_STEP)
        try:
            reserve_pages(self._name, self._reserved, upto)
        except RingError:
            self._handle().abort()
            raise
        self._reserved = upto

    # ------------------------------------------------------------------ consumer
    def read(self, timeout: float) -> memoryview:
        """Return the next record as a zero-copy writable view, releasing the previous one.

        Args:
            timeout: Seconds to wait for a record (`math.inf`: no limit).

        Raises:
            RingTimeout: Nothing arrived within `timeout`.
            RingClosed: The producer closed the ring and every record was read.
            RingError: The error slot is set and no record is ready (its message).
            PeerDied: The producer process exited while we waited.
        """
        self._drop_read_view()
        h = self._handle()
        wait = None
        while True:
            status, off, n = h.try_read()
            if status == _native.OK:
                return self._hand_out(off, n)
            self._raise_read_status(status)
            wait = wait or _Wait(self, "producer", timeout)
            try:
                step = wait.next_slice()
            except PeerDied:
                view = self._last_look(h)
                if view is None:
                    raise
                return view
            if step is None:
                raise RingTimeout(
                    f"ring {self._name!r}: no record within {timeout:.3g} s "
                    f"(producer pid {h.producer_pid or 'unclaimed'})"
                )
            h.wait_data(step)

    def try_read(self) -> memoryview | None:
        """Non-blocking `read`: the next record's view, or None if none is ready.

        Raises:
            RingClosed, RingError, PeerDied: as `read` when nothing is ready.
        """
        self._drop_read_view()
        h = self._handle()
        status, off, n = h.try_read()
        if status == _native.OK:
            return self._hand_out(off, n)
        self._raise_read_status(status)
        now = time.monotonic()
        # Rate-limited so a polling caller does not pay a procfs read per poll.
        if now >= self._next_poll_check:
            self._next_poll_check = now + PEER_CHECK_S
            try:
                self._check_peer("producer")
            except PeerDied:
                view = self._last_look(h)
                if view is None:
                    raise
                return view
        return None

    def release(self) -> None:
        """Release the current read view so the producer may reuse its space."""
        self._drop_read_view()

    def _last_look(self, h: Any) -> memoryview | None:
        """The producer is gone; its last record, close or error may have landed after
        our try_read and say more than PeerDied. None: nothing did."""
        status, off, n = h.try_read()
        if status == _native.OK:
            return self._hand_out(off, n)
        self._raise_read_status(status)
        return None

    def _hand_out(self, off: int, n: int) -> memoryview:
        self._read_view = self._mv[off : off + n]  # type: ignore[index]
        return self._read_view

    def _drop_read_view(self) -> None:
        if self._read_view is not None:
            _release_view(self._read_view)
            self._read_view = None
            self._h.release()

    def _raise_read_status(self, status: int) -> None:
        if status == _native.EAGAIN:
            return
        if status == _native.ECLOSED:
            raise RingClosed(f"ring {self._name!r}: producer closed the stream and every record was read")
        if status == _native.EERROR:
            raise RingError(self.error or f"ring {self._name!r}: error set without a message")
        if status == _native.ECORRUPT:
            raise RingError(f"ring {self._name!r} is corrupt: a record header disagrees with head/tail")
        raise RingError(f"ring {self._name!r}: unexpected status {status}")

    # ------------------------------------------------------------------ anyone
    def set_error(self, message: str) -> None:
        """Put a failure in the error slot and wake the consumer. The first error wins.

        The message is truncated to 2047 bytes of UTF-8, on a character boundary.
        """
        raw = str(message).encode("utf-8", "replace")
        limit = _native.ERROR_BYTES - 1
        if len(raw) > limit:
            raw = raw[:limit].decode("utf-8", "ignore").encode("utf-8")
        self._handle().set_error(raw)

    @property
    def error(self) -> str | None:
        """The message in the error slot, or None."""
        raw = self._handle().error
        return None if raw is None else raw.decode("utf-8", "replace")

    @property
    def closed(self) -> bool:
        """Whether the producer called `close_writer()`."""
        return self._handle().closed

    def pending(self) -> int:
        """Bytes in use in the data area (records not yet released, with padding)."""
        return self._handle().pending

    @property
    def consumer_mark(self) -> int:
        """The consumer's progress mark (0 until it sets one); the producer reads it."""
        return self._handle().consumer_mark

    def set_consumer_mark(self, mark: int) -> None:
        """Store what the consumer has finished with, in the caller's own units (>= 0),
        and wake a watcher asleep on it (`wait_marks`)."""
        self._handle().set_mark(int(mark))

    def set_consumer_note(self, note: bytes) -> None:
        """Publish up to NOTE_BYTES bytes for whoever watches the ring (the consumer's own
        figures, opaque to the ring), replacing the last note. One writer: a thread of
        the consumer's (overlord.shm._note)."""
        write_note(self._mapping(), CONSUMER_NOTE, note)

    def consumer_note(self) -> bytes | None:
        """The consumer's last note, or None (overlord.shm._note)."""
        return read_note(self._mapping(), CONSUMER_NOTE)

    def set_producer_note(self, note: bytes) -> None:
        """As `set_consumer_note`, from the producer's side, for the consumer (a Data
        Constructor host's last contact with the job's Redis). One writer."""
        write_note(self._mapping(), PRODUCER_NOTE, note)

    def producer_note(self) -> bytes | None:
        """The producer's last note, or None (overlord.shm._note)."""
        return read_note(self._mapping(), PRODUCER_NOTE)

    def _mapping(self) -> memoryview:
        self._handle()
        assert self._mv is not None
        return self._mv

    def _handle(self) -> _native.Handle:
        if self._mm is None:
            raise RingError(f"ring {self._name!r} was closed in this process")
        return self._h

    def _check_peer(self, role: str) -> None:
        h = self._h
        if role == "producer":
            pid, pidns = h.producer_pid, h.producer_pidns
        else:
            pid, pidns = h.consumer_pid, h.consumer_pidns
        if pid and not peer_alive(pid, pidns):
            why = "no more records will come" if role == "producer" else "nobody reads this ring"
            raise PeerDied(
                f"{role} pid {pid} of ring {self._name!r} exited while we waited ({why}); "
                "see that process's log for its failure"
            )


def wait_marks(rings: Sequence[Ring], seen: tuple[int, ...] | None, timeout: float, poll: float) -> tuple[int, ...]:
    """Sleep, without the GIL, until the consumer mark of one of `rings` differs from
    `seen`, at most `timeout` seconds: one futex_waitv(2) on the rings' mark words, which
    `set_consumer_mark` bumps and wakes (a look every `poll` seconds where the kernel
    has no futex_waitv, or for more than 128 rings).

    Args:
        rings: the rings to watch (a producer's or a watcher's mappings of them).
        seen: what the last call returned for the same rings; None returns at once.
        timeout: the longest wait, seconds.
        poll: seconds between two looks when it cannot sleep on the marks.

    Returns:
        Each ring's consumer mark when it returned.

    Raises:
        RingError: a ring was closed in this process.
    """
    handles = tuple(ring._handle() for ring in rings)
    if seen is None:
        return tuple(h.consumer_mark for h in handles)
    return _native.wait_marks(handles, seen, timeout, poll)


def wake_unwoken() -> None:
    """Wake every ring this process committed to with `wake=False` and has not woken."""
    for ring in list(_UNWOKEN):
        ring.wake()


class _Wait:
    """One blocking call's clock: futex sleeps of at most PEER_CHECK_S, peer checks between."""

    __slots__ = ("ring", "role", "deadline", "next_check")

    def __init__(self, ring: Ring, role: str, timeout: float) -> None:
        now = time.monotonic()
        self.ring, self.role = ring, role
        self.deadline = now + timeout
        self.next_check = now + PEER_CHECK_S

    def next_slice(self) -> float | None:
        """Seconds to sleep next; None once the timeout has passed. Raises PeerDied."""
        now = time.monotonic()
        if now >= self.next_check:
            self.ring._check_peer(self.role)
            self.next_check = now + PEER_CHECK_S
        if now >= self.deadline:
            return None
        return min(self.deadline - now, PEER_CHECK_S)


def _release_view(view: memoryview | None) -> None:
    if view is None:
        return
    try:
        view.release()  # invalidates the caller's copy of the view: stale reads fail loudly
    except BufferError:
        pass  # something (a numpy array) still exports it; it keeps the mapping alive


_PRIVATE = object()
