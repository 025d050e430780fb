"""Hugging Face `datasets` on local disk as a source format (`Source.format: hf`).

`datasets` keeps a dataset as Arrow IPC *stream* files, whether `save_to_disk` wrote
them or `load_dataset` cached them. This format memory-maps those files and reads them
with pyarrow alone: the `datasets` package is not needed to read, and nothing is copied
into memory that a row being read does not touch.

What an entry of `Source.paths` may name (`expand`):

    /data/wiki                  a directory `Dataset.save_to_disk` wrote (state.json,
                                dataset_info.json, data-00000-of-00003.arrow, ...): its
                                files in state.json's order
    /data/wiki_dd/train         one split of a saved DatasetDict (dataset_dict.json and
                                one such directory per split); the DatasetDict's own
                                directory is refused with its splits listed
    ~/.cache/huggingface/datasets/json/default-1a2b/0.0.0/9f8e/train
                                one split of a dataset in the HF cache: the directory
                                holding its dataset_info.json, then the split's name
                                (its files are <name>-train.arrow, or
                                <name>-train-00000-of-00004.arrow ...)
    /data/x/*.arrow             Arrow stream files or a glob of them (`ds.cache_files`)

Files are local (a memory map needs one); for object stores write Parquet
(`ds.to_parquet`) and use `format: parquet`. Any Arrow IPC stream is accepted, with or
without the schema metadata `datasets` adds.

A file, and what opening it keeps (O(record batches) integers, for the loader's life):

    bytes | schema | record batch 0 | record batch 1 | ... | end of stream |
                   ^ offset, length, rows of each batch's message

Opening scans the message headers (the map is touched only there), and a row group is a
record batch, cut into blocks of at most `BLOCK_ROWS` rows when larger (datasets writes
1,000 rows a batch, fewer for images and audio), so the row groups, the order and the
sample keys are a pure function of the file. Reading a row group is zero-copy slices of
the map; the pages it touches belong to the page cache, which the kernel can drop.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from overlord.errors import SchemaError, SourceReadError
from overlord.loader import storage
from overlord.loader.storage import Location

BLOCK_ROWS = 1024  # most rows in one row group; a larger record batch is cut into blocks
STATE, INFO, DICT = "state.json", "dataset_info.json", "dataset_dict.json"  # datasets' metadata files

# what a file that is not an Arrow stream starts with, and what to do about it
_MAGIC = (
    (
        b"ARROW1",
        "it is an Arrow IPC file (Feather v2), not the Arrow stream datasets writes; "
        "load it with pyarrow.feather and write Parquet (format: parquet)",
    ),
    (b"PAR1", "it is a Parquet file: give it to a source with format: parquet"),
    (b"{", "it is JSON text: for a save_to_disk directory give the directory, for JSON lines use format: jsonl"),
)


# -- what a path names -------------------------------------------------------------------


def expand(source: str, pattern: str) -> list[Location]:
    """The Arrow files `pattern` names, in the dataset's order (see the module docstring).

    Args:
        source: the source's name, for messages.
        pattern: a datasets directory, "<directory>/<split>", an Arrow file or a glob.

    Raises:
        SourceReadError: the pattern names nothing readable; the message says what to give.
    """
    if storage.is_uri(pattern):
        raise SourceReadError(
            f"source {source!r}: path {storage.redact(pattern)!r} is a URI, and format 'hf' memory-maps local "
            "files; copy the dataset to local disk, or write it as Parquet (ds.to_parquet) and use format: parquet"
        )
    path = os.path.expanduser(pattern).rstrip("/") or "/"
    if os.path.isdir(path):
        return _directory(source, path)
    parent, split = os.path.split(path)
    if not os.path.exists(path) and os.path.isfile(os.path.join(parent, INFO)) and not glob.has_magic(path):
        return _cache_split(source, parent, split)
    hits = sorted(glob.glob(path))
    if not hits:
        raise SourceReadError(
            f"source {source!r}: path {pattern!r} matches no file; give a directory save_to_disk wrote, "
            "<dataset directory>/<split>, or Arrow files (ds.cache_files)"
        )
    out: list[Location] = []
    for hit in hits:
        out += _directory(source, hit) if os.path.isdir(hit) else [_local(hit)]
    return out


def _local(path: str) -> Location:
    return Location(path, pafs.LocalFileSystem(), os.path.abspath(path))


def _json(source: str, path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError) as exc:
        raise SourceReadError(f"source {source!r}: {path!r} cannot be read as JSON ({exc}); restore it") from None
    if not isinstance(value, dict):
        raise SourceReadError(f"source {source!r}: {path!r} holds a JSON {type(value).__name__}, not an object")
    return value


def _directory(source: str, path: str) -> list[Location]:
    """The files of a datasets directory: a saved Dataset, or a refusal that names the splits."""
    if os.path.isfile(os.path.join(path, STATE)):
        state = _json(source, os.path.join(path, STATE))
        if state.get("_indices_data_files"):  # datasets 1.x kept a select/shuffle as an indices file
            raise SourceReadError(
                f"source {source!r}: {path!r} was saved with an indices mapping (an old datasets' select or "
                "shuffle), which this reader does not apply; load it and save it again with datasets >= 2 "
                "(save_to_disk writes the selected rows themselves)"
            )
        named = [f.get("filename") for f in state.get("_data_files") or () if isinstance(f, dict)]
        files = [f for f in named if isinstance(f, str)]
        if not files or len(files) != len(named):
            raise SourceReadError(
                f"source {source!r}: {os.path.join(path, STATE)!r} lists no data files; save the dataset again"
            )
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise SourceReadError(
                f"source {source!r}: {path!r} lacks {missing} that its {STATE} lists; save the dataset again"
            )
        return [_local(os.path.join(path, f)) for f in files]
    if os.path.isfile(os.path.join(path, DICT)):
        splits = _json(source, os.path.join(path, DICT)).get("splits") or []
        raise SourceReadError(
            f"source {source!r}: {path!r} is a DatasetDict with splits {list(splits)}; point Source.paths at one "
            f"split, e.g. {os.path.join(path, str(splits[0]) if splits else 'train')!r} (a source per split to read several)"
        )
    if os.path.isfile(os.path.join(path, INFO)):
        splits = list(_json(source, os.path.join(path, INFO)).get("splits") or {})
        raise SourceReadError(
            f"source {source!r}: {path!r} is a cached dataset with splits {splits}; point Source.paths at one "
            f"split, e.g. {os.path.join(path, splits[0] if splits else 'train')!r}"
        )
    raise SourceReadError(
        f"source {source!r}: directory {path!r} is not a datasets directory (no {STATE}, {DICT} or {INFO}); "
        "give the directory ds.save_to_disk wrote, <dataset directory>/<split>, or Arrow files"
    )


def _cache_split(source: str, path: str, split: str) -> list[Location]:
    """The Arrow files of `split` in a cache directory (dataset_info.json beside them), in
    shard order: <name>-<split>.arrow, or <name>-<split>-00000-of-00004.arrow ..."""
    splits = list(_json(source, os.path.join(path, INFO)).get("splits") or {})
    if split not in splits:
        raise SourceReadError(
            f"source {source!r}: the dataset in {path!r} has no split {split!r}; its splits are {splits}"
        )
    shape = re.compile(rf"^(?P<name>.+)-{re.escape(split)}(?:-(?P<shard>\d+)-of-(?P<of>\d+))?\.arrow$")
    found = sorted(
        (m.group("name"), int(m.group("of") or 1), int(m.group("shard") or 0), name)
        for name in os.listdir(path)
        if (m := shape.match(name))
    )
    kinds = {(name, of) for name, of, _, _ in found}
    if len(kinds) != 1 or [shard for _, _, shard, _ in found] != list(range(found[0][1])):
        listed = [name for *_, name in found]
        raise SourceReadError(
            f"source {source!r}: split {split!r} in {path!r} should be one <name>-{split}.arrow or every shard "
            f"<name>-{split}-NNNNN-of-NNNNN.arrow; found {listed} (a cache written as Parquet, or still being "
            "written?); give its files as Source.paths instead"
        )
    return [_local(os.path.join(path, name)) for *_, name in found]


# -- reading -----------------------------------------------------------------------------


def _invalid(what: str) -> pa.ArrowInvalid:
    """An error that says what the file is instead (the Source Loader adds which file)."""
    exc = pa.ArrowInvalid(what)
    exc.ours = True
    return exc


class _Index:
    """Where each row group of a stream file lies: its message (offset, length), its first
    row in that record batch, its rows."""

    def __init__(self, data: pa.MemoryMappedFile, block_rows: int) -> None:
        head = data.read_at(min(8, data.size()), 0)
        for magic, what in _MAGIC:
            if head.startswith(magic):
                raise _invalid(what)
        try:
            self._scan(data, block_rows)
        except pa.ArrowInvalid as exc:
            if getattr(exc, "ours", False):
                raise
            raise pa.ArrowInvalid(
                f"it is not the Arrow stream datasets writes ({exc}); give a dataset's .arrow files or the "
                "directory save_to_disk wrote"
            ) from None

    def _scan(self, data: pa.MemoryMappedFile, block_rows: int) -> None:
        reader = pa.ipc.MessageReader.open_stream(data)
        schema: pa.Schema | None = None
        offsets, lengths, starts, rows = [], [], [], []
        while True:
            at = data.tell()
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type == "schema":
                schema = pa.ipc.read_schema(message)
            elif message.type == "record batch" and schema is not None:
                n = pa.ipc.read_record_batch(message, schema).num_rows
                for start in range(0, max(n, 1), block_rows):
                    if n:  # an empty batch is no row group
                        offsets.append(at)
                        lengths.append(data.tell() - at)
                        starts.append(start)
                        rows.append(min(block_rows, n - start))
            elif message.type == "dictionary batch":
                raise _invalid(
                    "it has dictionary-encoded columns, which this reader does not read; "
                    "cast them to plain types (ds.cast) and save again, or write Parquet"
                )
            else:
                raise _invalid(
                    f"it has a {message.type!r} message where the Arrow stream of a dataset has record batches"
                )
        if schema is None:
            raise _invalid("it is not an Arrow stream: no schema message at its start")
        self.schema = schema
        self.offsets, self.lengths, self.starts, self.rows = (
            np.asarray(v, np.int64) for v in (offsets, lengths, starts, rows)
        )
        self.nbytes = 4 * self.rows.nbytes


class HfFile:
    """One memory-mapped Arrow stream file of a dataset, read by row group."""

    nbytes = 0  # the index is the format's

    def __init__(self, data: pa.MemoryMappedFile, where: str, index: _Index) -> None:
        self.data, self.where, self.index = data, where, index
        self.names = index.schema.names

    def group_rows(self) -> list[int]:
        return self.index.rows.tolist()

    def _batch(self, group: int) -> pa.RecordBatch:
        idx = self.index
        self.data.seek(int(idx.offsets[group]))  # one reading thread per file (the Source Loader's)
        message = pa.ipc.read_message(self.data.read_buffer(int(idx.lengths[group])))  # zero-copy: a slice of the map
        return pa.ipc.read_record_batch(message, idx.schema).slice(int(idx.starts[group]), int(idx.rows[group]))

    def difficulty(self, column: str) -> list[float]:
        """Midpoint of the column's min and max, per row group (computed: Arrow streams
        keep no statistics; reads that one column of the file once)."""
        if column not in self.names:
            raise SchemaError(
                f"{self.where} has no difficulty column {column!r}; it has {self.names}. Fix Source.difficulty"
            )
        kind = self.index.schema.field(column).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise SchemaError(
                f"{self.where}: difficulty column {column!r} is {kind}, not numeric; fix Source.difficulty"
            )
        out = []
        for g in range(len(self.index.rows)):
            low, high = pc.min_max(self._batch(g).column(column)).values()
            if not low.is_valid:
                raise SchemaError(
                    f"{self.where} row group {g}: difficulty column {column!r} is all null; fill it or unset Source.difficulty"
                )
            out.append((float(low.as_py()) + float(high.as_py())) / 2)
        return out

    def read_group(self, group: int, columns: tuple[str, ...] | None) -> storage.ArrowChunk:
        batch = self._batch(group)
        return storage.ArrowChunk(batch.select(list(columns)) if columns else batch, mapped=True)


class HfFormat:
    """Opens a dataset's Arrow files as memory maps; keeps each file's index for the
    Source Loader's life, so a file closed by the loader's LRU is not scanned again."""

    label = "Hugging Face datasets (Arrow stream)"

    def __init__(self) -> None:
        self.block_rows = BLOCK_ROWS
        self._index: dict[str, _Index] = {}

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._index.values())

    def open(self, location: Location, where: str) -> HfFile:
        data = pa.memory_map(location.path)
        index = self._index.get(location.uri)
        if index is None:
            index = self._index[location.uri] = _Index(data, self.block_rows)
        return HfFile(data, where, index)
