"""Batch wire format: exact round trips, zero-copy decode, and strict bounds checks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.errors import BatchFormatError
from overlord.shm import Ring, SampleMeta, batch_nbytes, decode_batch, encode_batch_into, segment_name, write_batch
from overlord.shm import _batch as batch_module
from overlord.shm._batch import STREAM_BYTES, STREAM_ENV
from overlord.shm._ring import stream_copy

REPO = Path(__file__).resolve().parents[2]
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]  # fmt: skip
SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (2, 3), (2, 3, 4), (1,) * 8]


def sample(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 100, shape).astype(dtype)


def encode(tensors, meta=None) -> bytearray:
    buf = bytearray(batch_nbytes(tensors, meta))
    assert encode_batch_into(buf, tensors, meta) == len(buf)
    return buf


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, arr in want.items():
        arr = np.asarray(arr)
        assert got[name].dtype == arr.dtype.newbyteorder("="), name
        assert got[name].shape == arr.shape, name
        np.testing.assert_array_equal(got[name], arr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_shape_round_trips(dtype):
    tensors = {f"t{i}": sample(dtype, shape, i) for i, shape in enumerate(SHAPES)}
    meta = {"step": 12, "sources": ["web", "code"], "nested": {"a": [1.5, None, True]}, "ü": "ß"}
    got, got_meta = decode_batch(encode(tensors, meta))
    assert_same(got, tensors)
    assert got_meta == meta


def test_non_contiguous_and_big_endian_inputs_are_normalised():
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    tensors = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "big_endian": np.arange(5, dtype=">f8"),
        "from_list": [[1, 2], [3, 4]],
    }
    got, meta = decode_batch(encode(tensors))
    assert meta == {}
    assert_same(got, {k: np.asarray(v) for k, v in tensors.items()})
    assert got["big_endian"].dtype == np.dtype("<f8")


def test_decode_is_zero_copy_and_64_byte_aligned():
    buf = encode({"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.float32)})
    got, _ = decode_batch(buf)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    for arr in got.values():
        assert (arr.ctypes.data - base) % 64 == 0
    buf[got["a"].ctypes.data - base] = 42  # writing the record shows through the view
    assert got["a"][0] == 42


def test_empty_batch_and_meta_only():
    assert decode_batch(encode({})) == ({}, {})
    assert decode_batch(encode({}, {"eof": True}))[1] == {"eof": True}


def test_write_batch_through_ring(job):
    with Ring.create(segment_name(job, "n0", "b"), 1 << 16) as r:
        r.unlink()
        tensors = {"ids": np.arange(100, dtype=np.int64), "mask": np.ones((4, 4), bool)}
        for step in range(10):
            write_batch(r, tensors, {"step": step}, timeout=1)
            got, meta = decode_batch(r.read(timeout=1))
            assert meta == {"step": step}
            assert_same(got, tensors)


def test_large_arrays_stream_into_the_ring_byte_for_byte(job, monkeypatch):
    """Arrays of STREAM_BYTES and more go in with streaming stores: every byte lands,
    whatever the array's length past a multiple of 64 (the tail) or its alignment in
    the source (a view one byte in); the smaller, strided and big-endian ones beside
    them take numpy's copy, and a ring record reused by later batches holds each
    batch's own bytes."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, STREAM_BYTES + 200, dtype=np.uint8)
    tensors = {
        "f32": rng.standard_normal(STREAM_BYTES // 4 + 13).astype(np.float32),
        "unaligned": raw[1 : STREAM_BYTES + 100],  # starts one byte into its buffer
        "flags": rng.integers(0, 2, STREAM_BYTES + 7).astype(bool),
        "i64_2d": rng.integers(-(2**62), 2**62, (STREAM_BYTES // 512, 65)),
        "strided": rng.integers(0, 9, (2 * STREAM_BYTES // 8,)).astype(np.int64)[::2],
        "big_endian": np.arange(STREAM_BYTES // 8 + 3, dtype=">f8"),
        "small": np.arange(7, dtype=np.int16),
    }
    streamed: list[int] = []  # bytes of each array that took the streaming copy

    def counted(dst, src):
        streamed.append(len(src))
        stream_copy(dst, src)

    monkeypatch.setattr(batch_module, "stream_copy", counted)
    with Ring.create(segment_name(job, "n0", "big"), 16 << 20) as r:
        r.unlink()
        for step in range(6):
            tensors["f32"][step] = step  # each batch differs
            write_batch(r, tensors, {"step": step}, timeout=5)
            got, meta = decode_batch(r.read(timeout=5))
            assert meta == {"step": step}
            assert_same(got, tensors)
    # the four large contiguous little-endian arrays streamed, every batch; the rest not
    one_batch = sorted(tensors[k].nbytes for k in ("f32", "unaligned", "flags", "i64_2d"))
    assert sorted(streamed) == sorted(one_batch * 6)


@pytest.mark.parametrize("offset", [0, 1, 15, 16, 63])
@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 63, 64, 65, 1000, 65536 + 129])
def test_stream_copy_writes_exactly_the_range(offset, size):
    rng = np.random.default_rng(size + offset)
    src = rng.integers(0, 256, size + 64, dtype=np.uint8)[offset : offset + size]
    dst = np.full(size + 160, 0xAB, dtype=np.uint8)
    stream_copy(memoryview(dst)[offset + 32 : offset + 32 + size], src)
    np.testing.assert_array_equal(dst[offset + 32 : offset + 32 + size], src)
    assert (dst[: offset + 32] == 0xAB).all() and (dst[offset + 32 + size :] == 0xAB).all()  # nothing around it


def test_stream_copy_refuses_ranges_of_other_lengths_and_read_only_targets():
    with pytest.raises(ValueError, match="100 bytes into 99"):
        stream_copy(bytearray(99), bytes(100))
    with pytest.raises(TypeError):
        stream_copy(bytes(8), bytes(8))


@pytest.mark.parametrize(
    ("value", "floor"), [(None, 1 << 20), ("4096", 4096), ("0", 1 << 62), ("-1", None), ("1MiB", None)]
)
def test_the_streaming_floor_follows_the_environment_and_a_bad_one_is_named(value, floor):
    env = {k: v for k, v in os.environ.items() if k != STREAM_ENV}
    if value is not None:
        env[STREAM_ENV] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    probe = "from overlord.shm._batch import STREAM_BYTES; print(STREAM_BYTES)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    if floor is None:
        assert done.returncode != 0
        assert f"${STREAM_ENV}={value!r} is not a number of bytes >= 0" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == floor


def test_encode_rejects_what_the_format_cannot_carry():
    with pytest.raises(TypeError, match="dtype complex128"):
        batch_nbytes({"c": np.zeros(2, complex)})
    with pytest.raises(TypeError, match="dtype object"):
        batch_nbytes({"o": np.array([object()])})
    with pytest.raises(TypeError, match="JSON"):
        batch_nbytes({}, {"arr": np.zeros(2)})
    with pytest.raises(ValueError, match="ndim 9"):
        batch_nbytes({"deep": np.zeros((1,) * 9)})
    with pytest.raises(ValueError, match="smaller than the batch"):
        encode_batch_into(bytearray(10), {"x": np.zeros(4)})
    with pytest.raises(TypeError, match="writable"):
        encode_batch_into(bytes(1000), {"x": np.zeros(4)})


def valid_record() -> bytearray:
    tensors = {"aa": np.arange(6, dtype=np.int32).reshape(2, 3), "ab": np.ones(3, np.float16)}
    return encode(tensors, {"k": 1})


def entry_pos(buf: bytearray, index: int) -> int:
    """Byte offset of tensor entry `index` in the table (entries are 40 + 8 * ndim bytes here)."""
    meta_nbytes = struct.unpack_from("<I", buf, 8)[0]
    pos = (16 + meta_nbytes + 7) & ~7
    for _ in range(index):
        ndim = buf[pos + 3]
        pos += 16 + 8 * ndim + 16
    return pos


def corrupt(offset_of, fmt: str, value) -> bytearray:
    buf = valid_record()
    struct.pack_into(fmt, buf, offset_of(buf), value)
    return buf


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (corrupt(lambda b: 0, "<4s", b"XXXX"), "magic"),
        (corrupt(lambda b: 4, "<H", 3), "version 3, this reader knows 1 and 2"),
        (corrupt(lambda b: 4, "<H", 2), "sample meta of 7 B is shorter than its 52 B fields"),
        (corrupt(lambda b: 6, "<H", 3), "entry 2 of 3 runs past the table end"),
        (corrupt(lambda b: 8, "<I", 10**6), "meta"),
        (corrupt(lambda b: 12, "<I", 10**9), "table end"),
        (corrupt(lambda b: 16, "<1s", b"["), "meta is not valid"),
        (corrupt(lambda b: entry_pos(b, 0) + 2, "<B", 99), "unknown dtype code 99"),
        (corrupt(lambda b: entry_pos(b, 0) + 3, "<B", 9), "ndim 9"),
        (corrupt(lambda b: entry_pos(b, 0) + 8, "<2s", b"\xff\xfe"), "UTF-8"),
        (corrupt(lambda b: entry_pos(b, 1) + 9, "<1s", b"a"), "appears twice"),
        (corrupt(lambda b: entry_pos(b, 0) + 16, "<q", -2), "negative dimension"),
        (corrupt(lambda b: entry_pos(b, 0) + 16, "<q", 3), "does not match shape"),
        (corrupt(lambda b: entry_pos(b, 0) + 32, "<Q", 8), "64-aligned range"),
        (corrupt(lambda b: entry_pos(b, 0) + 32, "<Q", 1 << 40), "64-aligned range"),
        (corrupt(lambda b: entry_pos(b, 0) + 40, "<Q", 1 << 62), "does not match shape"),
    ],
)
def test_corrupted_headers_raise_batch_format_error(buf, match):
    with pytest.raises(BatchFormatError, match=match):
        decode_batch(buf)


def test_every_truncation_raises():
    for record in (valid_record(), sample_record()):
        buf = bytes(record)
        for n in range(len(buf)):
            with pytest.raises(BatchFormatError):
                decode_batch(buf[:n])


def sample_record() -> bytearray:
    return encode({"input_ids": np.arange(5, dtype=np.int32)}, SampleMeta(3, 1, 1 << 40, "src\u00e9:2:17", 9, 0, 4))


def test_sample_meta_decodes_as_the_json_meta_would():
    """A loader's per-sample record (version 2: fixed ints and the key) reads back as the
    dict a JSON meta with the same fields gives, and is smaller."""
    tensors = {"input_ids": np.arange(5, dtype=np.int32)}
    as_json = {"s": 3, "e": 1, "q": 1 << 40, "k": "src\u00e9:2:17", "t": 9, "b": 0, "m": 4}
    buf = sample_record()
    assert struct.unpack_from("<H", buf, 4)[0] == 2
    got, meta = decode_batch(buf)
    assert_same(got, tensors)
    assert meta == as_json == decode_batch(encode(tensors, as_json))[1]
    assert len(buf) <= batch_nbytes(tensors, as_json)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda b: struct.pack_into("<I", b, 16 + 48, 99), "does not hold its 99 B key"),
        (lambda b: struct.pack_into("<2s", b, 16 + 52, b"\xff\xfe"), "key is not valid UTF-8"),
    ],
)
def test_corrupted_sample_meta_raises(edit, match):
    buf = sample_record()
    edit(buf)
    with pytest.raises(BatchFormatError, match=match):
        decode_batch(buf)


def test_sample_meta_out_of_range_is_refused():
    with pytest.raises(ValueError, match="64-bit"):
        batch_nbytes({}, SampleMeta(1 << 63, 0, 0, "k", 0, 0, 0))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512))
def test_random_bytes_never_crash(data):
    """Garbage after a valid magic+version: only BatchFormatError, or a bounded decode."""
    check_decode(b"OVLB\x01\x00" + data)


@settings(max_examples=500, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_records_never_crash(edits):
    buf = valid_record()
    for pos, value in edits:
        buf[pos % len(buf)] = value
    check_decode(buf)


def check_decode(buf) -> None:
    try:
        tensors, meta = decode_batch(buf)
    except BatchFormatError:
        return
    assert isinstance(meta, dict)
    base = np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0
    for arr in tensors.values():
        start = arr.ctypes.data - base
        assert 0 <= start and start + arr.nbytes <= len(buf)
