"""The synthetic corpus: determinism, schema, length distribution, images, idempotence."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from overlord.demo.corpus import MANIFEST, generate_corpus, generate_many, read_manifest
from overlord.errors import ConfigError
from overlord.transforms import image_text, tokenize

SMALL = dict(text_sources=2, image_sources=1, rows_per_source=300, files_per_source=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, list[str]]:
    """The default corpus (3 text + 1 image source, 2000 rows each)."""
    return generate_corpus(tmp_path_factory.mktemp("corpus"), seed=0)


def _bytes(corpus: dict[str, list[str]]) -> dict[str, bytes]:
    return {f"{n}/{Path(f).name}": Path(f).read_bytes() for n, fs in corpus.items() for f in fs}


def test_same_seed_same_bytes_other_seed_other_rows(tmp_path):
    a = generate_corpus(tmp_path / "a", seed=7, **SMALL)
    b = generate_corpus(tmp_path / "b", seed=7, **SMALL)
    c = generate_corpus(tmp_path / "c", seed=8, **SMALL)
    assert _bytes(a) == _bytes(b)
    assert pq.read_table(a["web"]).column("text") != pq.read_table(c["web"]).column("text")


def test_names_schema_files_and_ids(corpus):
    assert list(corpus) == ["web", "code", "books", "images"]
    for name, files in corpus.items():
        assert len(files) == 2 and all(Path(f).is_absolute() for f in files)
        table = pq.read_table(files)
        assert table.num_rows == 2000
        assert table.column("id").to_pylist() == list(range(2000))  # unique, in order
        assert pq.ParquetFile(files[0]).metadata.row_group(0).num_rows == 128
        if name == "images":
            assert table.schema.field("image").type == pa.binary()
            assert table.schema.field("width").type == pa.int32()
            assert table.schema.field("height").type == pa.int32()
            assert table.schema.field("caption").type == pa.string()
        else:
            assert table.schema.names == ["id", "text"]
            assert table.schema.field("text").type == pa.string()


def test_text_lengths_look_like_coyo_and_differ_per_source(corpus):
    medians = set()
    for name in ("web", "code", "books"):
        texts = pq.read_table(corpus[name]).column("text").to_pylist()
        lengths = np.array([len(tokenize(t)) for t in texts])
        assert (lengths <= 64).mean() >= 0.95, name
        assert lengths.max() >= 1000, name
        assert lengths.min() >= 1
        medians.add(float(np.median(lengths)))
    assert len(medians) == 3


def test_images_are_real_jpegs_of_varied_sizes(corpus):
    table = pq.read_table(corpus["images"], columns=["image", "width", "height", "caption"])
    rows = table.slice(0, 40).to_pylist()
    for row in rows:
        with Image.open(io.BytesIO(row["image"])) as img:
            assert img.format == "JPEG"
            assert img.size == (row["width"], row["height"])
        assert 32 <= row["width"] <= 256 and 32 <= row["height"] <= 256
    captions = table.column("caption").to_pylist()
    assert np.median([len(tokenize(c)) for c in captions]) <= 16
    grids = {tuple(image_text(r)["image_grid"][0]) for r in rows}
    assert len(grids) > 10  # patch counts vary


def test_reuses_a_complete_corpus_and_regenerates_otherwise(tmp_path):
    first = generate_corpus(tmp_path, **SMALL)
    files = [Path(f) for fs in first.values() for f in fs]
    stamps = [f.stat().st_mtime_ns for f in files]
    assert generate_corpus(tmp_path, **SMALL) == first
    assert [f.stat().st_mtime_ns for f in files] == stamps
    manifest = read_manifest(tmp_path)
    assert manifest["sources"]["images"]["transform"] == "overlord.transforms:image_text"
    assert manifest["sources"]["web"]["kind"] == "text"
    # A damaged file is noticed and rewritten with the same bytes.
    good = files[0].read_bytes()
    files[0].write_bytes(good[:100])
    assert generate_corpus(tmp_path, **SMALL) == first
    assert files[0].read_bytes() == good
    # Other parameters are another corpus.
    other = generate_corpus(tmp_path, **{**SMALL, "rows_per_source": 301})
    assert pq.read_table(other["web"]).num_rows == 301
    assert json.loads((tmp_path / MANIFEST).read_text())["params"]["rows_per_source"] == 301


def test_generate_many_is_mostly_text_and_fast(tmp_path):
    corpus = generate_many(tmp_path, 40, 60, image_every=20)
    assert len(corpus) == 40
    assert [n for n in corpus if n.startswith("images")] == ["images", "images1"]
    assert "text39" not in corpus and "text37" in corpus
    assert pq.read_table(corpus["text20"]).num_rows == 60


@pytest.mark.parametrize(
    "bad",
    [
        {"rows_per_source": 1},
        {"files_per_source": 0},
        {"text_sources": -1},
        {"text_sources": 0, "image_sources": 0},
        {"max_image_side": 8},
    ],
)
def test_bad_parameters_raise_config_error(tmp_path, bad):
    with pytest.raises(ConfigError, match="generate_corpus"):
        generate_corpus(tmp_path, **bad)
