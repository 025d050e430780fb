"""`on_error: skip` through a real sidecar and trainer (issue 17): damaged Parquet files
next to a good source. Every readable row arrives exactly once, the skips are counted
per file in Redis and `overlord status`, and the good source never stalls; under
`raise` the trainer hears which file and row group; a source whose every row is skipped
ends the job with its counts instead of a stall blamed on the loaders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import assert_delivered

from overlord import BatchSpec, Mesh, Source
from overlord.demo.corpus import TEXT_TRANSFORM
from overlord.loader.skips import per_file
from overlord.store import Keys

pytestmark = pytest.mark.timeout(180)

SMALL = dict(
    mesh=Mesh(dp=1), batch=BatchSpec(global_batch=8, context_length=256, ring_bytes=1 << 20), sample_ring_bytes=1 << 16
)


def garble_row_group(path, group: int) -> int:
    """Overwrite the `text` column chunk of row group `group` inside its pages, the
    footer intact; returns the group's row count."""
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(group).column(meta.schema.to_arrow_schema().get_field_index("text"))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(open(path, "rb").read())
    for i in range(start + 24, start + chunk.total_compressed_size - 4):
        data[i] = (data[i] * 7 + 13) & 0xFF
    open(path, "wb").write(bytes(data))
    return meta.row_group(group).num_rows


def damaged_source(corpus, d, **kw) -> tuple[Source, set[str], dict[str, dict]]:
    """A source 'damaged' over the corpus's 'code' files (row group 1 of the second one
    garbled), a file of random bytes, a truncated one, one lacking the declared column
    'text', and one whose single row is larger than the 64 KiB sample ring. Returns it,
    the keys of its readable rows, and the skips expected per file name."""
    d.mkdir()
    a, b = sorted(corpus["code"])
    shutil.copy(a, d / "0-code.parquet")
    shutil.copy(b, d / "1-code.parquet")
    garbled = garble_row_group(d / "1-code.parquet", 1)
    first = pq.ParquetFile(d / "1-code.parquet").metadata.row_group(0).num_rows
    (d / "2-random.parquet").write_bytes(np.random.default_rng(7).bytes(5000))
    (d / "3-truncated.parquet").write_bytes(open(a, "rb").read()[:-200])
    pq.write_table(pa.table({"id": [1, 2, 3]}), d / "4-nocolumn.parquet")
    pq.write_table(pa.table({"text": ["word " * 40_000]}), d / "5-oversize.parquet")  # ~160 KB of int32 tokens
    rows = [pq.ParquetFile(p).metadata.num_rows for p in (a, b)]
    readable = {f"damaged:0:{r}" for r in range(rows[0])} | {
        f"damaged:1:{r}" for r in range(rows[1]) if not first <= r < first + garbled
    }
    expected = {
        "1-code.parquet": {"whole": 0, "groups": 1, "rows": garbled},
        "2-random.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "3-truncated.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "4-nocolumn.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "5-oversize.parquet": {"whole": 0, "groups": 0, "rows": 1},
    }
    src = Source(
        name="damaged",
        paths=(str(d / "*.parquet"),),
        transform=TEXT_TRANSFORM,
        columns=("text",),
        shuffle_window=48,
        **kw,
    )
    return src, readable, expected


def good_source(corpus) -> tuple[Source, set[str]]:
    files = sorted(corpus["web"])
    keys = {f"web:{f}:{r}" for f, p in enumerate(files) for r in range(pq.ParquetFile(p).metadata.num_rows)}
    return Source(name="web", paths=tuple(files), transform=TEXT_TRANSFORM, shuffle_window=48), keys


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_skip_delivers_every_readable_row_once_and_counts_per_file(cluster, corpus, tmp_path):
    damaged, readable, expected = damaged_source(corpus, tmp_path / "damaged", on_error="skip")
    web, web_keys = good_source(corpus)
    c = cluster(sources=(web, damaged), epochs=1, **SMALL)
    c.start_sidecar()
    started = time.monotonic()
    c.start_trainers(timeout=30, sleep=0.1)  # ~60 batches: Redis is read while the job runs
    # the counts per file, in Redis and in `overlord status` (the sidecar ends with the job)
    r, counters, got = c.redis(), {}, {}
    while got != expected:
        assert time.monotonic() - started < 60, f"skips counted so far: {counters}\n{c.log()}"
        time.sleep(0.2)
        counters = {k.decode(): int(v) for k, v in r.hgetall(Keys(c.job.name).counters).items()}
        got = {uri.rsplit("/", 1)[1]: n for (source, uri), n in per_file(counters).items() if source == "damaged"}
    assert counters["skipped:damaged.0"] == expected["1-code.parquet"]["rows"] + 1
    assert not any(k.startswith("skipped") and "web" in k for k in counters), counters
    status = subprocess.run(
        [sys.executable, "-m", "overlord.cli", "status", "--config", str(c.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    lines = [line for line in status.stdout.splitlines() if line.startswith("skipped (on_error: skip)")]
    assert len(lines) == len(expected), status.stdout
    for name, n in expected.items():
        line = next(line for line in lines if name in line)
        assert "source 'damaged'" in line
        assert ("skipped whole" in line) if n["whole"] else (f"{n['rows']} row(s) skipped" in line), line
        if n["groups"]:
            assert f"{n['groups']} unreadable row group(s)" in line, line
    results = c.results(timeout=120)
    assert results[0]["end"] == "stop", f"{results[0]['end']}\n{c.log()}"
    assert time.monotonic() - started < 90, "the job stalled"
    assert_delivered(results, web_keys | readable, log=c.log)  # each readable row once, nothing else
    log = c.log()
    for words in (
        "2-random.parquet' skipped whole",
        "1-code.parquet' row group 1 skipped",
        "4-nocolumn.parquet' skipped whole (on_error: skip): no column(s) ['text']",
        "5-oversize.parquet' row 0 skipped (on_error: skip): the sample is",
    ):
        assert words in log, words
    assert c.stop() == 0


def test_raise_names_the_garbled_row_group_to_the_trainer(cluster, corpus, tmp_path):
    d = tmp_path / "garbled"
    d.mkdir()
    shutil.copy(sorted(corpus["code"])[1], d / "code.parquet")
    garble_row_group(d / "code.parquet", 1)
    first = pq.ParquetFile(d / "code.parquet").metadata.row_group(0).num_rows
    damaged = Source(name="damaged", paths=(str(d / "code.parquet"),), transform=TEXT_TRANSFORM)
    web, _ = good_source(corpus)
    c = cluster(sources=(web, damaged), epochs=1, **SMALL)
    c.start_sidecar()
    c.start_trainers(timeout=30)
    end = c.results(timeout=90)[0]["end"]
    assert end.startswith("RemoteRoleError") and "SourceReadError" in end, end
    for words in (
        "source 'damaged' file",
        "code.parquet' row group 1 (rows",
        f"rows {first} to",
        "cannot be read",
        "on_error: skip",
    ):
        assert words in end, (words, end)
    c.stop()


def test_a_source_whose_every_row_is_skipped_ends_with_its_counts(cluster, corpus, tmp_path):
    """Endless job: the all-skipped source stops the job at once, naming itself and its
    counts (before, a 15-30 s stall and a PlanError blaming hung loaders)."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.parquet").write_bytes(np.random.default_rng(1).bytes(3000))
    shutil.copy(sorted(corpus["code"])[0], d / "b.parquet")
    groups = pq.ParquetFile(d / "b.parquet").metadata.num_row_groups
    rows = sum(garble_row_group(d / "b.parquet", g) for g in range(groups))
    bad = Source(name="bad", paths=(str(d / "*.parquet"),), transform=TEXT_TRANSFORM, on_error="skip")
    web, _ = good_source(corpus)
    c = cluster(sources=(web, bad), epochs=None, timeout_s=15.0, **SMALL)
    c.start_sidecar()
    started = time.monotonic()
    c.start_trainers(timeout=30)
    end = c.results(timeout=90)[0]["end"]
    assert time.monotonic() - started < 45, "stalled before the error"
    assert end.startswith("RemoteRoleError") and "SourceReadError" in end, end
    for words in (
        "source 'bad' partition 0 of 1: every row of epoch 0 was skipped",
        f"{rows} row(s) skipped",
        "a.parquet' skipped whole",
        f"b.parquet': {rows} row(s) skipped in {groups} unreadable row group(s)",
    ):
        assert words in end, (words, end)
    assert "no Source Loader reported" not in end
    r = c.redis()
    counters = {k.decode(): int(v) for k, v in r.hgetall(Keys(c.job.name).counters).items()}
    assert counters["skipped:bad.0"] == rows, counters  # published though the loader stopped
    files = {uri.rsplit("/", 1)[1]: n for (_, uri), n in per_file(counters).items()}
    assert files == {
        "a.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "b.parquet": {"whole": 0, "groups": groups, "rows": rows},
    }
    c.stop()
