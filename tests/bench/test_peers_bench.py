"""bench/peers.py on a tiny corpus: the corpus, tokenizer and transform every loader gets,
and the JSON line of a real run (the colocated loader: the peers are not in the test
environment; `make bench-peers` installs them in .venv-peers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import peers_data  # noqa: E402

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return peers_data.corpus(tmp_path_factory.mktemp("peers"), 5, 40, seed=3)


def test_corpus_is_cached_by_its_parameters_with_a_fifth_image_text(corpus):
    sources = peers_data.sources_of(corpus)
    assert [s["kind"] for s in sources].count("image_text") == 1 and len(sources) == 5
    image = next(s for s in sources if s["kind"] == "image_text")
    table = pq.read_table(image["files"][0])
    assert table.num_rows == 40 and table.column("image")[0].as_py()[:2] == b"\xff\xd8"  # a JPEG
    assert pq.ParquetFile(sources[0]["files"][0]).metadata.row_group(0).num_rows == 40  # <= 256 per group
    before = {p: p.stat().st_mtime_ns for p in corpus.rglob("*.parquet")}
    assert peers_data.corpus(corpus.parent, 5, 40, seed=3) == corpus
    assert {p: p.stat().st_mtime_ns for p in corpus.rglob("*.parquet")} == before


def test_one_bpe_tokenizer_and_one_transform_for_every_loader(corpus):
    path = peers_data.tokenizer(corpus)
    assert peers_data.tokenizer(corpus) == path  # cached
    text, image = (
        peers_data.Sample(**peers_data.sample_args({"kind": k}, path, context_length=16, image_side=32))
        for k in ("text", "image_text")
    )
    src = peers_data.sources_of(corpus)
    rows = pq.read_table(src[0]["files"][0]).to_pylist()
    samples = text.batch(rows)
    bos, eos = text.tokenize.bos, text.tokenize.eos
    assert all(s["input_ids"][0] == bos and s["input_ids"][-1] == eos and len(s["input_ids"]) <= 16 for s in samples)
    assert max(len(s["input_ids"]) for s in samples) == 16  # the long texts are cut to the context length
    assert [list(s["input_ids"]) for s in samples[:3]] == [list(text(r)["input_ids"]) for r in rows[:3]]
    row = pq.read_table(next(s for s in src if s["kind"] == "image_text")["files"][0]).to_pylist()[0]
    sample = image(row)
    assert sample["pixel_values"].shape == (4, 768) and sample["pixel_values"].dtype == np.uint8
    assert sample["image_grid"].tolist() == [[2, 2]]


def test_ratios_and_targets():
    loaders = {
        "overlord": {"pss_mb": 100.0, "tree_pss_mb": 400.0, "samples_per_s": 2000.0},
        "colocated": {"pss_mb": 2500.0, "tree_pss_mb": 2400.0, "samples_per_s": 1000.0},
        "mosaic": {"pss_mb": 300.0, "tree_pss_mb": 900.0, "samples_per_s": 1100.0},
        "litdata": {"pss_mb": 500.0, "tree_pss_mb": 800.0, "samples_per_s": 1200.0},
    }
    assert peers._ratios(loaders) == {
        "pss_vs_colocated": 25.0,
        "tree_pss_vs_colocated": 6.0,
        "pss_vs_best_peer": 3.0,
        "samples_per_s_vs_best_peer": 1.67,
    }


def test_a_run_prints_one_json_line(corpus, tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH / "peers.py"), "--corpus", str(corpus.parent), "--sources", "5", "--rows", "40",
         "--seed", "3", "--ranks", "1", "--workers", "1", "--warm", "8", "--samples", "32", "--batch-size", "8",
         "--hold", "1", "--only", "colocated", "--settle-max", "0", "--timeout", "60", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    fields = {"pss_mb", "tree_pss_mb", "samples_per_s", "ttfb_s", "cpu_s_per_1k"}
    assert set(result["loaders"]) == {"colocated"} and fields <= set(result["loaders"]["colocated"])
    figures = result["loaders"]["colocated"]
    assert figures["samples"] >= 32 and 0 < figures["pss_mb"] < figures["tree_pss_mb"] and figures["samples_per_s"] > 0
    assert 0 <= figures["image_share"] <= 1 and figures["probe_ms"] > 0
    assert result["config"]["sources"] == 5 and len(result["load_avg"]) == 3
