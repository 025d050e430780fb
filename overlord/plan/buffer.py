"""The Planner's view of the Source Loaders' read buffers (`summary_buffer`).

Each stream (a source partition) reports chunks of metadata in its deterministic
order; the Planner keeps them here until it plans them. Selecting samples for a step
(`select`) reads the heads of the streams without consuming anything, so a strategy
that has to wait for more metadata leaves no trace; `commit` consumes what a finished
plan used.

Items travel as one structured numpy array (`ITEM`), one row per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from overlord.plan.meta import MetaChunk

ITEM = np.dtype(
    [
        ("stream", "<i4"),
        ("source", "<i4"),
        ("epoch", "<i4"),
        ("seq", "<i8"),
        ("tokens", "<i4"),
        ("patches", "<i4"),
        ("nbytes", "<i8"),
    ]
)


_EPOCH, _SEQ = ((ITEM.names or ()).index(name) for name in ("epoch", "seq"))  # in a row's .item() tuple


def join_items(parts: list[np.ndarray]) -> np.ndarray:
    """ITEM arrays end to end, as one new array.

    `np.concatenate` of structured arrays promotes their dtypes field by field in Python
    (numpy's `_promote_fields`, ~8 us a part): a step that takes a sample or two from
    each of hundreds of streams spent ~1.6 ms in it at 200 parts, a tenth of the
    Planner's CPU in bench/peers.py. The parts' bytes are joined in one C pass instead
    (~0.15 ms); a part of any other dtype is refused, never reinterpreted.
    """
    raw = []
    for part in parts:
        if part.dtype != ITEM or part.ndim != 1:
            raise TypeError(f"join_items takes 1-D arrays of ITEM rows, not {part.ndim}-D of {part.dtype}")
        raw.append(np.ascontiguousarray(part).view(np.uint8))
    return np.concatenate(raw).view(ITEM) if raw else np.empty(0, dtype=ITEM)


class NeedMetadata(Exception):
    """A decision needs metadata the loaders have not reported yet: plan this step later.

    `wanted` maps a stream to how many unplanned samples it must hold for this step, so
    the Planner can ask a loader whose read buffer is full to hold more (a step may take
    more samples from one stream than its read buffer holds). The step is tried again
    once a stream it names reports a sample or its end, not before: a strategy names
    every stream whose reports could let the step be planned.
    """

    def __init__(self, wanted: dict[int, int]) -> None:
        super().__init__(wanted)
        self.wanted = wanted


@dataclass(slots=True)
class Stream:
    """Reported, unplanned samples of one stream, in order."""

    name: str
    source: int
    chunks: list[np.ndarray] = field(default_factory=list)  # ITEM arrays
    offset: int = 0  # consumed rows of chunks[0]
    count: int = 0  # reported and not yet planned
    final: bool = False  # the loader has reported every sample it will ever prepare
    cursor: tuple[int, int] = (0, -1)  # (epoch, seq) of the last planned sample
    known: tuple[int, int] = (0, -1)  # (epoch, seq) of the last sample reported or planned
    retired: bool = False  # a reshard gave what it had not planned to new streams

    def add(self, index: int, chunk: MetaChunk) -> None:
        """Append a reported chunk; samples already known are dropped.

        A restarted or promoted Source Loader, and every loader after a Planner took
        over, reports again from where it stands: the order is the same, so what is
        new is exactly what lies after `known`. A retired stream's late reports are
        dropped: its remainder is the new streams' now.
        """
        if self.retired:
            return
        seq = np.asarray(chunk.seq)
        if chunk.epoch < self.known[0]:
            seq = seq[:0]
        elif chunk.epoch == self.known[0]:
            seq = seq[seq > self.known[1]]
        fresh = len(chunk) - len(seq)
        if len(seq):
            rows = np.empty(len(seq), dtype=ITEM)
            rows["stream"], rows["source"], rows["epoch"] = index, self.source, chunk.epoch
            rows["seq"], rows["tokens"] = seq, np.asarray(chunk.tokens)[fresh:]
            rows["patches"], rows["nbytes"] = np.asarray(chunk.patches)[fresh:], np.asarray(chunk.nbytes)[fresh:]
            self.chunks.append(rows)
            self.count += len(rows)
            self.known = (int(chunk.epoch), int(seq[-1]))
        self.final = self.final or chunk.final

    def peek(self, n: int) -> np.ndarray:
        """The next `n` items (n <= count), not consumed: a read-only view where one
        chunk holds them all, else a copy."""
        if self.chunks and self.offset + n <= len(self.chunks[0]):
            view = self.chunks[0][self.offset : self.offset + n]
            view.flags.writeable = False
            return view
        out, need, offset = [], n, self.offset
        for chunk in self.chunks:
            part = chunk[offset : offset + need]
            out.append(part)
            need -= len(part)
            offset = 0
            if not need:
                break
        return join_items(out)

    def _at(self, i: int) -> np.void:
        """The item `i` places after the next one (i < count), without copying the others."""
        i += self.offset
        for chunk in self.chunks:
            if i < len(chunk):
                row: np.void = chunk[i]
                return row
            i -= len(chunk)
        raise IndexError(f"stream {self.name!r} holds {self.count} items, not {i + 1}")

    def consume(self, n: int) -> None:
        if n == 0:
            return
        first = self.chunks[0]
        at = self.offset + n - 1
        # the last item as a tuple of Python ints in ITEM's field order (one C call)
        last = first[at].item() if at < len(first) else self._at(n - 1).item()
        self.count -= n
        n += self.offset
        while n and n >= len(self.chunks[0]):
            n -= len(self.chunks.pop(0))
        self.offset = n
        self.cursor = (last[_EPOCH], last[_SEQ])
        self.known = max(self.known, self.cursor)


class Buffer:
    """Every stream's reported metadata, grouped by source."""

    def __init__(self, streams: list[str], stream_source: list[int], n_sources: int, *, finite: bool) -> None:
        self.streams = [Stream(n, s) for n, s in zip(streams, stream_source)]
        self.by_source = [[i for i, s in enumerate(stream_source) if s == src] for src in range(n_sources)]
        self.finite = finite
        self.source_of = np.asarray(stream_source, dtype=np.intp)  # each stream's source
        self.n_sources = n_sources
        # the last select: its take and a copy of its items (what `heads` gives back for it)
        self._selected: tuple[dict[int, int], np.ndarray] | None = None

    def add(self, stream: int, chunk: MetaChunk) -> None:
        self.streams[stream].add(stream, chunk)
        self._selected = None

    def reshard(self, src: int, names: list[str], epoch: int) -> list[int]:
        """Retire source `src`'s streams (what they hold unplanned is dropped: the new
        streams read it again) and append streams `names`, which start at `epoch` with
        nothing planned; returns their indices (overlord.runtime.reshard)."""
        for i in self.by_source[src]:
            old = self.streams[i]
            old.chunks, old.offset, old.count, old.final, old.retired = [], 0, 0, True, True
        first = len(self.streams)
        for name in names:
            self.streams.append(Stream(name, src, cursor=(epoch, -1), known=(epoch, -1)))
        ids = list(range(first, len(self.streams)))
        self.by_source[src] = ids
        self.source_of = np.append(self.source_of, np.full(len(ids), src, dtype=np.intp))
        self._selected = None
        return ids

    def wanted(self, src: int, count: int) -> dict[int, int]:
        """Samples each stream of a source must hold for `count` to be taken from it.

        An even share each while the source holds `count`; when it holds fewer, the
        streams not yet final share what the final ones cannot give: the final ones give
        nothing more, and asking an open stream only for its even share, which its loader
        may already hold, would never make it read on (a finite job's last steps then
        waited for ever on a stream never reported final). Together the open streams are
        asked for what the source lacks, so one of them is asked for more than it holds.
        """
        ids = self.by_source[src]
        even = -(-count // len(ids))
        open_ = [i for i in ids if not self.streams[i].final]
        if not open_ or sum(self.streams[i].count for i in ids) >= count:
            return {i: even for i in ids}
        from_final = sum(self.streams[i].count for i in ids if self.streams[i].final)
        each = max(even, -(-(count - from_final) // len(open_)))
        return {i: each if i in open_ else even for i in ids}

    def remaining_all(self) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Per source (arrays indexed by source): its reported unplanned samples, and
        whether that is all it will ever have. One pass over the streams, where a step
        that draws from hundreds of sources asked each alone."""
        n = len(self.streams)
        counts = np.fromiter((s.count for s in self.streams), dtype=np.int64, count=n)
        open_ = np.fromiter((not s.final for s in self.streams), dtype=np.int64, count=n)
        have = np.zeros(self.n_sources, dtype=np.int64)
        np.add.at(have, self.source_of, counts)
        still = np.zeros(self.n_sources, dtype=np.int64)
        np.add.at(still, self.source_of, open_)
        return have, still == 0

    def select(self, counts: np.ndarray, rr: list[int]) -> tuple[np.ndarray, dict[int, int], list[int]]:
        """Take `counts[src]` samples of each source, round robin over its streams.

        Returns:
            (items, per-stream counts to consume, new round-robin positions).

        Raises:
            NeedMetadata: a stream that must supply has not reported enough yet.
        """
        rr = list(rr)
        take: dict[int, int] = {}
        streams = self.streams
        for src in np.flatnonzero(counts).tolist():
            ids = self.by_source[src]
            count, n = int(counts[src]), len(ids)
            if n == 1 and streams[ids[0]].count >= count:  # one stream (no partitions) that holds the draw
                take[ids[0]] = count
                rr[src] += count
                continue
            # fast path: every stream has its round-robin share
            shares = [count // n + ((k - rr[src]) % n < count % n) for k in range(n)]
            if all(self.streams[i].count >= share for i, share in zip(ids, shares)):
                for i, share in zip(ids, shares):
                    if share:
                        take[i] = share
                rr[src] += count
                continue
            left = {i: self.streams[i].count for i in ids}
            for drawn in range(count):
                for _try in range(len(ids)):
                    i = ids[rr[src] % len(ids)]
                    rr[src] += 1
                    if left[i] > 0:
                        break
                    if not self.streams[i].final:
                        # it must hold what it gave so far and the rest of the draw: its
                        # round-robin share alone is less once its siblings ran out, and a
                        # loader holding that share already would never read on (a finite
                        # job's last steps then waited for ever on a stream never final)
                        wanted = {j: share for j, share in zip(ids, shares)}
                        wanted[i] = max(wanted[i], self.streams[i].count + count - drawn)
                        raise NeedMetadata(wanted)
                else:
                    raise AssertionError("planner: a source's remainder was miscounted")
                left[i] -= 1
                take[i] = take.get(i, 0) + 1
        items = self._heads(take)
        kept = items.copy()
        kept.flags.writeable = False  # handed out by `heads`
        self._selected = (dict(take), kept)
        return items, take, rr

    def heads(self, take: dict[int, int]) -> np.ndarray:
        """The next `take[i]` items of each stream i, in stream order (not consumed), read
        only: what `select` gave for that take, kept from it when it was the last select's."""
        if self._selected is not None and self._selected[0] == take:
            return self._selected[1]
        out = self._heads(take)
        out.flags.writeable = False
        return out

    def _heads(self, take: dict[int, int]) -> np.ndarray:
        raw = []
        for i, n in sorted(take.items()):
            stream = self.streams[i]
            first, offset = (stream.chunks[0], stream.offset) if stream.chunks else (None, 0)
            if first is not None and offset + n <= len(first):
                part = first[offset : offset + n]  # a slice of one chunk (contiguous)
            else:
                part = stream.peek(n)
            raw.append(part.view(np.uint8))
        return np.concatenate(raw).view(ITEM) if raw else np.empty(0, dtype=ITEM)

    def commit(self, take: dict[int, int]) -> None:
        self._selected = None
        for i, n in take.items():
            self.streams[i].consume(n)

    def summary(self) -> dict[str, np.ndarray]:
        """`summary_buffer`: every reported, unplanned sample, as ITEM rows per stream."""
        return {s.name: s.peek(s.count) for s in self.streams}
