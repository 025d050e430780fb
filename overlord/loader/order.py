"""The deterministic order in which a Source Loader reads its stream.

The order is a pure function of (seed, source name, epoch, partition) and the row
counts of the source's row groups (read from Parquet footers), so any process —
the active loader, a shadow, a restarted one — derives the same sequence without
reading data, and a checkpoint only needs a cursor (epoch, seq).

    row groups of the source (files sorted, then row groups in file order)
        |  partition p of P keeps row group i where i % P == p
        v
    the partition's row groups, permuted by rng(seed, source, epoch, p)
        (or, for a curriculum, sorted by difficulty: easy to hard)
        |  concatenated: position 0 .. n-1
        v
    windows of `shuffle_window` positions, each permuted by rng(..., window)
        |
        v
    seq 0 .. n-1  ->  (file, row group, row in row group, row in file)

A stream is partition p of the source's P (`<source>.<p>`), or stream q of the P'
that a reshard made (overlord.runtime.reshard), which reads from that record's epoch
E on:

    epoch E     the record's remainder, cut in P' runs, run q:
                    deferred samples, one each           (parent, epoch, seq)
                  + each parent, in record order: its seqs after its cursor in its
                    cursor epoch, then every seq of each epoch after, through E
                    (a parent's order: this picture again, for its own stream)
                  = L samples; stream q's seq k is sample q*L//P' + k
    epoch > E   partition q of P', as above
    epoch < E   never read

A remainder is kept as runs of its parents' seqs (one per deferred sample and per
parent epoch), never as a list of seqs, and a sample is read where its parent's order
puts it, so a remainder reads a parent's window as that parent would.

Memory is O(row groups + reshard records), and a reader needs at most the row groups
that overlap one window at a time (the bounded shuffle window): `span` says which
window a seq is read in and which rows of its row group that window reads.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from overlord.errors import PlanError
from overlord.runtime.layout import stream_name
from overlord.runtime.reshard import Reshard

_PARENT_ORDERS = 8  # parent orders a remainder keeps built (an LRU): deferred samples hop between them


def _rng(seed: int, name: str, *words: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(name.encode()), *words])


@dataclass(frozen=True, slots=True)
class RowGroups:
    """Row-group table of a source: one entry per (file, row group), in file order."""

    file: np.ndarray  # int32: index into the source's sorted file list
    group: np.ndarray  # int32: row-group index inside its file
    rows: np.ndarray  # int64: rows in the row group
    first_row: np.ndarray  # int64: index of the group's first row inside its file
    difficulty: np.ndarray | None = None  # float64 per row group, for a curriculum

    @classmethod
    def from_counts(cls, counts: list[list[int]], difficulty: list[list[float]] | None = None) -> RowGroups:
        """Build from per-file lists of row-group row counts (and difficulties)."""
        file, group, rows, first = [], [], [], []
        for f, groups in enumerate(counts):
            start = 0
            for g, n in enumerate(groups):
                file.append(f)
                group.append(g)
                rows.append(n)
                first.append(start)
                start += n
        return cls(
            np.asarray(file, np.int32),
            np.asarray(group, np.int32),
            np.asarray(rows, np.int64),
            np.asarray(first, np.int64),
            None if difficulty is None else np.asarray([d for per_file in difficulty for d in per_file], np.float64),
        )

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True, slots=True)
class Row:
    """Where one seq of the order lives."""

    seq: int
    rg: int  # index into RowGroups
    file: int
    group: int
    row_in_group: int
    row_in_file: int


@dataclass(frozen=True, slots=True)
class Span:
    """Where one seq is read, and what its shuffle window reads of that row group."""

    row: Row
    window: Hashable  # the window's key: equal for two seqs (of any orders of a source) read in one window
    start: int  # rows [start, stop) of row group `row.rg` are the ones the window reads
    stop: int


class EpochOrder:
    """The order of one partition of one source in one epoch."""

    def __init__(
        self,
        groups: RowGroups,
        *,
        seed: int,
        source: str,
        epoch: int,
        partition: int,
        partitions: int,
        shuffle_window: int,
    ) -> None:
        self.groups = groups
        self.seed, self.source, self.epoch = seed, source, epoch
        self.partition, self.partitions, self.window = partition, partitions, shuffle_window
        mine = np.flatnonzero(np.arange(len(groups)) % partitions == partition)
        if groups.difficulty is None:
            self.rg_order = _rng(seed, source, epoch, partition, 0x52474F).permutation(mine)
        else:  # curriculum: easy to hard, ties in file order
            self.rg_order = mine[np.argsort(groups.difficulty[mine], kind="stable")]
        sizes = groups.rows[self.rg_order]
        # ends[i]: one past the last position covered by the i-th row group in order
        self.ends = np.cumsum(sizes)
        self.length = int(self.ends[-1]) if len(self.ends) else 0
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def _window_perm(self, k: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != k:
            n = min(self.window, self.length - k * self.window)
            perm = _rng(self.seed, self.source, self.epoch, self.partition, 0x57494E, k).permutation(n)
            self._perm_cache = (k, perm)
        return self._perm_cache[1]

    def position(self, seq: int) -> int:
        """Concatenated position read at `seq` (seq permuted inside its window)."""
        if not 0 <= seq < self.length:
            raise IndexError(f"seq {seq} outside epoch of {self.length} rows")
        k, i = divmod(seq, self.window)
        return k * self.window + int(self._window_perm(k)[i])

    def locate(self, seq: int) -> Row:
        """File, row group and row of `seq`."""
        return self._at(seq, self.position(seq))[0]

    def _at(self, seq: int, pos: int) -> tuple[Row, int]:
        """The row at concatenated position `pos`, and its row group's first position."""
        i = int(np.searchsorted(self.ends, pos, side="right"))
        rg = int(self.rg_order[i])
        start = int(self.ends[i] - self.groups.rows[rg])
        r = pos - start
        row = Row(
            seq=seq,
            rg=rg,
            file=int(self.groups.file[rg]),
            group=int(self.groups.group[rg]),
            row_in_group=r,
            row_in_file=int(self.groups.first_row[rg]) + r,
        )
        return row, start

    def span(self, seq: int) -> Span:
        """Where `seq` is read and the rows of its row group that its window reads (the
        group's part of the window's positions)."""
        pos = self.position(seq)
        row, first = self._at(seq, pos)
        k = seq // self.window
        lo = k * self.window
        hi = min(lo + self.window, self.length)
        size = int(self.groups.rows[row.rg])
        # the same window of the same order has the same key (a resharded stream's later
        # epoch may be a base partition's order: then they share rows, rightly)
        window = (self.epoch, self.partition, self.partitions, k)
        return Span(row, window, max(lo - first, 0), min(hi - first, size))

    def window_groups(self, seq: int) -> list[int]:
        """Row groups (indices into RowGroups) overlapping the window `seq` is read in."""
        return self.groups_for_window(seq // self.window)

    def groups_for_window(self, k: int) -> list[int]:
        """Row groups (indices into RowGroups) overlapping window k, in order."""
        lo, hi = k * self.window, min((k + 1) * self.window, self.length)
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.ends, hi - 1, side="right"))
        return [int(g) for g in self.rg_order[first : last + 1]]


class RemainderOrder:
    """A resharded stream's first epoch: its run of its record's remainder (module
    docstring). Seq k is a parent's seq, read where that parent's order puts it.

    Built by `Orders.order`; kept as runs (parent, epoch, first parent seq), so memory is
    O(runs), whatever the length.
    """

    def __init__(self, orders: Orders, record: Reshard, partition: int) -> None:
        self.orders = orders
        self.epoch = record.epoch
        total = orders.remainder_length(record)
        cut_lo = partition * total // record.partitions
        cut_hi = (partition + 1) * total // record.partitions
        self.length = cut_hi - cut_lo
        starts, parents, firsts = [], [], []
        at = 0  # the remainder position of the run's first sample
        for parent, epoch, lo, hi in orders.runs(record):
            a, b = max(lo, lo + cut_lo - at), min(hi, lo + cut_hi - at)
            if a < b:
                starts.append(at + a - lo - cut_lo)
                parents.append((parent, epoch))
                firsts.append(a)
            at += hi - lo
            if at >= cut_hi:
                break
        self._starts = np.asarray(starts, np.int64)  # seq of each run's first sample
        self._parents = parents  # (stream, epoch) each run reads
        self._firsts = np.asarray(firsts, np.int64)  # the parent seq each run starts at
        self._built: collections.OrderedDict[tuple[str, int], Order] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.length

    def parent_of(self, seq: int) -> tuple[str, int, int]:
        """(parent stream, epoch, parent seq) that `seq` reads."""
        if not 0 <= seq < self.length:
            raise IndexError(f"seq {seq} outside a remainder of {self.length} rows")
        i = int(np.searchsorted(self._starts, seq, side="right")) - 1
        parent, epoch = self._parents[i]
        return parent, epoch, int(self._firsts[i]) + seq - int(self._starts[i])

    def _parent(self, seq: int) -> tuple[Order, int]:
        parent, epoch, parent_seq = self.parent_of(seq)
        order = self._built.get((parent, epoch))
        if order is None:
            order = self._built[(parent, epoch)] = self.orders.order(parent, epoch)
            while len(self._built) > _PARENT_ORDERS:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end((parent, epoch))
        return order, parent_seq

    def locate(self, seq: int) -> Row:
        """File, row group and row of `seq`."""
        return self.span(seq).row

    def span(self, seq: int) -> Span:
        """Where `seq` is read: where its parent reads it, in the parent's window."""
        order, parent_seq = self._parent(seq)
        at = order.span(parent_seq)
        return Span(replace(at.row, seq=seq), at.window, at.start, at.stop)

    def window_groups(self, seq: int) -> list[int]:
        """Row groups overlapping the (parent's) window `seq` is read in."""
        order, parent_seq = self._parent(seq)
        return order.window_groups(parent_seq)


Order = EpochOrder | RemainderOrder


class Orders:
    """Every stream's order of one source, through the reshards of that source.

    Args:
        groups: the source's row groups.
        seed: the job seed.
        source: the source's name.
        partitions: the source's base partitions (Source.partitions).
        shuffle_window: Source.shuffle_window.
        reshards: the source's reshard records, oldest first (at least every one up to
            the one that made a stream asked about).

    Raises:
        PlanError: a record of another source, or one whose parent no earlier record
            (nor the base partitions) made.
    """

    def __init__(
        self,
        groups: RowGroups,
        *,
        seed: int,
        source: str,
        partitions: int,
        shuffle_window: int,
        reshards: Sequence[Reshard] = (),
    ) -> None:
        self.groups = groups
        self.seed, self.source = seed, source
        self.partitions, self.window = partitions, shuffle_window
        self._base = {stream_name(source, p): p for p in range(partitions)}
        self._made: dict[str, tuple[Reshard, int]] = {}  # stream -> (the record that made it, its partition)
        for record in reshards:
            if record.source != source:
                raise PlanError(
                    f"reshard {record.generation} is of source {record.source!r}, given for source {source!r}; "
                    "pass a source only its own records"
                )
            for parent, _, _ in record.parents:
                if parent not in self._base and parent not in self._made:
                    raise PlanError(
                        f"reshard {record.generation} of source {source!r} retires stream {parent!r}, which neither "
                        f"the source's {partitions} partitions nor an earlier reshard made; pass every record of "
                        "the source, oldest first"
                    )
            for q, name in enumerate(record.streams):
                self._made[name] = (record, q)
        self._totals: dict[int, int] = {}  # record generation -> remainder length

    def _record(self, stream: str) -> tuple[Reshard, int] | None:
        if stream in self._made:
            return self._made[stream]
        if stream in self._base:
            return None
        raise PlanError(
            f"stream {stream!r} is none of source {self.source!r}'s: not one of its {self.partitions} partitions "
            "nor made by a reshard given; pass every reshard record of the source up to the one that made it"
        )

    def first_epoch(self, stream: str) -> int:
        """The first epoch `stream` reads: 0, or its reshard's epoch."""
        made = self._record(stream)
        return 0 if made is None else made[0].epoch

    def describe(self, stream: str) -> str:
        """`partition p of P`, or which reshard made `stream`, for messages."""
        made = self._record(stream)
        if made is None:
            return f"partition {self._base[stream]} of {self.partitions}"
        record, q = made
        return f"stream {stream!r} (partition {q} of {record.partitions} from reshard {record.generation})"

    def is_remainder(self, stream: str, epoch: int) -> bool:
        """True where `stream`'s `epoch` is a remainder (its reshard's epoch)."""
        made = self._record(stream)
        return made is not None and made[0].epoch == epoch

    def _check_epoch(self, stream: str, epoch: int) -> tuple[Reshard, int] | None:
        made = self._record(stream)
        first = 0 if made is None else made[0].epoch
        if epoch < first:
            raise PlanError(
                f"source {self.source!r} {self.describe(stream)} starts at epoch {first}: it never reads epoch "
                f"{epoch}; resume it at a cursor of epoch {first} or later"
            )
        return made

    def order(self, stream: str, epoch: int) -> Order:
        """`stream`'s order in `epoch`.

        Raises:
            PlanError: `stream` is not the source's, or starts after `epoch`.
        """
        made = self._check_epoch(stream, epoch)
        if made is None:
            p, partitions = self._base[stream], self.partitions
        elif made[0].epoch == epoch:
            return RemainderOrder(self, *made)
        else:
            p, partitions = made[1], made[0].partitions
        return EpochOrder(
            self.groups,
            seed=self.seed,
            source=self.source,
            epoch=epoch,
            partition=p,
            partitions=partitions,
            shuffle_window=self.window,
        )

    def length(self, stream: str, epoch: int) -> int:
        """How many seqs `stream` has in `epoch`, without building its order."""
        made = self._check_epoch(stream, epoch)
        if made is None:
            p, partitions = self._base[stream], self.partitions
        elif made[0].epoch == epoch:
            record, q = made
            total = self.remainder_length(record)
            return (q + 1) * total // record.partitions - q * total // record.partitions
        else:
            p, partitions = made[1], made[0].partitions
        return int(self.groups.rows[p::partitions].sum())

    def remainder_length(self, record: Reshard) -> int:
        """L: the length of `record`'s whole remainder (every new stream's run together)."""
        total = self._totals.get(record.generation)
        if total is None:
            total = self._totals[record.generation] = sum(hi - lo for _, _, lo, hi in self.runs(record))
        return total

    def runs(self, record: Reshard) -> Iterator[tuple[str, int, int, int]]:
        """`record`'s remainder as runs (parent stream, epoch, first seq, end seq), in order.

        Raises:
            PlanError: a cursor or deferred sample outside its parent's epochs.
        """
        where = f"reshard {record.generation} of source {record.source!r}"
        cursors = {name: (epoch, seq) for name, epoch, seq in record.parents}
        for name, epoch, seq in record.deferred:
            if name not in cursors:
                raise PlanError(f"{where} defers ({name!r}, {epoch}, {seq}) of a stream it does not retire")
            if not self.first_epoch(name) <= epoch <= record.epoch or not 0 <= seq < self.length(name, epoch):
                raise PlanError(f"{where} defers ({name!r}, {epoch}, {seq}), which stream {name!r} never reads")
            yield name, epoch, seq, seq + 1
        for name, epoch, seq in record.parents:
            if not self.first_epoch(name) <= epoch <= record.epoch or not -1 <= seq < self.length(name, epoch):
                raise PlanError(
                    f"{where} has stream {name!r}'s cursor at ({epoch}, {seq}), outside its epochs "
                    f"{self.first_epoch(name)}..{record.epoch}"
                )
            for e in range(epoch, record.epoch + 1):
                first, end = (seq + 1 if e == epoch else 0), self.length(name, e)
                if first < end:
                    yield name, e, first, end
