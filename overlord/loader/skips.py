"""What a Source Loader skipped under `on_error: skip`, per file: whole files, row groups, rows.

A skip is decided by the bytes of a file and the source's config only (a footer that is
not the format's, a declared column the file lacks, a row group that does not decode, a
bad row, a sample larger than the loader-to-constructor ring can ever hold). Every
process that reads a partition (the active Source Loader, its Shadow Loader, a restarted
one) therefore skips the same units, and the readable rows keep their place in the order
(`order.py`): a skipped row keeps its seq, nothing is renumbered, so cursors and
checkpoints mean the same with and without skips. A file skipped whole has no row groups
in the order; the file indices of the other files (in sample keys) do not move.

Each unit is logged once with a warning naming source, file (and row group) and why,
counted, and published by the active loader process into the job's `counters` hash
(integers, like every counter there; the fields are named in overlord.store.schema):

    skipped:<stream>                 rows the stream skipped (every cause)
    skipped_file:<stream>:<uri>      1: the file is skipped whole
    skipped_groups:<stream>:<uri>    row groups of the file skipped (each unreadable)
    skipped_rows:<stream>:<uri>      rows of the file skipped (those of its skipped row groups too)

A field per file, only for files with skips: a job with many bad files is a job to stop
anyway, and the metrics keep per-stream totals of files and row groups instead of a
label per file (`overlord_source_skipped_files_total`, `..._row_groups_total`), so their
cardinality stays that of the streams. `overlord status` prints a line per file with
skips (a file skipped whole is reported by every partition of its source, and is shown
once).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from overlord.store.schema import (
    skipped_field,
    skipped_file_field,
    skipped_file_of,
    skipped_groups_field,
    skipped_rows_field,
)

log = logging.getLogger("overlord.loader")


@dataclass(slots=True)
class FileSkips:
    """The skips of one file of one stream."""

    uri: str
    whole: str | None = None  # why the file was skipped whole
    groups: list[int] = field(default_factory=list)  # row groups skipped (each unreadable)
    rows: int = 0  # rows skipped (those of skipped row groups included)
    why: str = ""  # the first cause


class Skips:
    """The skip counters of one stream (a partition of a source); thread-safe (transform
    workers reject rows concurrently)."""

    def __init__(self, source: str, stream: str) -> None:
        self.source, self.stream = source, stream
        self.files: dict[int, FileSkips] = {}
        self.rows = 0
        self.version = 0  # bumped at every change: the loader process publishes only then
        self._lock = threading.Lock()

    def _file(self, index: int, uri: str) -> FileSkips:
        entry = self.files.get(index)
        if entry is None:
            entry = self.files[index] = FileSkips(uri)
        return entry

    def file(self, index: int, uri: str, why: str) -> None:
        """File `index` is skipped whole (decided when the loader starts)."""
        with self._lock:
            entry = self._file(index, uri)
            entry.whole, entry.why = why, entry.why or why
            self.version += 1
        log.warning("source %r file %r skipped whole (on_error: skip): %s", self.source, uri, why)

    def group(self, index: int, uri: str, group: int, why: str) -> None:
        """Row group `group` of file `index` cannot be read; its rows follow as bad rows."""
        with self._lock:
            entry = self._file(index, uri)
            if group in entry.groups:
                return  # read again (a later window, a resume): counted and logged once
            entry.groups.append(group)
            entry.why = entry.why or why
            self.version += 1
        log.warning("source %r file %r row group %d skipped (on_error: skip): %s", self.source, uri, group, why)

    def row(self, index: int, uri: str, row: int, why: str) -> None:
        """Row `row` of file `index` is skipped; the first of a file is logged."""
        with self._lock:
            self.rows += 1
            self.version += 1
            entry = self._file(index, uri)
            entry.rows += 1
            first = entry.rows == 1 and not entry.groups
            entry.why = entry.why or why
        if first:
            log.warning(
                "source %r file %r row %d skipped (on_error: skip): %s; further skips in this file are "
                "counted (overlord status)",
                self.source,
                uri,
                row,
                why,
            )

    @property
    def any(self) -> bool:
        return bool(self.files)

    @property
    def files_skipped(self) -> int:
        return sum(f.whole is not None for f in self.files.values())

    @property
    def groups_skipped(self) -> int:
        return sum(len(f.groups) for f in self.files.values())

    def fields(self) -> dict[str, int]:
        """This stream's fields of the `counters` hash."""
        with self._lock:
            out = {skipped_field(self.stream): self.rows}
            for f in self.files.values():
                if f.whole is not None:
                    out[skipped_file_field(self.stream, f.uri)] = 1
                if f.groups:
                    out[skipped_groups_field(self.stream, f.uri)] = len(f.groups)
                if f.rows:
                    out[skipped_rows_field(self.stream, f.uri)] = f.rows
        return out

    def summary(self) -> str:
        """Per file: what was skipped and the first cause."""
        with self._lock:
            parts = []
            for f in self.files.values():
                if f.whole is not None:
                    parts.append(f"{f.uri!r} skipped whole ({f.whole})")
                else:
                    groups = f" in {len(f.groups)} unreadable row group(s) {sorted(f.groups)}" if f.groups else ""
                    parts.append(f"{f.uri!r}: {f.rows} row(s) skipped{groups} (first: {f.why})")
        return "; ".join(parts)


def per_file(counters: dict[str, int]) -> dict[tuple[str, str], dict[str, int]]:
    """The per-file skips of a `counters` hash (decoded): (source, uri) -> {"whole": 0/1,
    "groups": n, "rows": n}, the streams of a source summed (a file skipped whole is
    skipped by every partition, and counts once)."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for name, value in counters.items():
        skipped = skipped_file_of(name)
        if skipped is None:
            continue
        what, stream, uri = skipped
        into = out.setdefault((stream.rsplit(".", 1)[0], uri), {"whole": 0, "groups": 0, "rows": 0})
        if what == "whole":
            into["whole"] = 1
        else:
            into[what] += int(value)
    return out
