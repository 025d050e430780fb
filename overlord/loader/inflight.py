"""What each transform thread of a loader process is transforming now, in a file that
outlives the process.

Before a transform runs, the thread writes (stream, file, row, start time) into its own
fixed-size slot of a small memory-mapped file in the run directory (mode 0600, one per
process, named by its pid); after it, it marks the slot idle. Two readers use it:

- the loader process's deadline thread (`Deadline`): a sample past its source's
  `Source.transform_timeout_s` fails the job naming source, file and row, since a
  thread stuck in a transform cannot be stopped from Python;
- the sidecar, when it reaps a loader process that died by a signal or a non-zero exit:
  the slot still names the sample it died on (`last_samples`).

Per sample this costs two `struct.pack_into` on a mapping (a microsecond), no syscall.

Layout (little-endian):

    0   8 B   magic b"OVLINFL1"
    8   u32   slots
    12  u32   bytes of the names JSON
    16  slots x 32 B: f64 start (CLOCK_MONOTONIC s; 0.0: idle), i64 row in file,
                      i32 stream, i32 file, u32 rows (a batch transform's batch), u32 pad
    16 + 32 x slots: names JSON: [[source name, [file, ...]], ...] indexed by stream

A slot written while the process is killed may be torn; it names a sample of the same
run at worst, and the reader says so by the time it gives.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MAGIC = b"OVLINFL1"
_HEADER = struct.Struct("<8sII")
_SLOT = struct.Struct("<dqiiII")
_START = struct.Struct("<d")
SLOTS = 64  # transform threads of one process a table tracks (more share the last slot)
_CALLER = os.path.join("overlord", "loader", "source_loader.py")  # where a stack of a transform begins


def inflight_path(run_dir: Path, pid: int) -> Path:
    """The table of loader process `pid` (active or shadow) in its run directory."""
    return Path(run_dir) / f"inflight-{pid}.bin"


class Inflight:
    """The in-flight table of one loader process (writer side).

    Args:
        path: where to create it (truncated if it exists; mode 0600).
        streams: (source name, its files) per stream id the writers will use.
    """

    def __init__(self, path: Path, streams: list[tuple[str, list[str]]]) -> None:
        self.path = Path(path)
        names = json.dumps([[name, list(files)] for name, files in streams]).encode()
        size = _HEADER.size + SLOTS * _SLOT.size + len(names)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, SLOTS, len(names))
        self._map[_HEADER.size + SLOTS * _SLOT.size :] = names
        self._slots: dict[int, int] = {}  # thread ident -> slot offset
        self._threads: dict[int, int] = {}  # slot offset -> thread ident (for its stack)
        self._lock = threading.Lock()

    def add_stream(self, name: str, files: list[str]) -> int:
        """Name one more stream (a stream handed to this process while it runs); returns
        its id. Ids already given keep their meaning."""
        with self._lock:
            start = _HEADER.size + SLOTS * _SLOT.size
            _, slots, names_len = _HEADER.unpack_from(self._map, 0)
            streams = json.loads(bytes(self._map[start : start + names_len]))
            streams.append([name, list(files)])
            names = json.dumps(streams).encode()
            if start + len(names) > len(self._map):
                self._map.resize(start + len(names))  # the file grows with it
            self._map[start : start + len(names)] = names
            _HEADER.pack_into(self._map, 0, MAGIC, slots, len(names))
            return len(streams) - 1

    def _slot(self) -> int:
        ident = threading.get_ident()
        offset = self._slots.get(ident)
        if offset is None:
            with self._lock:  # a new thread (a pool was resized): take a free slot
                alive = {t.ident for t in threading.enumerate()}
                for gone in [i for i in self._slots if i not in alive]:
                    self._threads.pop(self._slots.pop(gone), None)
                used = set(self._slots.values())
                free = [_HEADER.size + k * _SLOT.size for k in range(SLOTS)]
                offset = next((o for o in free if o not in used), free[-1])
                self._slots[ident], self._threads[offset] = offset, ident
        return offset

    def enter(self, stream: int, file: int, row: int, rows: int = 1) -> int:
        """This thread transforms `rows` rows of `stream` from (file, row) now; returns
        the slot to `leave`."""
        offset = self._slot()
        _SLOT.pack_into(self._map, offset, time.monotonic(), row, stream, file, rows, 0)
        return offset

    def leave(self, offset: int) -> None:
        _START.pack_into(self._map, offset, 0.0)

    def busy(self) -> list[tuple[float, int, int, int, int, int | None]]:
        """(start, stream, file, row, rows, thread ident) of every slot in a transform."""
        out = []
        for k in range(SLOTS):
            offset = _HEADER.size + k * _SLOT.size
            start, row, stream, file, rows, _ = _SLOT.unpack_from(self._map, offset)
            if start > 0.0:
                out.append((start, stream, file, row, rows, self._threads.get(offset)))
        return out

    def close(self, unlink: bool = True) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


def describe(streams: list, stream: int, file: int, row: int, rows: int) -> str:
    """Names a sample: source 'web' file '/x.parquet' row 7 (or a batch of rows)."""
    try:
        source, files = streams[stream]
        path = files[file]
    except (IndexError, TypeError, ValueError):
        return f"stream {stream} file #{file} row {row} (names not recorded)"
    what = f"row {row}" if rows <= 1 else f"a batch of {rows} rows from row {row}"
    return f"source {source!r} file {path!r} {what}"


def last_samples(path: Path) -> list[tuple[str, tuple[int, int, int], float]]:
    """What a dead loader process was transforming: (description, (stream, file, row),
    seconds since it began) per busy slot, longest-running first; [] without a table."""
    try:
        data = Path(path).read_bytes()
        magic, slots, names_len = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            return []
        streams = json.loads(data[_HEADER.size + slots * _SLOT.size :][:names_len])
    except (OSError, struct.error, ValueError):
        return []
    now, out = time.monotonic(), []
    for k in range(slots):
        start, row, stream, file, rows, _ = _SLOT.unpack_from(data, _HEADER.size + k * _SLOT.size)
        if start > 0.0:
            out.append((start, describe(streams, stream, file, row, rows), (stream, file, row)))
    return [(what, key, max(0.0, now - start)) for start, what, key in sorted(out)]


def _stack(frame) -> str:
    """Where a stuck transform is: its innermost frames, up to the Source Loader's call."""
    out = []
    while frame is not None and not frame.f_code.co_filename.endswith(_CALLER):
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return ", called from ".join(out[:3]) if len(out) <= 3 else f"{', called from '.join(out[:2])}, ... {out[-1]}"


class Deadline:
    """Watches an `Inflight` table from a thread of its own: a transform running past
    its stream's deadline is handed to `expired(message)` once (which must end the
    process: the stuck thread cannot be stopped).

    Args:
        table: the process's table.
        streams: (source name, files) per stream id, as given to the table.
        deadlines: seconds per stream id.
        specs: the transform spec ("module:callable") per stream id, for the message.
        expired: called with the message.
    """

    def __init__(
        self, table: Inflight, streams: list, deadlines: list[float], specs: list[str], expired: Callable[[str], None]
    ) -> None:
        self.table, self.streams, self.deadlines, self.specs = table, streams, deadlines, specs
        self.expired = expired
        self.interval = max(0.05, min(1.0, min(deadlines, default=1.0) / 4))

    def check(self) -> str | None:
        """The message for the longest-overdue transform, or None."""
        now = time.monotonic()
        for start, stream, file, row, rows, ident in sorted(self.table.busy()):
            limit = self.deadlines[stream]
            if now - start <= limit:
                continue
            where = describe(self.streams, stream, file, row, rows)
            frame = sys._current_frames().get(ident) if ident is not None else None
            at = f" (its thread is at {_stack(frame)})" if frame is not None else ""
            return (
                f"{where}: transform {self.specs[stream]} has run for {now - start:.1f}s on it, past the per-sample "
                f"deadline Source.transform_timeout_s={limit:g}s{at}. Fix the transform (a sample that hangs: a "
                "lock, a network call without a timeout, a loop that never ends), or raise "
                "Source.transform_timeout_s if such a sample is legitimately this slow. on_error: skip does not "
                "skip a hang: whether a sample times out depends on the machine, not the file, so skipping it "
                "would make the batches depend on timing"
            )
        return None

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            message = self.check()
            if message is not None:
                self.expired(message)
                return
