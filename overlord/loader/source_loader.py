"""A Source Loader: the one owner of a source stream's file state.

It reads row groups (Parquet's own, JSONL blocks: `formats.py`, or the record batches of
a Hugging Face dataset's Arrow files: `hf.py`) of files on any filesystem (`storage.py`,
local only for `hf`) in the stream's deterministic order (`order.py`: a partition of the
source, or a stream a reshard made, overlord.runtime.reshard), applies
the source's sample transform, and hands out prepared samples with their metadata. File
handles, footers and row-group buffers exist once here, never once per trainer rank or
worker. Bad input raises `SourceReadError` naming source, file and row; with
`on_error: skip` the row is dropped and counted instead.

What `on_error: skip` covers (the unit skipped, decided by the file's bytes only, so an
active, shadow or restarted loader skips the same; counted per file, `skips.py`):

    a file that is not the format's (random bytes, truncated)   the file, at start
    a file lacking a declared column (Source.columns)            the file, at start
    a row group (JSONL block, Arrow record batch) not decoding   its rows, in order
    a bad row, a transform that raises or breaks the contract    the row
    a sample larger than the sample ring can ever hold           the sample

A stream whose every row of an epoch is skipped ends the job with a SourceReadError
naming the source and the counts (a stream that never yields would stall every step).
A resharded stream's first epoch (its part of the remainder) is not a whole epoch: it
may be short, even empty, and then just ends with no sample.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from overlord.config import Source
from overlord.errors import ConfigError, SchemaError, SourceReadError
from overlord.loader import storage
from overlord.loader.contract import ContractError, check_sample
from overlord.loader.formats import FORMATS, BadRow, Chunk, OpenFile, locations
from overlord.loader.inflight import Inflight
from overlord.loader.order import Order, Orders, RowGroups
from overlord.loader.profile import Profile
from overlord.loader.skips import Skips
from overlord.runtime.layout import stream_name
from overlord.runtime.reshard import Reshard
from overlord.shm import batch_nbytes
from overlord.transforms import build, sample_metadata

_OPEN_FILES = 2  # open files kept per Source Loader (an LRU)
# the largest record meta a loader process adds to a sample in the sample ring (flow.push)
_META_BOUND = {"s": 1 << 31, "e": 1 << 31, "q": 1 << 62, "t": 1 << 62, "b": 1 << 31, "m": 1 << 31}


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


class _UnreadableGroup:
    """A row group that cannot be read, skipped under on_error: skip: each row is bad."""

    nbytes = 0

    def __init__(self, why: str) -> None:
        self.why = why

    def row(self, i: int) -> dict:
        raise BadRow(self.why)

    def rows(self, start: int, stop: int) -> _UnreadableGroup:
        return self


class SourceLoader:
    """Reads one stream of one source, in order, through its transform.

    Args:
        source: the source's config.
        partition: which partition of the source this loader owns (of the reshard that
            made `stream`, for a resharded one).
        seed: the job seed.
        epochs: stop after this many epochs; None cycles forever.
        context_length: the job's BatchSpec.context_length, for a transform built from
            `Source.transform_args` that truncates to it (see transforms.build).
        vocab_size: the job's BatchSpec.vocab_size: token ids at or above it are bad rows
            (the transform output contract, contract.py).
        max_sample_bytes: the largest record the loader-to-constructor ring can ever
            hold (`ring_max_record(Job.sample_ring_bytes)`); a larger sample is a bad
            row. None: not checked here.
        stream: the stream's name; None: `<source>.<partition>`, a base partition.
        reshards: the source's reshard records, oldest first, through the one that made
            `stream` (overlord.runtime.reshard); a resharded stream starts at that
            record's epoch, seq 0.
    """

    def __init__(
        self,
        source: Source,
        partition: int,
        *,
        seed: int,
        epochs: int | None,
        context_length: int | None = None,
        vocab_size: int | None = None,
        max_sample_bytes: int | None = None,
        stream: str | None = None,
        reshards: Sequence[Reshard] = (),
    ) -> None:
        self.source = source
        self.partition = partition
        self.name = stream or stream_name(source.name, partition)
        self.seed = seed
        self.epochs = epochs
        self.vocab_size = vocab_size
        self.max_sample_bytes = max_sample_bytes
        self.locations = locations(source.name, source.format, source.paths)
        self.paths = [loc.uri for loc in self.locations]
        try:
            self.transform: Any = build(source.transform, source.transform_args, context_length=context_length)
        except ConfigError as exc:
            raise ConfigError(f"source {source.name!r}: {exc}") from None
        self.format = FORMATS[source.format]()
        self._files: collections.OrderedDict[int, OpenFile] = collections.OrderedDict()
        # (row group, window key: order.Span) -> (the rows of the group that the window
        # reads, as an Arrow table or raw JSONL lines, and the first one's index in the
        # group): a window holds only its own rows, so a row group the shuffle window
        # straddles is read once per window it overlaps, never held whole for both. Window
        # None: a group held whole while windows read it (a compressed JSONL file,
        # decompressed whole at each read). Rows become Python objects one at a time.
        self._rows: dict[tuple[int, Hashable | None], tuple[Chunk, int]] = {}
        self._window: Hashable | None = None  # the window the last row was read in
        self.skips = Skips(source.name, self.name)
        # a file skipped whole (on_error: skip) has no row groups: the order never reaches it
        readable = [self._survey(i) for i in range(len(self.paths))]
        counts = [self._open(i).group_rows() if ok else [] for i, ok in enumerate(readable)]
        difficulty = (
            [self._open(i).difficulty(source.difficulty) if ok else [] for i, ok in enumerate(readable)]
            if source.difficulty
            else None
        )
        self.groups = RowGroups.from_counts(counts, difficulty)
        self._orders = Orders(
            self.groups,
            seed=seed,
            source=source.name,
            partitions=source.partitions,
            shuffle_window=source.shuffle_window,
            reshards=reshards,
        )
        self.epoch = self._orders.first_epoch(self.name)
        self.seq = 0  # next seq to prepare in self.epoch
        self._delivered_in_epoch = 0  # samples prepared (not skipped) in self.epoch
        # self.epoch is a whole epoch read from seq 0 by this loader (not resumed mid-epoch,
        # not a remainder): one whose every row was skipped can never yield
        self._whole_epoch = not self._orders.is_remainder(self.name, self.epoch)
        self._order = self._make_order(self.epoch)
        self.profile = Profile()  # what its samples cost (journaled for the auto-partitioner)
        self.workers = 1
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # where the loader process records the sample each thread transforms (inflight.py)
        self.inflight: Inflight | None = None
        self.stream_id = 0

    # -- files ---------------------------------------------------------------------------

    def _where(self, file: int) -> str:
        return f"source {self.source.name!r} file {self.paths[file]!r}"

    @property
    def skipped(self) -> int:
        """Rows skipped so far (on_error: skip), every cause; per file in `self.skips`."""
        return self.skips.rows

    def _survey(self, file: int) -> bool:
        """Open `file` at start; False when on_error: skip skips it whole."""
        return self._open(file, survey=True) is not None

    def _open(self, file: int, survey: bool = False) -> OpenFile:
        handle = self._files.get(file)
        if handle is not None:
            self._files.move_to_end(file)
            return handle
        skip = survey and self.source.on_error == "skip"
        try:
            handle = self.format.open(self.locations[file], self._where(file))
        except FileNotFoundError:
            raise SourceReadError(
                f"{self._where(file)} is missing; restore it or remove it from Source.paths"
            ) from None
        except PermissionError as exc:  # the machine's doing, not the file's bytes: never skipped
            raise SourceReadError(f"{self._where(file)} cannot be opened ({exc}); fix its permissions") from None
        except (pa.ArrowException, OSError) as exc:
            why = f"not a readable {self.format.label} file ({storage.redact(str(exc))})"
            if skip:
                self.skips.file(file, self.paths[file], why)
                return None  # type: ignore[return-value]  # only _survey asks, with survey=True
            remote = f" ({storage.hint(self.paths[file])})" if storage.is_uri(self.paths[file]) else ""
            raise SourceReadError(
                f"{self._where(file)} is {why}; replace the file, remove it from Source.paths, "
                f"or set on_error: skip on the source to skip it{remote}"
            ) from None
        if self.source.columns and handle.names is not None:
            names = handle.names
            missing = [c for c in self.source.columns if c not in names]
            if missing:
                if skip:
                    self.skips.file(file, self.paths[file], f"no column(s) {missing} of Source.columns; it has {names}")
                    return None  # type: ignore[return-value]
                raise SchemaError(
                    f"{self._where(file)} has no column(s) {missing}; it has {names}. "
                    "Fix Source.columns or the file, or set on_error: skip on the source to skip such files"
                )
        self._files[file] = handle
        while len(self._files) > _OPEN_FILES:
            self._files.popitem(last=False)
        return handle

    def _read_group(self, rg: int, window: Hashable, start: int, stop: int) -> tuple[Chunk, int]:
        """Rows [start, stop) of row group `rg`, which `window` reads, and the index of the
        first in the group (0 where the chunk is the whole group)."""
        for key in ((rg, window), (rg, None)):
            held = self._rows.get(key)
            if held is not None:
                return held
        file, group = int(self.groups.file[rg]), int(self.groups.group[rg])
        try:
            chunk = self._open(file).read_group(group, self.source.columns)
        except (pa.ArrowException, OSError) as exc:
            why = f"cannot be read ({storage.redact(str(exc))})"
            if self.source.on_error != "skip":
                raise SourceReadError(
                    f"{self._where(file)} row group {group} (rows {int(self.groups.first_row[rg])} to "
                    f"{int(self.groups.first_row[rg] + self.groups.rows[rg]) - 1}) {why}; replace the file, "
                    "remove it from Source.paths, or set on_error: skip on the source to skip its unreadable parts"
                ) from None
            self.skips.group(file, self.paths[file], group, why)
            chunk = _UnreadableGroup(f"row group {group} {why}")
        part = chunk if (start, stop) == (0, int(self.groups.rows[rg])) else chunk.rows(start, stop)
        held = (chunk, 0) if part is None else (part, start if part is not chunk else 0)
        self._rows[(rg, None if part is None else window)] = held
        return held

    # -- order ---------------------------------------------------------------------------

    def _make_order(self, epoch: int) -> Order:
        return self._orders.order(self.name, epoch)

    @property
    def epoch_length(self) -> int:
        return len(self._order)

    @property
    def finished(self) -> bool:
        """True when every configured epoch has been read."""
        return self.epochs is not None and self.epoch >= self.epochs

    def start_at(self, epoch: int, seq: int) -> None:
        """Resume reading at (epoch, seq): the sample after a planner cursor.

        Raises:
            PlanError: `epoch` is before the stream's first (a resharded stream's).
        """
        if epoch != self.epoch:
            order = None if self.epochs is not None and epoch >= self.epochs else self._make_order(epoch)
            self.epoch = epoch
            if order is not None:
                self._order = order
        self.seq, self._delivered_in_epoch = seq, 0
        self._whole_epoch = seq == 0 and not self._orders.is_remainder(self.name, epoch)
        self._forget_rows()

    def prepare_at(self, epoch: int, seqs) -> list[Prepared]:
        """Prepare given samples out of order (deferred ones behind a resume cursor),
        leaving the reading position where it was."""
        saved = (self.epoch, self.seq, self._order, self._delivered_in_epoch)
        try:
            order = self._make_order(epoch)
            self.epoch, self._order = epoch, order
            self._forget_rows()
            out = []
            for seq in seqs:
                sample = self._prepare_one(int(seq))
                if sample is not None:
                    out.append(sample)
            return out
        finally:
            self.epoch, self.seq, self._order, self._delivered_in_epoch = saved
            self._forget_rows()

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.seq = 0
        self._delivered_in_epoch = 0
        self._whole_epoch = True  # an epoch after the first: never a remainder
        self._forget_rows()
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
                if self._delivered_in_epoch == 0 and self._whole_epoch and self.skips.any:
                    raise SourceReadError(self._nothing_left())
                ended.append((self.epoch, self._delivered_in_epoch))
                self._advance_epoch()
                if out:
                    break  # one call never mixes epochs, so a metadata chunk has one epoch
                continue
            # read a run of rows in order, then transform them (overlapping on workers)
            seqs = range(self.seq, min(self.seq + limit - len(out), self.epoch_length))
            reads = [self._read(q) for q in seqs]
            self.seq = seqs.stop
            for read, sample in zip(reads, self._transform_all(reads)):
                sample = self._fits(read, sample)
                if sample is not None:
                    self._delivered_in_epoch += 1
                    out.append(sample)
        return out, ended

    def _prepare_one(self, seq: int) -> Prepared | None:
        read = self._read(seq)
        return self._fits(read, self._transform(read))

    def _fits(self, read, sample: Prepared | None) -> Prepared | None:
        """`sample`, or a bad row when it is larger than the sample ring can ever hold
        (it would stop the loader process at the push; this names it and honours skip)."""
        limit = self.max_sample_bytes
        if sample is None or limit is None or sample.nbytes <= limit // 2:
            return sample  # the record's header and meta are far below half a ring (>= 64 KiB)
        size = batch_nbytes(sample.arrays, {**_META_BOUND, "k": sample.key})
        if size <= limit:
            return sample
        return self._reject(
            read[1],
            f"the sample is {size} B as a ring record ({sample.nbytes} B of arrays), larger than the "
            f"largest record the loader-to-constructor ring can hold ({limit} B); raise Job.sample_ring_bytes "
            "or make the transform's samples smaller",
            None,
        )

    def _nothing_left(self) -> str:
        return (
            f"source {self.source.name!r} {self._orders.describe(self.name)}: every row of "
            f"epoch {self.epoch} was skipped (on_error: skip), so it can never yield a sample: "
            f"{self.skipped} row(s) skipped; {self.skips.summary()}. Fix or replace those files, or remove them "
            "from Source.paths"
        )

    def state_bytes(self) -> int:
        """Memory of the file-access state: footers of open files (or JSONL's line index),
        row groups of the window."""
        footers = self.format.nbytes + sum(f.nbytes for f in self._files.values())
        return footers + sum(t.nbytes for t, _ in self._rows.values())

    def _forget_rows(self) -> None:
        self._rows.clear()
        self._window = None

    def _read(self, seq: int) -> tuple[int, object, dict | BadRow, float]:
        """(seq, where, row, seconds): one row, read in order (the file state is this thread's)."""
        started = time.perf_counter()
        order = self._order
        span = order.span(seq)  # the row, its window (a parent's, in a remainder), the rows it reads
        if span.window != self._window:
            # entering another window: drop the rows of the others (and whole row groups
            # the new window does not touch)
            keep = set(order.window_groups(seq))
            self.profile.state_bytes = max(self.profile.state_bytes, self.state_bytes())
            for key in [k for k in self._rows if k[1] != span.window and (k[1] is not None or k[0] not in keep)]:
                del self._rows[key]
            self._window = span.window
        where = span.row
        row: dict[str, Any] | BadRow
        try:
            chunk, offset = self._read_group(where.rg, span.window, span.start, span.stop)
            row = chunk.row(where.row_in_group - offset)
        except BadRow as bad:
            row = bad  # a bad row is reported (or skipped) where transform failures are
        return seq, where, row, time.perf_counter() - started

    def _transform_all(self, reads: list) -> list[Prepared | None]:
        """The transforms of a run of rows, in order, on the workers if there are several.

        A transform with a `batch` method (e.g. `transforms_hf.Tokenize`, whose tokenizer
        encodes a batch in one call that releases the GIL) gets one contiguous slice of the
        run per worker; any other is called row by row.
        """
        if getattr(self.transform, "batch", None) is None:
            if self._pool is not None and len(reads) > 1:
                return list(self._pool.map(self._transform, reads))
            return [self._transform(r) for r in reads]
        if self._pool is None or len(reads) == 1:
            return self._transform_batch(reads)
        size = -(-len(reads) // self.workers)
        slices = [reads[i : i + size] for i in range(0, len(reads), size)]
        return [sample for part in self._pool.map(self._transform_batch, slices) for sample in part]

    def _transform_batch(self, reads: list) -> list[Prepared | None]:
        """A batch transform over `reads` (thread-safe). Bad rows are rejected one by one;
        a batch that raises is done again row by row, so the error (or skip) names its row."""
        good = [r for r in reads if not isinstance(r[2], BadRow)]
        started = time.perf_counter()
        slot = self._enter(good[0][1], len(good)) if good else None
        try:
            outs = self.transform.batch([r[2] for r in good]) if good else []
        except Exception:  # noqa: BLE001 - the row-by-row pass below finds and reports the row
            return [self._transform(r) for r in reads]
        finally:
            if slot is not None:
                self.inflight.leave(slot)  # type: ignore[union-attr]  # _enter gave a slot
        if not isinstance(outs, list) or len(outs) != len(good):
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise SourceReadError(
                f"source {self.source.name!r}: transform {self.source.transform}'s batch() returned {got} for "
                f"{len(good)} rows; a batch transform returns a list with one dict[str, numpy.ndarray] per row"
            )
        each = (time.perf_counter() - started) / max(1, len(good))
        done = iter(outs)
        return [self._transform(r) if isinstance(r[2], BadRow) else self._finish(r, next(done), each) for r in reads]

    def _transform(self, read) -> Prepared | None:
        """The sample transform of one row (thread-safe: touches no file state)."""
        _, where, row, _ = read
        started = time.perf_counter()
        if isinstance(row, BadRow):
            return self._reject(where, str(row), None)
        slot = self._enter(where, 1)
        try:
            arrays = self.transform(row)
        except Exception as exc:  # noqa: BLE001 - any user transform failure is reported the same way
            return self._reject(where, f"transform {self.source.transform} raised {type(exc).__name__}: {exc}", exc)
        finally:
            if slot is not None:
                self.inflight.leave(slot)  # type: ignore[union-attr]  # _enter gave a slot
        return self._finish(read, arrays, time.perf_counter() - started)

    def _enter(self, where, rows: int) -> int | None:
        """Record in the process's in-flight table (if any) the row(s) about to be
        transformed: what a deadline or a dead process names."""
        if self.inflight is None:
            return None
        return self.inflight.enter(self.stream_id, where.file, where.row_in_file, rows)

    def _finish(self, read, arrays, seconds: float) -> Prepared | None:
        """A transform's output for one row, checked, as a Prepared sample."""
        seq, where, _, read_s = read
        try:
            arrays = check_sample(arrays, vocab_size=self.vocab_size)
        except ContractError as exc:  # the output contract (contract.py): a bad row like any other
            return self._reject(
                where, f"the output of transform {self.source.transform} breaks the contract: {exc}", exc
            )
        key = f"{self.source.name}:{where.file}:{where.row_in_file}"
        tokens, patches, nbytes = sample_metadata(arrays)
        with self._lock:
            self.profile.record(read_s + seconds, nbytes)
        return Prepared(self.epoch, seq, key, arrays, tokens, patches, nbytes)

    def _reject(self, where, what: str, cause: Exception | None) -> Prepared | None:
        """A bad row: counted and dropped under on_error: skip, else raised naming it."""
        if self.source.on_error == "skip":
            self.skips.row(where.file, self.paths[where.file], where.row_in_file, what)
            return None
        raise SourceReadError(
            f"{self._where(where.file)} row {where.row_in_file}: {what}. "
            "Fix the data or the transform, or set on_error: skip on the source"
        ) from cause
