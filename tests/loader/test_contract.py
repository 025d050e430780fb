"""The transform output contract: pure checks (contract.py), then through a Source Loader
over real Parquet files, where a violation is a bad row naming source, file, row and
field, subject to on_error."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import Source
from overlord.errors import SourceReadError
from overlord.loader.contract import ContractError, check_sample
from overlord.loader.source_loader import SourceLoader
from overlord.transforms import text
from tests.integration.bad_transforms import is_bad

# -- the pure checks ----------------------------------------------------------------------


def test_a_good_sample_passes_unchanged():
    ids = np.array([1, 5, 2], dtype=np.int32)
    pixels = np.zeros((6, 768), dtype=np.uint8)
    grid = np.array([[2, 3]], dtype=np.int32)
    out = check_sample({"input_ids": ids, "pixel_values": pixels, "image_grid": grid, "loss": np.ones(3, np.float32)})
    assert out["input_ids"] is ids and out["pixel_values"] is pixels and out["image_grid"] is grid


def test_integral_floats_are_cast_to_int64():
    out = check_sample({"input_ids": np.array([1.0, 31999.0, 2.0]), "labels": np.array([-100.0, 7.0], np.float32)})
    assert out["input_ids"].dtype == np.int64 and out["input_ids"].tolist() == [1, 31999, 2]
    assert out["labels"].dtype == np.int64 and out["labels"].tolist() == [-100, 7]


def test_fractions_are_refused_never_truncated():
    with pytest.raises(
        ContractError,
        match=r"field 'input_ids' \(dtype float64\) holds the fraction 5\.5 at index 1 "
        r"\(1 of 3 values not integral\).*return an integer array",
    ):
        check_sample({"input_ids": np.array([1.0, 5.5, 2.0])})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_never_cast(bad):
    with pytest.raises(
        ContractError,
        match=r"field 'labels' \(dtype float32\) holds (nan|inf|-inf) at index 2 "
        r"\(1 non-finite of 3\).*never yields NaN or inf",
    ):
        check_sample({"labels": np.array([1, 2, bad], dtype=np.float32)})


def test_token_ids_are_1d():
    with pytest.raises(ContractError, match=r"field 'input_ids' has shape \(3, 1\); token ids are 1-D"):
        check_sample({"input_ids": np.zeros((3, 1), np.int32)})
    with pytest.raises(ContractError, match=r"field 'labels' has shape \(\); token ids are 1-D"):
        check_sample({"labels": np.array(3, np.int64)})


@pytest.mark.parametrize(
    "arr",
    [
        np.array(["a", "b"]),
        np.array([b"a"]),
        np.array([{"a": 1}], dtype=object),
        np.array([1 + 2j]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
    ],
)
def test_dtypes_the_batch_format_cannot_carry_are_refused(arr):
    with pytest.raises(
        ContractError,
        match=rf"field 'meta' has dtype {re.escape(str(arr.dtype))}, which a batch cannot carry "
        r"\(one of: bool, int8\.\.int64",
    ):
        check_sample({"input_ids": np.array([1, 2], np.int32), "meta": arr})


def test_a_string_token_field_is_refused_by_dtype():
    with pytest.raises(ContractError, match=r"field 'input_ids' has dtype <U1, which a batch cannot carry"):
        check_sample({"input_ids": np.array(["1", "2"])})


def test_bool_token_ids_are_refused():
    with pytest.raises(ContractError, match=r"field 'input_ids' has dtype bool; it holds integers"):
        check_sample({"input_ids": np.array([True, False])})


def test_token_ids_within_the_vocabulary():
    check_sample({"input_ids": np.array([0, 999], np.int32)}, vocab_size=1000)
    with pytest.raises(
        ContractError,
        match=r"field 'input_ids' holds token id 1000 at index 1 \(2 of 3 outside "
        r"\[0, 1000\)\).*BatchSpec\.vocab_size",
    ):
        check_sample({"input_ids": np.array([5, 1000, 4000], np.int64)}, vocab_size=1000)
    with pytest.raises(
        ContractError, match=r"field 'input_ids' holds token id -3 at index 0 .*\[0, 9223372036854775807\]"
    ):
        check_sample({"input_ids": np.array([-3, 4], np.int32)})
    with pytest.raises(ContractError, match=r"field 'input_ids' holds token id 18446744073709551615 at index 1"):
        check_sample({"input_ids": np.array([3, 2**64 - 1], np.uint64)})  # would wrap to -1 in the packing's int64
    # labels may hold the ignore index, nothing else below 0
    check_sample({"labels": np.array([-100, 5], np.int64)}, vocab_size=10)
    with pytest.raises(ContractError, match=r"field 'labels' holds token id -1 at index 1"):
        check_sample({"labels": np.array([-100, -1], np.int64)}, vocab_size=10)


def test_image_shapes_as_image_text_defines_them():
    ids = np.array([1, 2], np.int32)
    with pytest.raises(ContractError, match=r"field 'image_grid' has shape \(2,\); it is \[images, 2\]"):
        check_sample({"input_ids": ids, "image_grid": np.array([2, 3], np.int32)})
    with pytest.raises(ContractError, match=r"field 'image_grid' holds \[\[0, 3\]\]; every image has at least 1"):
        check_sample({"input_ids": ids, "image_grid": np.array([[0, 3]], np.int32)})
    with pytest.raises(ContractError, match=r"field 'pixel_values' has shape \(2, 3, 768\); it is \[patches, "):
        check_sample({"input_ids": ids, "pixel_values": np.zeros((2, 3, 768), np.uint8)})
    with pytest.raises(ContractError, match=r"'pixel_values' has 5 patches but 'image_grid' \[\[2, 3\]\] announces 6"):
        check_sample({"pixel_values": np.zeros((5, 768), np.uint8), "image_grid": np.array([[2, 3]], np.int32)})
    with pytest.raises(ContractError, match=r"field 'image_grid' \(dtype float64\) holds nan"):
        check_sample({"image_grid": np.array([[np.nan, 3.0]])})


def test_not_a_dict_of_arrays():
    with pytest.raises(ContractError, match=r"returned list; a transform returns dict\[str, numpy.ndarray\]"):
        check_sample([np.zeros(3)])
    with pytest.raises(ContractError, match=r"field 'input_ids' is a list; .*np.asarray"):
        check_sample({"input_ids": [1, 2]})


# -- through a Source Loader --------------------------------------------------------------

TEXTS = [f"row number {i} of the file" for i in range(40)]
BAD_ROWS = [i for i, t in enumerate(TEXTS) if is_bad(t)]


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": TEXTS}), path, row_group_size=8)
    return str(path)


def loader(path, transform, **kw):
    vocab = kw.pop("vocab_size", None)
    source = Source(
        name="web", paths=(path,), shuffle_window=4, transform=f"tests.integration.bad_transforms:{transform}", **kw
    )
    return SourceLoader(source, 0, seed=1, epochs=1, vocab_size=vocab)


def drain(ld):
    out = []
    while not ld.finished:
        out += ld.prepare(7)[0]
    return out


def test_the_corpus_has_bad_and_good_rows():
    assert 0 < len(BAD_ROWS) < len(TEXTS) // 2, BAD_ROWS


@pytest.mark.parametrize(
    "transform, field, what",
    [
        ("fractional_ids", "input_ids", r"holds the fraction \d+\.5 at index 0"),  # was truncated to int64
        ("nan_ids", "input_ids", r"holds nan at index \d+"),  # was -9223372036854775808
        ("ids_2d", "input_ids", r"has shape \(\d+, 1\); token ids are 1-D"),  # was flattened
        ("string_field", "source_text", r"has dtype <U\d+, which a batch cannot carry"),  # was a TypeError, no origin
        ("object_field", "meta", r"has dtype object, which a batch cannot carry"),  # the same
    ],
)
def test_a_violation_is_a_source_read_error_naming_source_file_row_field(parquet, transform, field, what):
    ld = loader(parquet, transform)
    with pytest.raises(SourceReadError) as info:
        drain(ld)
    msg = str(info.value)
    row = int(msg.split(" row ", 1)[1].split(":", 1)[0])
    assert row in BAD_ROWS, msg
    assert msg.startswith(
        f"source 'web' file '{parquet}' row {row}: the output of transform "
        f"tests.integration.bad_transforms:{transform} breaks the contract: field '{field}' "
    ), msg
    assert re.search(what, msg), msg
    assert msg.endswith("Fix the data or the transform, or set on_error: skip on the source"), msg


@pytest.mark.parametrize("transform", ["fractional_ids", "nan_ids", "ids_2d", "string_field", "object_field"])
def test_under_skip_the_bad_rows_are_counted_and_the_others_delivered_right(parquet, transform):
    ld = loader(parquet, transform, on_error="skip")
    samples = drain(ld)
    assert sorted(s.key for s in samples) == sorted(f"web:0:{r}" for r in range(len(TEXTS)) if r not in BAD_ROWS)
    assert ld.skipped == len(BAD_ROWS)
    for s in samples:  # the good rows are the text transform's ids, as int (floats cast exactly)
        row = int(s.key.rsplit(":", 1)[1])
        want = text({"text": TEXTS[row]})["input_ids"]
        assert s.arrays["input_ids"].dtype.kind == "i" and s.arrays["input_ids"].tolist() == want.tolist()
        assert s.tokens == len(want)


def test_the_job_vocabulary_bounds_token_ids(parquet):
    with pytest.raises(
        SourceReadError,
        match=r"source 'web' file .* row \d+: .* field 'input_ids' holds token id "
        r"\d+ at index 1 .*outside \[0, 100\)",
    ):
        drain(SourceLoader(Source(name="web", paths=(parquet,)), 0, seed=1, epochs=1, vocab_size=100))
    assert len(drain(SourceLoader(Source(name="web", paths=(parquet,)), 0, seed=1, epochs=1, vocab_size=32000))) == 40
