"""A Source Loader: the one owner of a source partition's file state.

It reads Parquet row groups in the partition's deterministic order (see `order.py`),
applies the source's sample transform, and hands out prepared samples with their
metadata. File handles, footers and row-group buffers exist once here, never once per
trainer rank or worker. Bad input raises `SourceReadError` naming source, file and row;
with `on_error: skip` the row is dropped and counted instead.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overlord.autoscale.profile import Profile
from overlord.config import Source
from overlord.errors import SchemaError, SourceReadError
from overlord.loader.order import EpochOrder, RowGroups
from overlord.sidecar.layout import stream_name
from overlord.transforms import resolve, sample_metadata

_OPEN_FILES = 2  # open Parquet files kept per Source Loader (an LRU)


@dataclass(slots=True)
class Prepared:
    """One transformed sample and what the Planner needs to know about it."""

    epoch: int
    seq: int
    key: str
    arrays: dict[str, np.ndarray]
    tokens: int
    patches: int
    nbytes: int


class SourceLoader:
    """Reads one partition of one source, in order, through its transform.

    Args:
        source: the source's config.
        partition: which partition of the source this loader owns.
        seed: the job seed.
        epochs: stop after this many epochs; None cycles forever.
    """

    def __init__(self, source: Source, partition: int, *, seed: int, epochs: int | None) -> None:
        self.source = source
        self.partition = partition
        self.name = stream_name(source.name, partition)
        self.seed = seed
        self.epochs = epochs
        self.paths = source.files()
        self.transform: Callable = resolve(source.transform)
        self._files: collections.OrderedDict[int, pq.ParquetFile] = collections.OrderedDict()
        # row group -> its Arrow table, for the row groups of the current window; rows
        # become Python objects one at a time (columnar is several times smaller)
        self._rows: dict[int, pa.Table] = {}
        counts = [self._footer_counts(i) for i in range(len(self.paths))]
        difficulty = [self._footer_difficulty(i) for i in range(len(self.paths))] if source.difficulty else None
        self.groups = RowGroups.from_counts(counts, difficulty)
        self.epoch = 0
        self.seq = 0  # next seq to prepare in self.epoch
        self.skipped = 0
        self._delivered_in_epoch = 0  # samples prepared (not skipped) in self.epoch
        self._order = self._make_order(0)
        self.profile = Profile()  # what its samples cost (journaled for the auto-partitioner)
        self.workers = 1
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- files ---------------------------------------------------------------------------

    def _where(self, file: int) -> str:
        return f"source {self.source.name!r} file {self.paths[file]!r}"

    def _open(self, file: int) -> pq.ParquetFile:
        handle = self._files.get(file)
        if handle is not None:
            self._files.move_to_end(file)
            return handle
        try:
            handle = pq.ParquetFile(self.paths[file], memory_map=False)
        except FileNotFoundError:
            raise SourceReadError(f"{self._where(file)} is missing; restore it or remove it from Source.paths") from None
        except (pa.ArrowException, OSError) as exc:
            raise SourceReadError(
                f"{self._where(file)} is not a readable Parquet file ({exc}); "
                "replace the file or remove it from Source.paths"
            ) from None
        if self.source.columns:
            names = handle.schema_arrow.names
            missing = [c for c in self.source.columns if c not in names]
            if missing:
                raise SchemaError(
                    f"{self._where(file)} has no column(s) {missing}; it has {names}. "
                    "Fix Source.columns or the file"
                )
        self._files[file] = handle
        while len(self._files) > _OPEN_FILES:
            self._files.popitem(last=False)
        return handle

    def _footer_counts(self, file: int) -> list[int]:
        meta = self._open(file).metadata
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def _footer_difficulty(self, file: int) -> list[float]:
        """Midpoint of the difficulty column's min/max statistics, per row group."""
        handle = self._open(file)
        column = self.source.difficulty
        names = handle.schema_arrow.names
        if column not in names:
            raise SchemaError(f"{self._where(file)} has no difficulty column {column!r}; it has {names}. Fix Source.difficulty")
        index = handle.schema_arrow.get_field_index(column)
        out = []
        for g in range(handle.metadata.num_row_groups):
            stats = handle.metadata.row_group(g).column(index).statistics
            if stats is None or not stats.has_min_max or not isinstance(stats.min, (int, float)):
                raise SchemaError(
                    f"{self._where(file)} row group {g}: column {column!r} has no numeric min/max statistics, "
                    "which the curriculum order reads; rewrite the file with statistics or unset Source.difficulty"
                )
            out.append((float(stats.min) + float(stats.max)) / 2)
        return out

    def _read_group(self, rg: int) -> pa.Table:
        table = self._rows.get(rg)
        if table is not None:
            return table
        file, group = int(self.groups.file[rg]), int(self.groups.group[rg])
        try:
            table = self._open(file).read_row_group(group, columns=list(self.source.columns) if self.source.columns else None)
        except (pa.ArrowException, OSError) as exc:
            raise SourceReadError(
                f"{self._where(file)} row group {group} (rows from {int(self.groups.first_row[rg])}) "
                f"cannot be read ({exc}); replace the file or remove it from Source.paths"
            ) from None
        self._rows[rg] = table
        return table

    # -- order ---------------------------------------------------------------------------

    def _make_order(self, epoch: int) -> EpochOrder:
        return EpochOrder(
            self.groups,
            seed=self.seed,
            source=self.source.name,
            epoch=epoch,
            partition=self.partition,
            partitions=self.source.partitions,
            shuffle_window=self.source.shuffle_window,
        )

    @property
    def epoch_length(self) -> int:
        return len(self._order)

    @property
    def finished(self) -> bool:
        """True when every configured epoch has been read."""
        return self.epochs is not None and self.epoch >= self.epochs

    def start_at(self, epoch: int, seq: int) -> None:
        """Resume reading at (epoch, seq): the sample after a planner cursor."""
        if epoch != self.epoch:
            self.epoch = epoch
            if not self.finished:
                self._order = self._make_order(epoch)
        self.seq, self._delivered_in_epoch = seq, 0
        self._rows.clear()

    def prepare_at(self, epoch: int, seqs) -> list[Prepared]:
        """Prepare given samples out of order (deferred ones behind a resume cursor),
        leaving the reading position where it was."""
        saved = (self.epoch, self.seq, self._order, self._delivered_in_epoch)
        try:
            self.epoch, self._order = epoch, self._make_order(epoch)
            self._rows = {}
            out = []
            for seq in seqs:
                sample = self._prepare_one(int(seq))
                if sample is not None:
                    out.append(sample)
            return out
        finally:
            self.epoch, self.seq, self._order, self._delivered_in_epoch = saved
            self._rows = {}

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.seq = 0
        self._delivered_in_epoch = 0
        self._rows.clear()
        if not self.finished:
            self._order = self._make_order(self.epoch)

    # -- preparing samples ---------------------------------------------------------------

    def set_workers(self, workers: int) -> None:
        """Run transforms on `workers` threads (1: inline).

        Worker parallelism (paper, Section 5.1): rows are still read in order by this
        thread, and only the transforms overlap, so the samples, their order and their
        bytes do not depend on the worker count, which can change at any call.
        Transforms that release the GIL (image decode, numpy) gain the most.
        """
        workers = max(1, int(workers))
        if workers == self.workers:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"transform-{self.name}") if workers > 1 else None
        self.workers = workers

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def prepare(self, limit: int) -> tuple[list[Prepared], list[tuple[int, int]]]:
        """Prepare up to `limit` samples in order.

        Returns:
            (samples, ended): the prepared samples, all of one epoch, and (epoch,
            prepared count) for each epoch that ended during this call.

        Raises:
            SourceReadError: a file or row is bad and the policy is "raise".
        """
        out: list[Prepared] = []
        ended: list[tuple[int, int]] = []
        while len(out) < limit and not self.finished:
            if self.seq >= self.epoch_length:
                ended.append((self.epoch, self._delivered_in_epoch))
                self._advance_epoch()
                if out:
                    break  # one call never mixes epochs, so a metadata chunk has one epoch
                continue
            # read a run of rows in order, then transform them (overlapping on workers)
            seqs = range(self.seq, min(self.seq + limit - len(out), self.epoch_length))
            reads = [self._read(q) for q in seqs]
            self.seq = seqs.stop
            if self._pool is not None and len(reads) > 1:
                samples = list(self._pool.map(self._transform, reads))
            else:
                samples = [self._transform(r) for r in reads]
            for sample in samples:
                if sample is not None:
                    self._delivered_in_epoch += 1
                    out.append(sample)
        return out, ended

    def _prepare_one(self, seq: int) -> Prepared | None:
        return self._transform(self._read(seq))

    def state_bytes(self) -> int:
        """Memory of the file-access state: footers of open files, row groups of the window."""
        footers = sum(f.metadata.serialized_size for f in self._files.values())
        return footers + sum(t.nbytes for t in self._rows.values())

    def _read(self, seq: int) -> tuple[int, object, dict, float]:
        """(seq, where, row, seconds): one row, read in order (the file state is this thread's)."""
        started = time.perf_counter()
        order = self._order
        if seq % order.window == 0:
            # entering a new window: drop row groups the new window does not touch
            keep = set(order.groups_for_window(seq // order.window))
            self.profile.state_bytes = max(self.profile.state_bytes, self.state_bytes())
            for rg in [g for g in self._rows if g not in keep]:
                del self._rows[rg]
        where = order.locate(seq)
        row = self._read_group(where.rg).slice(where.row_in_group, 1).to_pylist()[0]
        return seq, where, row, time.perf_counter() - started

    def _transform(self, read) -> Prepared | None:
        """The sample transform of one row (thread-safe: touches no file state)."""
        seq, where, row, read_s = read
        started = time.perf_counter()
        key = f"{self.source.name}:{where.file}:{where.row_in_file}"
        try:
            arrays = self.transform(row)
            if not isinstance(arrays, dict) or not all(isinstance(v, np.ndarray) for v in arrays.values()):
                raise TypeError(f"returned {type(arrays).__name__}; a transform must return dict[str, numpy.ndarray]")
        except Exception as exc:  # noqa: BLE001 - any user transform failure is reported the same way
            if self.source.on_error == "skip":
                with self._lock:
                    self.skipped += 1
                return None
            raise SourceReadError(
                f"{self._where(where.file)} row {where.row_in_file}: transform "
                f"{self.source.transform} raised {type(exc).__name__}: {exc}. "
                "Fix the data or the transform, or set on_error: skip on the source"
            ) from exc
        tokens, patches, nbytes = sample_metadata(arrays)
        with self._lock:
            self.profile.record(read_s + time.perf_counter() - started, nbytes)
        return Prepared(self.epoch, seq, key, arrays, tokens, patches, nbytes)
