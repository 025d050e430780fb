"""Sample transforms: tokenizer ids, text and image_text outputs, metadata, resolve."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from overlord import transforms as T
from overlord.errors import ConfigError


def _encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def test_tokenize_splits_words_and_punctuation_and_hashes_with_crc32():
    ids = T.tokenize("Hello, world!")
    pieces = ["Hello", ",", "world", "!"]
    expected = [zlib.crc32(p.encode()) % (T.VOCAB_SIZE - 4) + 4 for p in pieces]
    assert ids.dtype == np.int32
    assert ids.tolist() == expected
    assert T.tokenize("").tolist() == []
    assert T.tokenize("  \n\t ").shape == (0,)


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text())
def test_tokenize_is_stable_in_range_and_splits_at_whitespace(a, b):
    ids = T.tokenize(a)
    assert ids.dtype == np.int32
    assert ((ids >= 4) & (ids < T.VOCAB_SIZE)).all()
    assert np.array_equal(T.tokenize(a), ids)
    joined = T.tokenize(a + " " + b)
    assert joined.tolist() == ids.tolist() + T.tokenize(b).tolist()


def test_text_adds_bos_and_eos():
    out = T.text({"id": 7, "text": "a b."})
    assert list(out) == ["input_ids"]
    ids = out["input_ids"]
    assert ids.dtype == np.int32
    assert ids[0] == T.BOS_ID and ids[-1] == T.EOS_ID
    assert ids[1:-1].tolist() == T.tokenize("a b.").tolist()
    assert T.text({"text": ""})["input_ids"].tolist() == [T.BOS_ID, T.EOS_ID]


def test_text_errors_name_the_column():
    with pytest.raises(KeyError, match="'text'.*\\['caption', 'id'\\]"):
        T.text({"id": 1, "caption": "x"})
    with pytest.raises(TypeError, match="'text' must be str, got int"):
        T.text({"text": 3})


@pytest.mark.parametrize(
    ("width", "height", "grid"),
    [
        (48, 32, (2, 3)),  # exact multiples: no resize
        (40, 20, (1, 3)),  # 2.5 patches rounds up, 1.25 rounds down
        (5, 7, (1, 1)),  # at least one patch per side
        (1000, 10, (1, 28)),  # at most 448 px per side
    ],
)
def test_image_text_grid_and_shapes(width, height, grid):
    pixels = np.full((height, width, 3), 128, dtype=np.uint8)
    out = T.image_text({"caption": "a red cat", "image": _encoded(pixels, "JPEG")})
    hp, wp = grid
    assert out["image_grid"].dtype == np.int32
    assert out["image_grid"].tolist() == [[hp, wp]]
    assert out["pixel_values"].dtype == np.uint8
    assert out["pixel_values"].shape == (hp * wp, 16 * 16 * 3)
    assert out["input_ids"].tolist() == [T.BOS_ID, *T.tokenize("a red cat").tolist(), T.EOS_ID]


def test_image_text_cuts_patches_row_major():
    # 2 x 3 patches, each a distinct flat colour; PNG keeps the values exact.
    pixels = np.zeros((32, 48, 3), dtype=np.uint8)
    for i in range(2):
        for j in range(3):
            pixels[16 * i : 16 * (i + 1), 16 * j : 16 * (j + 1)] = (10 * i + j, 100 + j, 200 + i)
    out = T.image_text({"caption": "", "image": _encoded(pixels)})
    patches = out["pixel_values"].reshape(6, 16 * 16, 3)
    for k, (i, j) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]):
        assert (patches[k] == (10 * i + j, 100 + j, 200 + i)).all()
    assert out["pixel_values"].flags["C_CONTIGUOUS"]


def test_image_text_converts_grayscale_to_rgb():
    buf = io.BytesIO()
    Image.new("L", (16, 16), 77).save(buf, format="PNG")
    out = T.image_text({"caption": "x", "image": buf.getvalue()})
    assert (out["pixel_values"] == 77).all() and out["pixel_values"].shape == (1, 768)


def test_image_text_errors():
    with pytest.raises(KeyError, match="'image'"):
        T.image_text({"caption": "x"})
    with pytest.raises(TypeError, match="'caption' must be str"):
        T.image_text({"caption": None, "image": b""})
    with pytest.raises(ValueError, match="do not decode"):
        T.image_text({"caption": "x", "image": b"not an image"})


def test_sample_metadata():
    image = _encoded(np.zeros((32, 16, 3), np.uint8))
    sample = T.image_text({"caption": "two words", "image": image})
    assert T.sample_metadata(sample) == (4, 2, 4 * 4 + 2 * 768 + 2 * 4)
    assert T.sample_metadata(T.text({"text": "one"})) == (3, 0, 12)
    assert T.sample_metadata({}) == (0, 0, 0)


def test_resolve_finds_the_named_transforms():
    assert T.resolve("overlord.transforms:text") is T.text
    assert T.resolve("overlord.transforms:image_text") is T.image_text
    assert T.resolve("os.path:join.__call__") is not None  # dotted attribute path


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("overlord.transforms.text", "must be 'module:callable'"),
        ("a:b:c", "must be 'module:callable'"),
        (":text", "must name both"),
        ("overlord.no_such_module:text", "cannot be imported"),
        ("overlord.transforms:no_such", "has no attribute 'no_such'"),
        ("overlord.transforms:VOCAB_SIZE", "not callable"),
    ],
)
def test_resolve_errors_name_the_spec(spec, why):
    with pytest.raises(ConfigError, match=why) as info:
        T.resolve(spec)
    assert repr(spec) in str(info.value)
