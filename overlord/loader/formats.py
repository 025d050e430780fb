"""File formats a Source Loader reads, behind one small interface.

A format opens one file (a `storage.Location`) as an `OpenFile`: numbered row groups with
known row counts, which is all the deterministic order (`order.py`) needs, and a way to
read one row group into a `Chunk` whose rows come out one at a time as dicts. The order,
partitioning, epochs and exactly-once delivery are the same whatever the format.

Parquet: the file's own row groups; counts (and the curriculum's difficulty statistics)
come from the footer.

JSONL: one JSON object per line. A row group is a block of `BLOCK_ROWS` consecutive
non-blank lines; blank lines are not rows. Opening a file reads it once, as a stream, to
index its blocks, and the index is kept (O(blocks) integers) for the Source Loader's life:

    bytes   | line 0 \\n | line 1 \\n | \\n | line 3 \\n | ... | line k \\n | ...
            ^ block 0: offset 0, first line 0            ^ block 1: offset, first line
                                                           (the BLOCK_ROWS-th row)

Reading block b is then one ranged read of its bytes. A compressed file (`.gz`, `.zst`,
`.bz2`, decompressed by pyarrow) cannot be read from the middle, so it is one block,
decompressed whole when the order reaches it: keep compressed shards small, or use Parquet.
Lines are parsed when their row is read, so a line that is not a JSON object is a bad row
(`BadRow`, with its 1-based line number), handled like a row whose transform raises.

Hugging Face datasets (`hf`): memory-mapped Arrow stream files, a row group per record
batch; what a path may name (a save_to_disk directory, a split, cache files) is `hf.py`'s.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from overlord.errors import SchemaError, SourceReadError
from overlord.loader import hf, storage
from overlord.loader.storage import Location

BLOCK_ROWS = 1024  # JSONL lines per row group
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}  # JSONL file suffix -> pyarrow codec
_READ = 1 << 20  # bytes per read while indexing


class BadRow(Exception):
    """A row that cannot become a dict (e.g. a line that is not JSON); says where and why."""


class Chunk(Protocol):
    """One row group, read."""

    nbytes: int

    def row(self, i: int) -> dict:
        """Row `i` of the group as a dict of its columns. Raises BadRow."""

    def rows(self, start: int, stop: int) -> Chunk | None:
        """Rows [start, stop) as a chunk that holds none of the others' memory (row `i`
        of it is row `start + i` of this one), or None where reading the group again
        for its other rows would cost more than keeping it whole (a compressed file)."""


class OpenFile(Protocol):
    """One open file of a source."""

    names: list[str] | None  # column names, where the format has a schema
    nbytes: int  # memory its metadata holds (Parquet footer)

    def group_rows(self) -> list[int]:
        """Rows in each row group, in file order."""

    def difficulty(self, column: str) -> list[float]:
        """The curriculum's difficulty of each row group. Raises SchemaError."""

    def read_group(self, group: int, columns: tuple[str, ...] | None) -> Chunk:
        """Read one row group (only `columns`, if given)."""


class Format(Protocol):
    """What opens a source's files (one per Source Loader, so it may keep indexes)."""

    label: str  # how errors name the format

    @property
    def nbytes(self) -> int:
        """Memory its indexes hold."""

    def open(self, location: Location, where: str) -> OpenFile:
        """Open one file; `where` names it in errors."""


# -- Parquet ---------------------------------------------------------------------------------


class ParquetFile:
    """A Parquet file read through its filesystem, by row group."""

    def __init__(self, location: Location, where: str) -> None:
        self.where = where
        # pre_buffer (pyarrow's default) coalesces a row group's column reads into few
        # requests, which pays on object stores, and keeps the last row group's raw bytes
        # until the next read: on a local file it saves nothing and held as much again as
        # the decoded group (1.9 MiB for 256 image rows) per open file
        local = isinstance(location.filesystem, pafs.LocalFileSystem)
        self.file = pq.ParquetFile(location.open_input_file(), pre_buffer=not local)
        self.names = self.file.schema_arrow.names
        self.nbytes = self.file.metadata.serialized_size

    def group_rows(self) -> list[int]:
        meta = self.file.metadata
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def difficulty(self, column: str) -> list[float]:
        """Midpoint of the column's min/max statistics, per row group."""
        if column not in self.names:
            raise SchemaError(
                f"{self.where} has no difficulty column {column!r}; it has {self.names}. Fix Source.difficulty"
            )
        index = self.file.schema_arrow.get_field_index(column)
        out = []
        for g in range(self.file.metadata.num_row_groups):
            stats = self.file.metadata.row_group(g).column(index).statistics
            if stats is None or not stats.has_min_max or not isinstance(stats.min, (int, float)):
                raise SchemaError(
                    f"{self.where} row group {g}: column {column!r} has no numeric min/max statistics, "
                    "which the curriculum order reads; rewrite the file with statistics or unset Source.difficulty"
                )
            out.append((float(stats.min) + float(stats.max)) / 2)
        return out

    def read_group(self, group: int, columns: tuple[str, ...] | None) -> Chunk:
        return storage.ArrowChunk(self.file.read_row_group(group, columns=list(columns) if columns else None))


class ParquetFormat:
    """Opens Parquet files; keeps nothing between opens (footers are re-read)."""

    label = "Parquet"
    nbytes = 0

    def open(self, location: Location, where: str) -> ParquetFile:
        return ParquetFile(location, where)


# -- JSONL -----------------------------------------------------------------------------------


class _LinesChunk:
    def __init__(self, lines: list[tuple[int, bytes]], columns: tuple[str, ...] | None, whole: bool) -> None:
        self.lines, self.columns = lines, columns  # (line number, raw line) per row
        self.nbytes = sum(len(raw) for _, raw in lines)
        self.whole = whole  # a compressed file's one block: decompressed whole at each read

    def rows(self, start: int, stop: int) -> _LinesChunk | None:
        return None if self.whole else _LinesChunk(self.lines[start:stop], self.columns, False)

    def row(self, i: int) -> dict:
        line, raw = self.lines[i]
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise BadRow(f"line {line + 1} is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise BadRow(f"line {line + 1} is a JSON {type(value).__name__}, not an object")
        if self.columns is None:
            return value
        missing = [c for c in self.columns if c not in value]
        if missing:
            raise BadRow(f"line {line + 1} has no field(s) {missing}; it has {sorted(value)}")
        return {c: value[c] for c in self.columns}


def _lines(data: bytes, first_line: int) -> list[tuple[int, bytes]]:
    """The non-blank lines of `data` with their line numbers (the first is `first_line`)."""
    return [(first_line + n, raw) for n, raw in enumerate(data.split(b"\n")) if raw and not raw.isspace()]


class _Index:
    """Where each block of a JSONL file starts: byte offset, line number, rows."""

    def __init__(self, stream: pa.NativeFile, block_rows: int) -> None:
        offsets: list[int] = []
        first_lines: list[int] = []
        rows: list[int] = []
        pos = line = 0
        carry = b""
        while True:
            data = stream.read(_READ)
            lines = (carry + data).split(b"\n")
            carry = lines.pop() if data else b""  # the last line may go on in the next read
            for raw in lines:
                if raw and not raw.isspace():
                    if not rows or rows[-1] == block_rows:
                        offsets.append(pos)
                        first_lines.append(line)
                        rows.append(0)
                    rows[-1] += 1
                pos += len(raw) + 1
                line += 1
            if not data:
                break
        self.size = pos - 1  # bytes read (the last line has no newline after it)
        self.offsets, self.first_lines, self.rows = (np.asarray(v, np.int64) for v in (offsets, first_lines, rows))
        self.nbytes = 3 * self.rows.nbytes


class JsonlFile:
    """A JSONL file (plain or compressed) read through its filesystem, by block of lines."""

    names: list[str] | None = None  # no schema: Source.columns are checked on each line
    nbytes = 0  # the index is the format's

    def __init__(self, location: Location, where: str, index: _Index, compression: str | None) -> None:
        self.location, self.where, self.index, self.compression = location, where, index, compression

    def group_rows(self) -> list[int]:
        return self.index.rows.tolist()

    def difficulty(self, column: str) -> list[float]:
        raise SchemaError(
            f"{self.where}: Source.difficulty={column!r} orders row groups by Parquet statistics, "
            "which JSONL lacks; convert the source to Parquet or unset Source.difficulty"
        )

    def read_group(self, group: int, columns: tuple[str, ...] | None) -> Chunk:
        idx = self.index
        start = int(idx.offsets[group])
        end = int(idx.offsets[group + 1]) if group + 1 < len(idx.offsets) else idx.size
        if self.compression is None:
            with self.location.open_input_file() as f:
                data = f.read_at(end - start, start)
        else:
            with self.location.open_input_stream(self.compression) as f:
                data = f.read()[start:end]
        lines = _lines(data, int(idx.first_lines[group]))
        if len(lines) != idx.rows[group]:
            raise OSError(
                f"block {group} has {len(lines)} rows where the index built at open found {idx.rows[group]}; the file changed while it was read"
            )
        return _LinesChunk(lines, columns, self.compression is not None)


class JsonlFormat:
    """Opens JSONL files; keeps each file's block index for the Source Loader's life, so a
    file closed by the loader's LRU is not scanned again."""

    label = "JSONL"

    def __init__(self) -> None:
        self.block_rows = BLOCK_ROWS
        self._index: dict[str, _Index] = {}

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._index.values())

    def open(self, location: Location, where: str) -> JsonlFile:
        compression = next((c for s, c in _COMPRESSION.items() if location.path.endswith(s)), None)
        index = self._index.get(location.uri)
        if index is None:
            with location.open_input_stream(compression) as stream:
                index = _Index(stream, sys.maxsize if compression else self.block_rows)
            self._index[location.uri] = index
        return JsonlFile(location, where, index, compression)


FORMATS: dict[str, Callable[[], Format]] = {"hf": hf.HfFormat, "jsonl": JsonlFormat, "parquet": ParquetFormat}


def locations(source: str, format: str, paths: tuple[str, ...]) -> list[Location]:
    """The files of a source, in order: each path's files (sorted matches of a glob, or
    a dataset's files in its own order for `hf`), paths in order.

    Raises:
        SourceReadError: a path matches nothing, or names a Hugging Face dataset while
            the source's format is another (the message says to set format: hf).
    """
    if format == "hf":
        return [loc for pattern in paths for loc in hf.expand(source, pattern)]
    out = [loc for pattern in paths for loc in storage.expand(source, pattern)]
    for loc in out:
        local = isinstance(loc.filesystem, pafs.LocalFileSystem)
        if loc.path.endswith(".arrow") or (
            local
            and os.path.isdir(loc.path)
            and any(os.path.isfile(os.path.join(loc.path, name)) for name in (hf.STATE, hf.DICT, hf.INFO))
        ):
            raise SourceReadError(
                f"source {source!r}: {loc.uri!r} is a Hugging Face datasets "
                f"{'Arrow file' if loc.path.endswith('.arrow') else 'directory'}, and the source's format is "
                f"{format!r}; set format: hf"
            )
    return out
