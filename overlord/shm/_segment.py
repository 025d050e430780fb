"""POSIX shared-memory segments for rings: create (0600, exclusive), attach, unlink.

The segment is ``/dev/shm/<name without '/'>``, sized ``4096 + capacity`` (header page
plus data area, see native/ring.h). Creating is exclusive (O_CREAT | O_EXCL) so two
roles never silently share a ring; the creator initialises the header and stores the
magic last, so an attacher that sees the magic sees a complete header. Attaching polls
because the attacher may start before the creator: the segment may not exist yet, may
exist with size 0 (created, not yet sized), or be sized with its magic still 0.

Every page is reserved (posix_fallocate on tmpfs) before anything is written to it: a
page that cannot be had when first written kills the writer with SIGBUS, while a
reservation that fails is a RingError that names the segment, the sizes and the fix.
Creating reserves the header page and the first `RESERVE_STEP` bytes of the data area;
the producer reserves further pages `RESERVE_STEP` at a time as its records reach them
(`reserve_pages`, from `Ring.reserve`). A ring rewinds to its start while little is in
it (native/ring.h), so it holds in /dev/shm about three times its peak fill, not its
capacity: a ring sized for a burst costs memory when the burst comes. `overlord check`
and the sidecar's start still refuse a /dev/shm that could not hold every ring full.
"""

from __future__ import annotations

import errno
import mmap
import os
import time

import posix_ipc

from overlord.errors import RingError, RingTimeout
from overlord.shm import _ring as _native
from overlord.shm._proc import self_identity

ATTACH_POLL_S = 0.005  # creating a segment takes microseconds; polling is cheap
RESERVE_STEP = 256 << 10  # data-area bytes reserved at a time: a 16 MiB ring grows in at most 64 calls
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux

_CHECK_WORDS = {
    _native.EMAGIC: "bad magic",
    _native.EVERSION: f"protocol version is not {_native.VERSION}",
    _native.ESIZE: "capacity or size inconsistent",
}


def segment_bytes(capacity: int) -> int:
    """The bytes a ring of `capacity` takes in /dev/shm when full (header page, capacity
    rounded up to a power of two)."""
    return _native.segment_size(_native.round_capacity(max(int(capacity), 1)))


def create_segment(name: str, capacity: int) -> mmap.mmap:
    """Create, map and initialise a ring segment; returns the mapping.

    Raises:
        RingError: The segment already exists, capacity exceeds the maximum, or
            /dev/shm has no room for its first pages.
    """
    cap = _native.round_capacity(max(int(capacity), 0))
    if cap == 0:
        raise RingError(f"ring {name!r}: capacity {capacity} B exceeds {_native.MAX_CAPACITY} B")
    size = _native.segment_size(cap)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError:
        raise RingError(
            f"shared-memory segment {name!r} already exists; if its job is gone, "
            "remove it with overlord.shm.cleanup_stale(job)"
        ) from None
    try:
        _reserve(name, shm.fd, 0, first_reserved(size), size)
        mm = mmap.mmap(shm.fd, size)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        shm.close_fd()
    pid, ns, start = self_identity()
    if _native.init_segment(mm, cap, pid, ns, start) != _native.OK:  # cannot happen: sized above
        mm.close()
        unlink_segment(name)
        raise RingError(f"ring {name!r}: could not initialise a {size} B segment for capacity {cap}")
    return mm


def first_reserved(size: int) -> int:
    """The bytes from the start of a `size`-byte segment that its creator reserves."""
    return min(size, _native.HEADER_SIZE + RESERVE_STEP)


def reserve_pages(name: str, start: int, end: int) -> None:
    """Reserve bytes [start, end) of an existing segment (the producer, before it writes there).

    A segment whose name is gone (unlinked while mapped, at a job's end) cannot be
    reserved by name: its pages come on first write.

    Raises:
        RingError: /dev/shm has no room for them (naming the segment and the fix).
    """
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return
    try:
        _reserve(name, shm.fd, start, end, os.fstat(shm.fd).st_size)
    finally:
        shm.close_fd()


def _reserve(name: str, fd: int, start: int, end: int, size: int) -> None:
    """Allocate the pages of bytes [start, end) of a `size`-byte segment now, or raise
    RingError saying why and what to change."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a filesystem that cannot reserve: the pages come on first write, as before
        st = os.statvfs(SHM_DIR)
        raise RingError(
            f"ring {name!r}: cannot reserve bytes {start}-{end} of its {size} B ({size / 2**20:.1f} MiB) segment "
            f"in {SHM_DIR} ({exc.strerror}): {st.f_bavail * st.f_frsize} B free of {st.f_blocks * st.f_frsize} B; give the "
            "job more shared memory (the container's shm_size / docker run --shm-size, or a larger tmpfs on "
            f"{SHM_DIR}), or lower BatchSpec.ring_bytes / Job.sample_ring_bytes"
        ) from None


def attach_segment(name: str, timeout: float) -> mmap.mmap:
    """Map an existing ring segment once its header is initialised.

    Raises:
        RingTimeout: It did not appear (initialised) within `timeout` seconds.
        RingError: It is not an Overlord ring, or of another protocol version.
    """
    deadline = time.monotonic() + timeout
    state = "does not exist"
    while True:
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            shm = None
        if shm is not None:
            try:
                size = os.fstat(shm.fd).st_size
                mm = mmap.mmap(shm.fd, size) if size >= _native.HEADER_SIZE else None
            finally:
                shm.close_fd()
            status = _native.check(mm) if mm is not None else _native.EUNINIT
            if status == _native.OK and mm is not None:
                return mm
            if mm is not None:
                mm.close()
            if status != _native.EUNINIT:
                raise RingError(
                    f"segment {name!r} is not a usable Overlord ring "
                    f"({_CHECK_WORDS.get(status, status)}); was it made by another version?"
                )
            state = "exists but its header is not initialised"
        if time.monotonic() >= deadline:
            raise RingTimeout(f"ring {name!r} {state} after waiting {timeout:.3g} s for its creator")
        time.sleep(ATTACH_POLL_S)


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; False if it was already gone. Mappings stay valid."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True
