"""The batch wire format: named numpy arrays plus a meta dict in one ring record.

No pickle, ever: a record is a fixed little-endian header, a tensor table and the raw
array bytes, so a reader can decode it from any process (or language) without running
code the writer chose. Decoding returns zero-copy numpy views into the record and is
bounds-checked everywhere; any inconsistency raises `BatchFormatError`, never reads
outside the record.

Byte layout (little-endian; offsets from the start of the record)::

    0    +---------+---------+-----------+-------------+-------------+
         | magic   | version | ntensors  | meta_nbytes | table_end   |
         | "OVLB"  | u16 1|2 | u16       | u32         | u32         |
    16   +---------+---------+-----------+-------------+-------------+
         | meta, meta_nbytes bytes:                                  |
         |   version 1: a UTF-8 JSON object                          |
         |   version 2: a sample's meta (`SampleMeta`), fixed ints:  |
         |     +0 s i64 | +8 e i64 | +16 q i64 | +24 t i64 |         |
         |     +32 b i64 | +40 m i64 | +48 key_nbytes u32 |          |
         |     +52 key (UTF-8), meta_nbytes = 52 + key_nbytes        |
         +---- pad to 8 ---------------------------------------------+
         | tensor entry 0:                                           |
         |   +0 name_nbytes u16 | +2 dtype u8 | +3 ndim u8 | +4 0 u32 |
         |   +8 name (UTF-8), pad to 8                               |
         |   shape: ndim x i64 | data offset u64 | data nbytes u64    |
         | tensor entry 1 ... (ntensors entries)                     |
    table_end ---- pad to 64 ---------------------------------------+
         | tensor 0 data (C order), at a multiple of 64               |
         +---- pad to 64 --------------------------------------------+
         | tensor 1 data ...                                         |
         +-----------------------------------------------------------+

    dtype codes: 1 bool, 2 int8, 3 uint8, 4 int16, 5 uint16, 6 int32, 7 uint32,
                 8 int64, 9 uint64, 10 float16, 11 float32, 12 float64

Invariants checked on decode: offset + nbytes within the record, offset >= table_end and
a multiple of 64, nbytes == prod(shape) * itemsize, known dtype code, ndim <= 8, names
valid UTF-8 and unique, the table ends exactly at table_end, meta is a JSON object
(version 1) or exactly 52 B plus its key (version 2).

Version 2 exists for the one record sent per sample, Source Loader -> Data Constructor:
JSON-encoding its seven fields took about 5 of the 8 us of laying out the record (before
its bytes are copied), on the loader process's busiest thread. Both decode to the same dict (`s e q k t b m`); every other
record (a constructor's micro-batches to the trainers) is version 1.

Alignment: data offsets are 64-byte aligned within the record; a ring record payload
starts 8-byte aligned, so arrays read from a ring are at least 8-byte aligned (enough
for every dtype above).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from overlord.errors import BatchFormatError, ConfigError
from overlord.shm._ring import stream_copy

MAGIC = b"OVLB"
VERSION = 1  # meta is JSON
VERSION_SAMPLE = 2  # meta is a `SampleMeta`
MAX_NDIM = 8
DATA_ALIGN = 64

_HEADER = struct.Struct("<4sHHII")  # magic, version, ntensors, meta_nbytes, table_end
_ENTRY = struct.Struct("<HBBI")  # name_nbytes, dtype code, ndim, reserved
_TAIL = struct.Struct("<QQ")  # data offset, data nbytes
_SAMPLE = struct.Struct("<qqqqqqI")  # s, e, q, t, b, m, key_nbytes (then the key)


class SampleMeta(NamedTuple):
    """The meta of one sample's record, loader -> constructor (version 2 of the format).

    Decodes to the dict ``{"s": stream, "e": epoch, "q": seq, "k": key, "t": step,
    "b": bucket, "m": microbatch}``, as a JSON meta with those fields would.
    """

    stream: int
    epoch: int
    seq: int
    key: str
    step: int
    bucket: int
    microbatch: int

    def encode(self) -> bytes:
        raw = self.key.encode()
        try:
            return (
                _SAMPLE.pack(self.stream, self.epoch, self.seq, self.step, self.bucket, self.microbatch, len(raw)) + raw
            )
        except struct.error as e:
            raise ValueError(f"sample meta {self!r} does not fit the format's 64-bit fields: {e}") from None


def _decode_sample_meta(raw: memoryview) -> dict[str, Any]:
    if len(raw) < _SAMPLE.size:
        raise BatchFormatError(f"sample meta of {len(raw)} B is shorter than its {_SAMPLE.size} B fields")
    s, e, q, t, b, m, key_nbytes = _SAMPLE.unpack_from(raw, 0)
    if _SAMPLE.size + key_nbytes != len(raw):
        raise BatchFormatError(f"sample meta of {len(raw)} B does not hold its {key_nbytes} B key")
    try:
        key = str(raw[_SAMPLE.size :], "utf-8")
    except UnicodeDecodeError:
        raise BatchFormatError("sample meta: key is not valid UTF-8") from None
    return {"s": s, "e": e, "q": q, "k": key, "t": t, "b": b, "m": m}


_CODES: dict[str, int] = {
    "|b1": 1, "|i1": 2, "|u1": 3, "<i2": 4, "<u2": 5, "<i4": 6,
    "<u4": 7, "<i8": 8, "<u8": 9, "<f2": 10, "<f4": 11, "<f8": 12,
}  # fmt: skip
# A ring record's arrays of at least this many bytes are copied in with stores that
# bypass the cache (ovl_stream_copy in native/ring.c): a plain store first reads each
# line it writes, and a record this large is out of the writer's cache by the time
# another process reads it. bench/ring.py on a 2-core VM (16 MiB ring, 8-16 MiB of
# L3 in effect): 1-4 MiB batches 1.2-1.5x the rate with a copy out, 1.2-2.3x read
# leased; 256-512 KiB ones lost up to 2.8x of the reader's copy out (the record was
# still in cache), hence the floor. A host whose cache holds its rings may do better
# with plain stores: $OVERLORD_STREAM_BYTES sets the floor (0: never stream).
STREAM_ENV = "OVERLORD_STREAM_BYTES"


def _stream_bytes() -> int:
    raw = os.environ.get(STREAM_ENV)
    if raw is None:
        return 1 << 20
    try:
        floor = int(raw)
    except ValueError:
        floor = -1
    if floor < 0:
        raise ConfigError(
            f"${STREAM_ENV}={raw!r} is not a number of bytes >= 0; give the smallest array copied into a ring "
            "with streaming stores (0: none), or unset it for 1 MiB"
        )
    return floor if floor > 0 else 1 << 62


STREAM_BYTES = _stream_bytes()
_DTYPES: dict[int, np.dtype] = {code: np.dtype(s) for s, code in _CODES.items()}


Meta = dict[str, Any] | SampleMeta | None


def _align(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


class _Plan:
    """Where each part of one batch goes; computed once, used to size and to write."""

    __slots__ = ("meta", "version", "tensors", "table_end", "offsets", "nbytes")

    def __init__(self, tensors: Mapping[str, Any], meta: Meta) -> None:
        if meta is None:
            meta = {}
        if isinstance(meta, SampleMeta):
            self.meta, self.version = meta.encode(), VERSION_SAMPLE
        elif not isinstance(meta, dict):
            raise TypeError(f"batch meta must be a dict or a SampleMeta, not {type(meta).__name__}")
        else:
            self.version = VERSION
            try:
                self.meta = json.dumps(meta, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
            except (TypeError, ValueError) as e:
                raise TypeError(f"batch meta must be JSON-serialisable ({e}); pass arrays as tensors") from None
        if len(tensors) > 0xFFFF:
            raise ValueError(f"a batch holds at most 65535 tensors, got {len(tensors)}")
        self.tensors: list[tuple[bytes, np.ndarray, int]] = []
        pos = _align(_HEADER.size + len(self.meta), 8)
        for name, value in tensors.items():
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {name!r}")
            raw_name = name.encode()
            arr = np.asarray(value)
            # Big-endian input is encoded little-endian (copyto swaps on the way in).
            dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
            code = _CODES.get(dt.str)
            if code is None:
                raise TypeError(
                    f"tensor {name!r} has dtype {arr.dtype}, not one of the batch format's: "
                    "bool, int8..int64, uint8..uint64, float16, float32, float64"
                )
            if arr.ndim > MAX_NDIM or len(raw_name) > 0xFFFF:
                raise ValueError(f"tensor {name!r}: ndim {arr.ndim} > {MAX_NDIM} or name too long")
            self.tensors.append((raw_name, arr, code))
            pos += _align(_ENTRY.size + len(raw_name), 8) + 8 * arr.ndim + _TAIL.size
        self.table_end = pos
        self.offsets: list[int] = []
        pos = _align(pos, DATA_ALIGN)
        end = self.table_end
        for _, arr, _ in self.tensors:
            self.offsets.append(pos)
            end = pos + arr.nbytes
            pos = _align(end, DATA_ALIGN)
        self.nbytes = end

    def encode(self, buf: Any, *, stream: bool = False) -> int:
        """Write the batch into `buf`; `stream`: a ring record, whose large arrays go
        in with streaming stores (see STREAM_BYTES)."""
        mv = memoryview(buf)
        if mv.readonly:
            raise TypeError("encode_batch_into needs a writable buffer")
        if mv.nbytes < self.nbytes:
            raise ValueError(f"buffer of {mv.nbytes} B is smaller than the batch ({self.nbytes} B)")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        _HEADER.pack_into(mv, 0, MAGIC, self.version, len(self.tensors), len(self.meta), self.table_end)
        mv[_HEADER.size : _HEADER.size + len(self.meta)] = self.meta
        pos = _align(_HEADER.size + len(self.meta), 8)
        for (raw_name, arr, code), off in zip(self.tensors, self.offsets, strict=True):
            _ENTRY.pack_into(mv, pos, len(raw_name), code, arr.ndim, 0)
            mv[pos + _ENTRY.size : pos + _ENTRY.size + len(raw_name)] = raw_name
            pos += _align(_ENTRY.size + len(raw_name), 8)
            struct.pack_into(f"<{arr.ndim}q", mv, pos, *arr.shape)
            pos += 8 * arr.ndim
            _TAIL.pack_into(mv, pos, off, arr.nbytes)
            pos += _TAIL.size
            if arr.size:
                if stream and arr.nbytes >= STREAM_BYTES and arr.flags.c_contiguous and arr.dtype == _DTYPES[code]:
                    stream_copy(mv[off : off + arr.nbytes], arr.reshape(-1).view(np.uint8).data)
                    continue
                dst = np.frombuffer(mv, dtype=_DTYPES[code], count=arr.size, offset=off).reshape(arr.shape)
                # Strided or byte-swapped sources become contiguous little-endian in one pass.
                np.copyto(dst, arr, casting="equiv")
        return self.nbytes


def batch_nbytes(tensors: Mapping[str, Any], meta: Meta = None) -> int:
    """Bytes one batch takes in the wire format (the ring record's payload).

    Args:
        tensors: Name -> array (numpy, or anything `np.asarray` accepts).
        meta: JSON-serialisable dict, a `SampleMeta`, or None.

    Returns:
        The encoded size in bytes.

    Raises:
        TypeError: A dtype outside the format, a non-str name, or meta not JSON.
        ValueError: ndim > 8 or too many tensors.
    """
    return _Plan(tensors, meta).nbytes


def encode_batch_into(buf: Any, tensors: Mapping[str, Any], meta: Meta = None) -> int:
    """Encode a batch into a writable buffer at offset 0.

    Args:
        buf: Writable bytes-like object of at least `batch_nbytes(tensors, meta)` bytes.
        tensors: Name -> array; non-contiguous arrays are copied in C order.
        meta: JSON-serialisable dict, a `SampleMeta`, or None.

    Returns:
        The number of bytes written.

    Raises:
        TypeError, ValueError: As `batch_nbytes`; also if `buf` is read-only or too small.
    """
    return _Plan(tensors, meta).encode(buf)


def write_batch(ring: Any, tensors: Mapping[str, Any], meta: Meta = None, *, timeout: float, wake: bool = True) -> None:
    """Encode a batch straight into a ring record (one copy per array, no temporaries).

    Args:
        ring: A `Ring` this process produces into.
        tensors: Name -> array.
        meta: JSON-serialisable dict, a `SampleMeta`, or None.
        timeout: Seconds to wait for space.
        wake: False: commit without waking the consumer (`Ring.commit`).

    Raises:
        RingFullError: The batch can never fit the ring.
        RingTimeout, PeerDied, RingClosed: As `Ring.reserve`.
        TypeError, ValueError: As `batch_nbytes`.
    """
    plan = _Plan(tensors, meta)
    view = ring.reserve(plan.nbytes, timeout)
    try:
        plan.encode(view, stream=True)
    except BaseException:
        ring.abort()
        raise
    ring.commit(wake)


def decode_batch(view: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Decode one record into zero-copy numpy views and the meta dict.

    The arrays alias `view`: they are valid as long as it is (for a ring record,
    until the next read/release). Copy what must outlive it.

    Args:
        view: The record (memoryview from `Ring.read`, bytes, bytearray, ...).

    Returns:
        (name -> array in table order, meta dict).

    Raises:
        BatchFormatError: The record is truncated or inconsistent; the message says what.
    """
    mv = memoryview(view)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    size = mv.nbytes
    if size < _HEADER.size:
        raise BatchFormatError(f"batch record of {size} B is shorter than its {_HEADER.size} B header")
    magic, version, ntensors, meta_nbytes, table_end = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BatchFormatError(f"batch record has magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION and version != VERSION_SAMPLE:
        raise BatchFormatError(
            f"batch format version {version}, this reader knows {VERSION} and {VERSION_SAMPLE}: "
            "writer and reader run different Overlord versions"
        )
    if not _HEADER.size + meta_nbytes <= table_end <= size:
        raise BatchFormatError(f"batch header: meta {meta_nbytes} B / table end {table_end} outside {size} B")
    raw_meta = mv[_HEADER.size : _HEADER.size + meta_nbytes]
    if version == VERSION_SAMPLE:
        meta = _decode_sample_meta(raw_meta)
    else:
        try:
            meta = json.loads(str(raw_meta, "utf-8"))
        except (ValueError, RecursionError) as e:
            raise BatchFormatError(f"batch meta is not valid UTF-8 JSON: {e}") from None
        if not isinstance(meta, dict):
            raise BatchFormatError(f"batch meta is a JSON {type(meta).__name__}, expected an object")
    tensors: dict[str, np.ndarray] = {}
    pos = _align(_HEADER.size + meta_nbytes, 8)
    for i in range(ntensors):
        if pos + _ENTRY.size > table_end:
            raise BatchFormatError(f"tensor entry {i} of {ntensors} runs past the table end {table_end}")
        name_nbytes, code, ndim, _ = _ENTRY.unpack_from(mv, pos)
        name_end = pos + _ENTRY.size + name_nbytes
        if name_end > table_end:
            raise BatchFormatError(f"tensor entry {i}: name runs past the table end {table_end}")
        try:
            name = bytes(mv[name_end - name_nbytes : name_end]).decode()
        except UnicodeDecodeError:
            raise BatchFormatError(f"tensor entry {i}: name is not valid UTF-8") from None
        if name in tensors:
            raise BatchFormatError(f"tensor name {name!r} appears twice")
        dtype = _DTYPES.get(code)
        if dtype is None:
            raise BatchFormatError(f"tensor {name!r}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise BatchFormatError(f"tensor {name!r}: ndim {ndim} > {MAX_NDIM}")
        pos = _align(name_end, 8)
        if pos + 8 * ndim + _TAIL.size > table_end:
            raise BatchFormatError(f"tensor {name!r}: entry runs past the table end {table_end}")
        shape = struct.unpack_from(f"<{ndim}q", mv, pos)
        pos += 8 * ndim
        off, nbytes = _TAIL.unpack_from(mv, pos)
        pos += _TAIL.size
        if any(d < 0 for d in shape):
            raise BatchFormatError(f"tensor {name!r}: negative dimension in shape {shape}")
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise BatchFormatError(f"tensor {name!r}: {nbytes} B does not match shape {shape} of {dtype}")
        if off < table_end or off % DATA_ALIGN or off + nbytes > size:
            raise BatchFormatError(
                f"tensor {name!r}: data [{off}, {off + nbytes}) is not a 64-aligned range within [{table_end}, {size})"
            )
        try:
            arr = np.frombuffer(mv, dtype=dtype, count=nbytes // dtype.itemsize, offset=off).reshape(shape)
        except ValueError as e:  # e.g. a 0-size shape whose other dims overflow numpy
            raise BatchFormatError(f"tensor {name!r}: shape {shape} unusable: {e}") from None
        tensors[name] = arr
    if pos != table_end:
        raise BatchFormatError(f"tensor table ends at {pos}, header says {table_end}")
    return tensors, meta
