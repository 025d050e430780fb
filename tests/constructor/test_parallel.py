"""Parallelism transforms: CP zigzag split and merge, PP stage fields, TP marker, for_rank."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.config import Mesh
from overlord.constructor.packing import IGNORE_INDEX, pack, pad
from overlord.constructor.parallel import (
    FIRST_STAGE_FIELDS,
    LAST_STAGE_FIELDS,
    MIDDLE_STAGE_FIELDS,
    TP_MARKER_FIELDS,
    cp_merge,
    cp_split,
    for_rank,
    needs_bytes,
    pad_for_cp,
    pp_stage,
    tp_marker,
)
from overlord.errors import BatchFormatError, ConfigError

PACKED = {"input_ids", "labels", "position_ids", "loss_mask", "cu_seqlens", "max_seqlen", "doc_lengths"}
CP_EXTRA = {"cu_seqlens_global", "max_seqlen_global", "cp_rank", "cp_size"}


def docs_of(lengths):
    # token j of document i is 1000 * (i + 1) + j: never 0, and says where it came from
    return [{"input_ids": np.arange(1000 * (i + 1), 1000 * (i + 1) + n, dtype=np.int64)} for i, n in enumerate(lengths)]


def image_doc(n, patches):
    return {
        "input_ids": np.arange(7, 7 + n, dtype=np.int64),
        "pixel_values": np.full((patches, 768), 3, np.uint8),
        "image_grid": np.array([[patches, 1]], np.int32),
    }


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), max_size=10),
    L=st.integers(4, 32),
    cp=st.sampled_from([1, 2, 4]),
    packed=st.booleans(),
)
def test_cp_split_is_zigzag_and_merges_back(lengths, L, cp, packed):
    if packed:  # pack() mislabels empty documents today; empty ones are covered by pad() and below
        lengths = [max(n, 1) for n in lengths]
    docs = docs_of(lengths)
    batch, _ = (pack if packed else pad)(docs, L)
    parts = [cp_split(batch, cp, r) for r in range(cp)]
    if cp == 1:
        assert parts[0] is batch and cp_merge(parts, 1) is batch
        return
    full = pad_for_cp(batch, cp)
    assert_same(cp_merge(parts[::-1], cp), full)
    # the padded sequence holds every document, padded to the least multiple of 2*cp
    real = [min(n, L) for n in lengths]
    padded = full["doc_lengths"].astype(int)
    assert all(p % (2 * cp) == 0 and n <= p < n + 2 * cp for n, p in zip(real, padded))
    cu_g = full["cu_seqlens"]
    for i, (n, a) in enumerate(zip(real, cu_g[:-1])):
        seg = full["input_ids"][0, a : a + padded[i]]
        assert seg[:n].tolist() == docs[i]["input_ids"][:n].tolist() and not seg[n:].any()
        assert full["position_ids"][0, a : a + padded[i]].tolist() == list(range(padded[i]))
        assert not full["loss_mask"][0, a + n : a + padded[i]].any()
    total = int(padded.sum())
    for r, part in enumerate(parts):
        assert set(part) == PACKED | CP_EXTRA
        assert part["input_ids"].shape == (1, total // cp)  # every CP rank gets as many tokens
        assert int(part["cp_rank"]) == r and int(part["cp_size"]) == cp and part["cp_rank"].dtype == np.int32
        assert np.array_equal(part["cu_seqlens_global"], cu_g) and part["cu_seqlens"].dtype == np.int32
        local = part["doc_lengths"].astype(int)
        assert np.array_equal(local, padded // cp)
        assert part["cu_seqlens"].tolist() == [0, *np.cumsum(local).tolist()]
        assert int(part["max_seqlen"]) == (local.max() if len(local) else 0)
        ids, pos, lab = part["input_ids"][0], part["position_ids"][0], part["labels"][0]
        for i, (a, c) in enumerate(zip(part["cu_seqlens"][:-1], local // 2)):
            whole = full["input_ids"][0, cu_g[i] : cu_g[i + 1]]
            want = np.concatenate([whole[r * c : (r + 1) * c], whole[(2 * cp - 1 - r) * c : (2 * cp - r) * c]])
            assert ids[a : a + 2 * c].tolist() == want.tolist()  # chunks r and 2cp-1-r
            want_pos = [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
            assert pos[a : a + 2 * c].tolist() == want_pos  # original positions
            for p, label in zip(want_pos, lab[a : a + 2 * c].tolist()):  # labels: next token of the document
                assert label == (docs[i]["input_ids"][p + 1] if p + 1 < real[i] else IGNORE_INDEX)
        assert np.array_equal(part["loss_mask"] == 1, part["labels"] != IGNORE_INDEX)


def test_cp_split_matches_the_documented_example():
    batch, _ = pack([{"input_ids": np.arange(1, 6)}, {"input_ids": np.arange(11, 19)}], 8)
    r0, r1 = cp_split(batch, 2, 0), cp_split(batch, 2, 1)
    assert r0["input_ids"].tolist() == [[1, 2, 0, 0, 11, 12, 17, 18]]
    assert r1["input_ids"].tolist() == [[3, 4, 5, 0, 13, 14, 15, 16]]
    assert r0["position_ids"].tolist() == [[0, 1, 6, 7, 0, 1, 6, 7]]
    assert r1["labels"].tolist() == [[4, 5, -100, -100, 14, 15, 16, 17]]
    assert r0["cu_seqlens"].tolist() == [0, 4, 8] and r0["cu_seqlens_global"].tolist() == [0, 8, 16]
    assert r0["doc_lengths"].tolist() == [4, 4] and int(r0["max_seqlen_global"]) == 8


def test_empty_document_stays_an_empty_segment():
    batch, _ = pack(docs_of([3, 4]), 8)
    batch = dict(batch, cu_seqlens=np.array([0, 3, 3, 7, 8], np.int32), doc_lengths=np.array([3, 0, 4], np.int32))
    part = cp_split(batch, 2, 0)
    assert part["doc_lengths"].tolist() == [2, 0, 2] and part["cu_seqlens"].tolist() == [0, 2, 2, 4]
    assert part["input_ids"].tolist() == [[1000, 0, 2000, 2003]]
    assert part["position_ids"].tolist() == [[0, 3, 0, 3]]
    assert part["cu_seqlens_global"].tolist() == [0, 4, 4, 8]


def test_images_pass_through_cp_untouched():
    batch, _ = pack([image_doc(5, 6), *docs_of([9]), image_doc(3, 2)], 16)
    for r in range(4):
        part = cp_split(batch, 4, r)
        for k in ("pixel_values", "image_grid", "image_doc"):
            assert np.array_equal(part[k], batch[k]) and part[k].dtype == batch[k].dtype
        assert part["image_doc"].tolist() == [0, 2] and len(part["doc_lengths"]) == 3


def test_cp_rejects_bad_input():
    batch, _ = pack(docs_of([3, 4]), 8)
    with pytest.raises(ConfigError):
        cp_split(batch, 2, 2)
    broken = dict(batch, doc_lengths=np.array([3, 5], np.int32))
    with pytest.raises(BatchFormatError, match="cu_seqlens"):
        cp_split(broken, 2, 0)
    with pytest.raises(BatchFormatError, match="ranks"):
        cp_merge([cp_split(batch, 2, 0)] * 2, 2)


def test_pp_stages_get_exactly_their_fields():
    batch, _ = pack([image_doc(5, 4), *docs_of([7])], 8)
    assert pp_stage(batch, 1, 0, 4) is batch
    meta = {"cu_seqlens", "max_seqlen", "doc_lengths", "micro_batches", "seq_shape"}
    first, middle, last = (pp_stage(batch, 3, s, 4) for s in range(3))
    assert set(first) == meta | {"input_ids", "position_ids", "pixel_values", "image_grid", "image_doc"}
    assert set(middle) == meta
    assert set(last) == meta | {"labels", "loss_mask"}
    assert set(first) <= FIRST_STAGE_FIELDS and set(middle) <= MIDDLE_STAGE_FIELDS and set(last) <= LAST_STAGE_FIELDS
    assert int(middle["micro_batches"]) == 4 and middle["micro_batches"].dtype == np.int32
    assert middle["seq_shape"].tolist() == [2, 8] and middle["seq_shape"].dtype == np.int64
    assert first["input_ids"] is batch["input_ids"] and last["labels"] is batch["labels"]
    # a field this module does not know travels with the inputs
    extra = pp_stage(dict(batch, token_type_ids=np.zeros((2, 8), np.int64)), 2, 0, 1)
    assert "token_type_ids" in extra
    with pytest.raises(ConfigError):
        pp_stage(batch, 2, 2, 1)


def test_tp_marker():
    batch, _ = pack(docs_of([3, 6]), 8)
    assert tp_marker(batch, 0) is batch and tp_marker(batch, 1, broadcast=False) is batch
    marker = tp_marker(batch, 1)
    assert int(marker["broadcast_from_tp0"]) == 1 and marker["broadcast_from_tp0"].dtype == np.int32
    assert marker["seq_shape"].tolist() == [2, 8] and int(marker["max_seqlen"]) == 6
    assert set(marker) == TP_MARKER_FIELDS | {f"shape.{k}" for k in batch}
    assert marker["shape.cu_seqlens"].tolist() == [len(batch["cu_seqlens"])]
    assert sum(v.nbytes for v in marker.values()) < 200


def test_for_rank_dp_cp_tp():
    mesh = Mesh(dp=2, cp=2, tp=2)
    batch, _ = pack(docs_of([5, 12, 3]), 16)
    for rank in range(mesh.world_size):
        at = mesh.coords(rank)
        got = for_rank(batch, mesh, rank, micro_batches=2, broadcast_tp=True)
        want = cp_split(batch, 2, at["cp"])
        if at["tp"] == 0:
            assert needs_bytes(mesh, rank, True)
            assert_same(got, want)
        else:
            assert not needs_bytes(mesh, rank, True)
            assert got["seq_shape"].tolist() == list(want["input_ids"].shape)
            assert "input_ids" not in got and int(got["broadcast_from_tp0"]) == 1
        assert needs_bytes(mesh, rank, False)
        assert_same(for_rank(batch, mesh, rank, micro_batches=2, broadcast_tp=False), want)
    parts = [for_rank(batch, mesh, r, micro_batches=2, broadcast_tp=True) for r in (4, 6)]  # dp 1, cp 0/1, tp 0
    assert_same(cp_merge(parts, 2), pad_for_cp(batch, 2))


def test_for_rank_with_pipeline_stages():
    mesh = Mesh(pp=2, cp=2, tp=2)
    batch, _ = pack([image_doc(6, 2), *docs_of([9])], 16)
    meta = {"cu_seqlens", "max_seqlen", "doc_lengths", "micro_batches", "seq_shape"} | CP_EXTRA
    for rank in range(mesh.world_size):
        at = mesh.coords(rank)
        got = for_rank(batch, mesh, rank, micro_batches=3, broadcast_tp=False)
        local = cp_split(batch, 2, at["cp"])
        if at["pp"] == 0:
            assert set(got) == meta | {"input_ids", "position_ids", "pixel_values", "image_grid", "image_doc"}
            assert np.array_equal(got["input_ids"], local["input_ids"])
        else:
            assert set(got) == meta | {"labels", "loss_mask"}
            assert np.array_equal(got["labels"], local["labels"])
        assert got["seq_shape"].tolist() == list(local["input_ids"].shape) and int(got["micro_batches"]) == 3
        assert needs_bytes(mesh, rank, False)
    assert [needs_bytes(Mesh(pp=3), r, False) for r in range(3)] == [True, False, True]
