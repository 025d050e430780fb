"""The deterministic order in which a Source Loader reads its partition.

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

Memory is O(row groups), and a reader needs at most the row groups that overlap one
window at a time (the bounded shuffle window).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np


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
        self.partition, self.window = partition, shuffle_window
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
        pos = self.position(seq)
        i = int(np.searchsorted(self.ends, pos, side="right"))
        rg = int(self.rg_order[i])
        start = int(self.ends[i] - self.groups.rows[rg])
        r = pos - start
        return Row(
            seq=seq,
            rg=rg,
            file=int(self.groups.file[rg]),
            group=int(self.groups.group[rg]),
            row_in_group=r,
            row_in_file=int(self.groups.first_row[rg]) + r,
        )

    def groups_for_window(self, k: int) -> list[int]:
        """Row groups (indices into RowGroups) overlapping window k, in order."""
        lo, hi = k * self.window, min((k + 1) * self.window, self.length)
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.ends, hi - 1, side="right"))
        return [int(g) for g in self.rg_order[first : last + 1]]
