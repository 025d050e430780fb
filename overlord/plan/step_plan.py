"""`Plan`: one step's plan as arrays, and its binary encoding (the `plan:<step>` value).

A plan lists, per bucket (a node of the tree at its `axis`: a DP group, a DPxCP rank
or a rank) and per micro-batch, the samples it holds as (stream, epoch, seq) rows.
In memory that is one int64 [n, 3] array, bucket by bucket and micro-batch by
micro-batch, and the offsets where each micro-batch starts: building, checking,
encoding and reading a plan of 65,536 samples is a few numpy calls, no Python object
per sample. `buckets` / `micro_batch` give the rows as tuples where a reader wants them.

The encoding (little-endian, no pickle; version 1) is a fixed 64-byte header, the
axis and broadcast dims as ASCII, then arrays, each starting on an 8-byte boundary::

    offset  size  field
         0     4  magic b"OVPL"
         4     2  u16 version (1)
         6     2  u16 flags: bit 0 last, bit 1 encoder lists present, bit 2 owners present
         8     8  i64 step
        16     8  i64 deferred (samples deferred to the next step)
        24     8  i64 dropped (on the last step: samples no step delivers)
        32     4  u32 B buckets
        36     4  u32 M micro-batches per bucket
        40     4  u32 n samples in the buckets
        44     4  u32 R encoder ranks (0 without encoder lists)
        48     4  u32 e samples in the encoder lists
        52     3  u8 x 3 byte width of the stream, epoch and seq columns (1, 2, 4 or 8)
        55     1  zero
        56     2  u16 T length of the text
        58     4  u32 K streams handed off (owners; 0 without)
        62     2  u16 G reshards the job has made (overlord.runtime.reshard; 0 before any)
        64     T  ASCII: the axis, then ";" and each broadcast dim ("DP;TP"); zero-padded to 8
         .  4B*M  u32 [B*M]: samples of micro-batch m of bucket b at b*M + m
         .    4R  u32 [R]: samples each encoder rank encodes (zero-padded to 8)
         .   ...  the stream column of the n + e rows (bucket rows, then encoder rows),
                  then the epoch column, then the seq column, each unsigned of its width
                  and zero-padded to 8
         .    8K  u32 [K, 2]: (stream, loader process) of each stream served this step
                  by a loader process other than its layout's (live handoffs)

Each column takes the narrowest width its largest value fits (stream and epoch
usually 1 or 2 bytes, seq 4): about 7 bytes per sample. `decode` checks the magic,
the version, every length against the bytes' size and the counts against n and e,
and says what is wrong instead of reading garbage.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from overlord.errors import PlanError

MAGIC = b"OVPL"
VERSION = 1
_HEADER = struct.Struct("<4sHHqqqIIIII3BxHIH")
HEADER_BYTES = _HEADER.size  # 64
_LAST, _ENCODER, _OWNERS = 1, 2, 4
_WIDTHS = (1, 2, 4, 8)
_U32_MAX = (1 << 32) - 1
_U16_MAX = (1 << 16) - 1

Item = tuple[int, int, int]  # (stream, epoch, seq)


def _empty_rows() -> NDArray[np.int64]:
    return np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """One step's plan.

    Micro-batch m of bucket b holds `items[bounds[b * micro_batches + m] : bounds[... + 1]]`
    (rows of (stream, epoch, seq)); with encoder lists, WORLD rank r encodes the images
    of `encoder_items[encoder_bounds[r] : encoder_bounds[r + 1]]`. Two plans are equal
    when their encodings are.
    """

    step: int
    items: NDArray[np.int64] = field(default_factory=_empty_rows)
    bounds: NDArray[np.int64] = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    micro_batches: int = 1
    axis: str = "DP"
    last: bool = False
    broadcast: tuple[str, ...] = ()
    deferred: int = 0
    encoder_items: NDArray[np.int64] | None = None
    encoder_bounds: NDArray[np.int64] | None = None
    dropped: int = 0
    # [K, 2] (stream, loader process): streams this step is served by a loader process
    # other than the layout's (a live handoff, overlord.planner.handoff); None: none is
    owners: NDArray[np.int64] | None = None
    # how many reshards the job has made by this step (overlord.runtime.reshard): a role
    # that knows fewer reads the new streams from the planner checkpoint before this step
    generation: int = 0

    @classmethod
    def from_lists(
        cls,
        step: int,
        buckets: list[list[list[Item]]],
        *,
        encoder: list[list[Item]] | None = None,
        **scalars: Any,
    ) -> Plan:
        """A plan from nested lists: `buckets[b][m]` the rows of micro-batch m of bucket b,
        `encoder[r]` those WORLD rank r encodes; `scalars` are the other fields."""
        bins = len(buckets[0]) if buckets else 1
        if any(len(bucket) != bins for bucket in buckets):
            raise PlanError(f"plan of step {step}: every bucket needs the same number of micro-batches ({bins})")
        flat = [list(mb) for bucket in buckets for mb in bucket]
        items, bounds = _rows(flat)
        enc_items, enc_bounds = _rows([list(r) for r in encoder]) if encoder is not None else (None, None)
        return cls(
            step=step,
            items=items,
            bounds=bounds,
            micro_batches=bins,
            encoder_items=enc_items,
            encoder_bounds=enc_bounds,
            **scalars,
        )

    # -- reading ---------------------------------------------------------------------

    @property
    def n_buckets(self) -> int:
        return (len(self.bounds) - 1) // self.micro_batches

    def samples(self) -> int:
        return len(self.items)

    def rows(self, bucket: int, mb: int) -> NDArray[np.int64]:
        """The (stream, epoch, seq) rows of micro-batch `mb` of `bucket` (a view)."""
        cell = bucket * self.micro_batches + mb
        return self.items[self.bounds[cell] : self.bounds[cell + 1]]

    def micro_batch(self, bucket: int, mb: int) -> list[Item]:
        """The samples of micro-batch `mb` of `bucket`, as (stream, epoch, seq) tuples."""
        return list(map(tuple, self.rows(bucket, mb).tolist()))

    @property
    def buckets(self) -> list[list[list[Item]]]:
        """Every micro-batch of every bucket, as lists of tuples (built on each call)."""
        rows = list(map(tuple, self.items.tolist()))
        b = self.bounds.tolist()
        m = self.micro_batches
        return [[rows[b[k * m + j] : b[k * m + j + 1]] for j in range(m)] for k in range(self.n_buckets)]

    def bucket_of_rows(self) -> NDArray[np.int64]:
        """[n]: the bucket of each row of `items`."""
        counts = np.diff(self.bounds)
        return np.repeat(np.arange(len(counts), dtype=np.int64) // self.micro_batches, counts)

    def encoder_rows(self, rank: int) -> NDArray[np.int64]:
        """The rows WORLD rank `rank` encodes the images of (empty without encoder lists)."""
        if self.encoder_items is None or self.encoder_bounds is None:
            return _empty_rows()
        return self.encoder_items[self.encoder_bounds[rank] : self.encoder_bounds[rank + 1]]

    @property
    def encoder(self) -> list[list[Item]] | None:
        """Per WORLD rank, the samples whose images it encodes; None without encoder lists."""
        if self.encoder_items is None or self.encoder_bounds is None:
            return None
        rows = list(map(tuple, self.encoder_items.tolist()))
        b = self.encoder_bounds.tolist()
        return [rows[b[r] : b[r + 1]] for r in range(len(b) - 1)]

    def loader_of(self, home: list[int]) -> list[int]:
        """The loader process serving each stream this step: `home` (the layout's
        `loader_of`) with this plan's handoffs applied."""
        if self.owners is None or not len(self.owners):
            return home
        out = list(home)
        for stream, loader in self.owners.tolist():
            if stream >= len(out):
                raise PlanError(
                    f"the plan of step {self.step} hands stream {stream} to loader process {loader}, but the job "
                    f"has {len(out)} streams: run one job configuration on every node"
                )
            out[stream] = loader
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.encode() == other.encode()

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    # -- the binary encoding ---------------------------------------------------------

    def encode(self) -> bytes:
        """The `plan:<step>` value (see the module docstring).

        Raises:
            PlanError: a row is negative, or a count does not fit the format.
        """
        enc = self.encoder_items is not None and self.encoder_bounds is not None
        owners = self.owners if self.owners is not None else np.zeros((0, 2), dtype=np.int64)
        if len(owners) and (owners.min() < 0 or owners.max() > _U32_MAX):
            raise PlanError(f"plan of step {self.step}: a handoff names a negative or too large stream or loader")
        if not 0 <= self.generation <= _U16_MAX:
            raise PlanError(f"plan of step {self.step}: reshard generation {self.generation} does not fit the format")
        e_items = self.encoder_items if enc and self.encoder_items is not None else _empty_rows()
        e_bounds = self.encoder_bounds if enc and self.encoder_bounds is not None else np.zeros(1, dtype=np.int64)
        rows = np.concatenate([self.items, e_items]) if len(e_items) else self.items
        if len(rows) and rows.min() < 0:
            raise PlanError(f"plan of step {self.step}: a (stream, epoch, seq) row is negative; this is a bug")
        top = [int(rows[:, col].max()) for col in range(3)] if len(rows) else [0, 0, 0]  # not max(axis=0): ~10x slower
        widths = [next(w for w in _WIDTHS if v < 1 << (8 * w)) for v in top]
        text = ";".join((self.axis, *self.broadcast)).encode("ascii")
        counts, e_counts = np.diff(self.bounds), np.diff(e_bounds)
        if len(rows) > _U32_MAX or len(counts) > _U32_MAX:
            raise PlanError(f"plan of step {self.step}: {len(rows)} rows is more than the format holds")
        parts = [
            _HEADER.pack(
                MAGIC,
                VERSION,
                (_LAST if self.last else 0) | (_ENCODER if enc else 0) | (_OWNERS if len(owners) else 0),
                self.step,
                self.deferred,
                self.dropped,
                self.n_buckets,
                self.micro_batches,
                len(self.items),
                len(e_counts) if enc else 0,
                len(e_items),
                *widths,
                len(text),
                len(owners),
                self.generation,
            ),
            _padded(text),
            _padded(counts.astype("<u4").tobytes()),
            _padded(e_counts.astype("<u4").tobytes()) if enc else b"",
        ]
        for col, w in enumerate(widths):
            parts.append(_padded(rows[:, col].astype(f"<u{w}").tobytes()))
        if len(owners):
            parts.append(owners.astype("<u4").tobytes())
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Plan:
        """Inverse of `encode`.

        Raises:
            PlanError: the bytes are not a plan of this format version (with what is
                wrong: a JSON plan of an older Overlord, another version, a size or a
                count that disagrees).
        """
        view = memoryview(data).cast("B")
        if bytes(view[:1]) == b"{":
            raise PlanError(
                "the plan in Redis is JSON, written by an Overlord older than the binary plan format; "
                "run one Overlord version on every node of the job (restart the job's sidecars)"
            )
        if len(view) < HEADER_BYTES or bytes(view[:4]) != MAGIC:
            raise PlanError(f"the plan in Redis is not a plan ({len(view)} B, starting {bytes(view[:8])!r})")
        (_, version, flags, step, deferred, dropped, n_buckets, bins, n, ranks, e, w0, w1, w2, text_len, k, gen) = (
            _HEADER.unpack_from(view)
        )
        if version != VERSION:
            raise PlanError(
                f"the plan of step {step} is format version {version}; this Overlord reads version {VERSION}: "
                "run one Overlord version on every node of the job"
            )
        widths = (w0, w1, w2)
        enc = bool(flags & _ENCODER)
        off = HEADER_BYTES
        sizes = [_pad8(text_len), _pad8(4 * n_buckets * bins), _pad8(4 * ranks)]
        sizes += [_pad8(w * (n + e)) for w in widths]
        if (
            bins < 1
            or any(w not in _WIDTHS for w in widths)
            or (not enc and (ranks or e))
            or bool(flags & _OWNERS) != bool(k)
            or len(view) != off + sum(sizes) + 8 * k
        ):
            raise PlanError(
                f"the plan of step {step} is {len(view)} B, which disagrees with its header ({n_buckets} buckets x "
                f"{bins} micro-batches, {n} samples, {ranks} encoder ranks, {e} encoder samples, widths {widths}, "
                f"{k} handoffs); "
                "the value was cut short or overwritten"
            )
        text = bytes(view[off : off + text_len]).decode("ascii", errors="replace").split(";")
        off += sizes[0]
        counts = np.frombuffer(view, dtype="<u4", count=n_buckets * bins, offset=off)
        off += sizes[1]
        e_counts = np.frombuffer(view, dtype="<u4", count=ranks, offset=off)
        off += sizes[2]
        cols = []
        for w, size in zip(widths, sizes[3:]):
            cols.append(np.frombuffer(view, dtype=f"<u{w}", count=n + e, offset=off))
            off += size
        owners = np.frombuffer(view, dtype="<u4", count=2 * k, offset=off).astype(np.int64).reshape(k, 2) if k else None
        if int(counts.sum()) != n or int(e_counts.sum()) != e:
            raise PlanError(
                f"the plan of step {step} counts {int(counts.sum())} samples in its micro-batches and "
                f"{int(e_counts.sum())} in its encoder lists, but holds {n} and {e}; the value is corrupt"
            )
        rows = np.stack(cols, axis=1).astype(np.int64)
        return cls(
            step=step,
            items=rows[:n],
            bounds=_offsets(counts),
            micro_batches=bins,
            axis=text[0],
            last=bool(flags & _LAST),
            broadcast=tuple(text[1:]),
            deferred=deferred,
            encoder_items=rows[n:] if enc else None,
            encoder_bounds=_offsets(e_counts) if enc else None,
            dropped=dropped,
            owners=owners,
            generation=gen,
        )

    # -- JSON, for people ------------------------------------------------------------

    def to_json(self) -> bytes:
        """The plan as JSON (what `overlord plan --dry-run` and a reader of logs see)."""
        return json.dumps(
            {
                "step": self.step,
                "axis": self.axis,
                "last": self.last,
                "broadcast": list(self.broadcast),
                "deferred": self.deferred,
                "buckets": self.buckets,
                "encoder": self.encoder,
                "dropped": self.dropped,
                "owners": None if self.owners is None else self.owners.tolist(),
                "generation": self.generation,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Plan:
        obj = json.loads(data)
        encoder = obj.get("encoder")
        return cls.from_lists(
            obj["step"],
            [[[tuple(item) for item in mb] for mb in bucket] for bucket in obj["buckets"]],
            encoder=None if encoder is None else [[tuple(item) for item in rank] for rank in encoder],
            axis=obj["axis"],
            last=obj["last"],
            broadcast=tuple(obj["broadcast"]),
            deferred=obj["deferred"],
            dropped=obj.get("dropped", 0),
            owners=None if obj.get("owners") is None else np.asarray(obj["owners"], dtype=np.int64).reshape(-1, 2),
            generation=obj.get("generation", 0),
        )


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (-len(raw) % 8)


def _offsets(counts: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _rows(groups: list[list[Item]]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(rows [n, 3], offsets [len(groups) + 1]) of nested lists of (stream, epoch, seq)."""
    flat = [item for group in groups for item in group]
    rows = np.asarray(flat, dtype=np.int64).reshape(-1, 3)
    return rows, _offsets(np.asarray([len(g) for g in groups], dtype=np.int64))
