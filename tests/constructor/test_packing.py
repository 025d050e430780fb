"""Packing and padding: every token placed once, labels and boundaries right."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.constructor.packing import IGNORE_INDEX, pack, pad


def doc(n, start=10):
    return {"input_ids": np.arange(start, start + n, dtype=np.int32)}


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=0, max_size=12), L=st.integers(4, 48))
def test_pack_places_every_token_and_marks_segments(lengths, L):
    docs = [doc(n, 100 * (i + 1)) for i, n in enumerate(lengths)]
    out, truncated = pack(docs, L)
    assert truncated == sum(n > L for n in lengths)
    R = out["input_ids"].shape[0]
    assert out["input_ids"].shape == (R, L)
    cu = out["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == R * L and np.all(np.diff(cu) > 0)
    flat = out["input_ids"].reshape(-1)
    expected = [np.asarray(d["input_ids"][:L]) for d in docs]
    got = [flat[a:b] for a, b in zip(cu[:-1], cu[1:]) if flat[a] != 0]
    assert [list(g) for g in got] == [list(e) for e in expected]
    # labels: next token inside a document, ignored at its last token and in padding
    labels = out["labels"].reshape(-1)
    for a, b in zip(cu[:-1], cu[1:]):
        if flat[a] == 0:
            assert np.all(labels[a:b] == IGNORE_INDEX)
        else:
            assert list(labels[a : b - 1]) == list(flat[a + 1 : b]) and labels[b - 1] == IGNORE_INDEX
    assert np.array_equal(out["loss_mask"] == 1, out["labels"] != IGNORE_INDEX)
    assert list(out["doc_lengths"]) == [min(n, L) for n in lengths]


def test_position_ids_restart_per_document():
    out, _ = pack([doc(3), doc(2)], 8)
    assert list(out["position_ids"][0]) == [0, 1, 2, 0, 1, 0, 1, 2]


def test_pad_one_row_per_document():
    out, _ = pad([doc(3), doc(5)], 4)
    assert out["input_ids"].shape == (2, 4)
    assert list(out["attention_mask"][0]) == [1, 1, 1, 0]
    assert list(out["attention_mask"][1]) == [1, 1, 1, 1]


def test_images_are_concatenated_with_their_document():
    img = {
        "input_ids": np.arange(5, 9, dtype=np.int32),
        "pixel_values": np.ones((6, 768), np.uint8),
        "image_grid": np.array([[2, 3]], np.int32),
    }
    out, _ = pack([doc(3), img], 16)
    assert out["pixel_values"].shape == (6, 768)
    assert out["image_grid"].tolist() == [[2, 3]] and out["image_doc"].tolist() == [1]


def test_empty_micro_batch():
    out, _ = pack([], 8)
    assert out["input_ids"].shape == (0, 8) and out["cu_seqlens"].tolist() == [0]
