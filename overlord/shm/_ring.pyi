"""Type stub for the C extension `overlord.shm._ring` (native/ringmodule.c, native/ringhandle.c).

Status codes are returned, not raised; `overlord.shm._pyring.Ring` turns them into errors.
"""

from typing_extensions import Buffer

OK: int
EAGAIN: int
ETIMEDOUT: int
ECLOSED: int
EERROR: int
ETOOBIG: int
ECORRUPT: int
EUNINIT: int
EMAGIC: int
EVERSION: int
ESIZE: int
ESTATE: int
HEADER_SIZE: int
RECORD_HEADER: int
VERSION: int
ERROR_BYTES: int
MIN_CAPACITY: int
MAX_CAPACITY: int
MAGIC: int

def init_segment(buffer: Buffer, capacity: int, creator_pid: int, creator_pidns: int, creator_start: int, /) -> int: ...
def check(buffer: Buffer, /) -> int: ...
def round_capacity(requested: int, /) -> int: ...
def segment_size(capacity: int, /) -> int: ...
def wait_marks(handles: tuple[Handle, ...], seen: tuple[int, ...], timeout: float, poll: float, /) -> tuple[int, ...]:
    """Each handle's consumer mark, once one differs from `seen` or at `timeout` (GIL released)."""

def stream_copy(dst: Buffer, src: Buffer, /) -> None:
    """Copy `src` into `dst` (the same length) with stores that bypass the cache, fenced (GIL released when large)."""

class Handle:
    """Process-local handle on a mapped ring; holds a buffer export until close()."""

    capacity: int
    max_record: int
    creator_pid: int
    producer_pid: int
    consumer_pid: int
    producer_pidns: int
    consumer_pidns: int
    closed: bool
    pending: int
    tail: int
    space_wanted: bool
    consumer_mark: int
    error: bytes | None
    def __init__(self, buffer: Buffer) -> None: ...
    def close(self) -> None: ...
    def try_reserve(self, nbytes: int, /) -> int:
        """Payload offset into the mapping, or minus a status code."""
    def wait_space(self, nbytes: int, timeout: float, /) -> bool:
        """False if the wait timed out (GIL released)."""
    def commit(self) -> int: ...
    def commit_quiet(self) -> int:
        """`commit` without waking the consumer (`wake_data` does)."""
    def wake_data(self) -> None: ...
    def abort(self) -> None: ...
    def copy_into(self, offset: int, data: Buffer, /) -> None: ...
    def close_writer(self) -> None: ...
    def try_read(self) -> tuple[int, int, int]:
        """(status, payload offset, payload length); releases the previous record."""
    def wait_data(self, timeout: float, /) -> bool:
        """False if the wait timed out (GIL released)."""
    def release(self) -> bool: ...
    def set_error(self, message: bytes, /) -> bool: ...
    def set_pid(self, consumer: bool, pid: int, pidns: int, /) -> None: ...
    def peek(self, cursor: int, /) -> tuple[int, int, int, int]:
        """(status, payload offset, length, next cursor) of the record at `cursor`."""
    def wait_data_at(self, cursor: int, holding: bool, timeout: float, /) -> bool:
        """Sleep until data may be past `cursor`; at once if `holding` and the producer waits for space."""
    def release_to(self, tail: int, /) -> bool:
        """Move tail forward to `tail`; False if it is behind tail, past head or unaligned."""
    def set_mark(self, mark: int, /) -> None: ...
    def detach(self, offset: int, length: int, /) -> bool:
        """Give the pages under the range a private copy of their bytes; False if it cannot."""
