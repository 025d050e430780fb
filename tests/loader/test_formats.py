"""JSONL sources: the same order, epochs and exactly-once as Parquet, and bad lines by number."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord import config
from overlord.config import Source
from overlord.errors import SchemaError, SourceReadError
from overlord.loader import formats, storage
from overlord.loader.source_loader import SourceLoader


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(formats, "BLOCK_ROWS", 4)  # several row groups per small file


def rows(n, prefix="t"):
    return [{"id": i, "text": f"{prefix} {i} " * (i % 5 + 1)} for i in range(n)]


def write_jsonl(path, records, *, blank_every=0, newline="\n", trailing=True):
    lines = []
    for i, r in enumerate(records):
        lines.append(r if isinstance(r, str) else json.dumps(r))
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("  ")  # a blank line is not a row
    data = (newline.join(lines) + (newline if trailing else "")).encode()
    if str(path).endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    else:
        path.write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)
    return str(path)


def loader(paths, *, format="jsonl", epochs=1, partition=0, **kw):
    source = Source(name="web", paths=tuple(paths), format=format, shuffle_window=5, **kw)
    return SourceLoader(source, partition, seed=1, epochs=epochs)


def drain(ld):
    out = []
    while not ld.finished:
        got, _ = ld.prepare(7)
        out += got
    return [(s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in out]


def test_formats_registry_matches_config():
    assert set(config.FORMATS) == set(formats.FORMATS)


def test_jsonl_reads_like_parquet_with_the_same_row_groups(tmp_path):
    a, b = rows(13, "a"), rows(9, "b")
    jsonl = [write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b, trailing=False)]
    parquet = []
    for name, records in (("a", a), ("b", b)):
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet", row_group_size=4)
        parquet.append(str(tmp_path / f"{name}.parquet"))
    got = drain(loader(jsonl, epochs=2))
    assert loader(jsonl).groups.rows.tolist() == [4, 4, 4, 1, 4, 4, 1]
    assert got == drain(loader(parquet, format="parquet", epochs=2))
    keys = {f"web:0:{r}" for r in range(13)} | {f"web:1:{r}" for r in range(9)}
    for epoch in (0, 1):
        mine = [k for e, _, k, _ in got if e == epoch]
        assert len(mine) == len(keys) and set(mine) == keys


def test_blank_lines_and_crlf_are_not_rows(tmp_path):
    records = rows(11)
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    spaced = write_jsonl(tmp_path / "spaced.jsonl", records, blank_every=3, newline="\r\n")
    assert drain(loader([spaced])) == drain(loader([plain]))


def test_compressed_jsonl_reads_the_same_rows_one_group_per_file(tmp_path):
    records = rows(10)
    plain = write_jsonl(tmp_path / "x.jsonl", records)
    expected = {(k, ids) for _, _, k, ids in drain(loader([plain]))}
    for suffix in (".jsonl.gz", ".jsonl.zst"):
        path = write_jsonl(tmp_path / f"x{suffix}", records, blank_every=4)
        ld = loader([path])
        assert ld.groups.rows.tolist() == [10]  # no random access into a compressed stream
        assert {(k, ids) for _, _, k, ids in drain(ld)} == expected


def test_partitions_split_blocks_exactly_once(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", rows(30))
    keys = [k for p in range(3) for _, _, k, _ in drain(loader([path], partition=p, partitions=3))]
    assert sorted(keys) == sorted(f"web:0:{r}" for r in range(30))


def test_bad_json_line_names_source_file_and_line(tmp_path):
    records = rows(10)
    records[6] = '{"id": 6, "text": "unterminated'
    path = write_jsonl(tmp_path / "a.jsonl", records, blank_every=2)  # row 6 is on line 10
    with pytest.raises(SourceReadError, match=r"source 'web' file '.*a\.jsonl' row 6: line 10 is not valid JSON"):
        drain(loader([path]))


def test_skip_counts_bad_lines_with_bad_rows(tmp_path):
    records = rows(20)
    records[3] = "not json"
    records[8] = "[1, 2]"  # JSON, but not an object
    records[15] = {"id": 15, "text": None}  # a row the transform rejects
    ld = loader([write_jsonl(tmp_path / "a.jsonl", records)], on_error="skip", epochs=2)
    got = drain(ld)
    assert ld.skipped == 2 * 3
    assert {k for e, _, k, _ in got if e == 0} == {f"web:0:{r}" for r in range(20) if r not in (3, 8, 15)}


def test_columns_pick_fields_and_a_missing_field_is_a_bad_line(tmp_path):
    records = [{"text": f"t{i}", "meta": {"i": i}} for i in range(6)]
    records[2] = {"meta": {}}
    path = write_jsonl(tmp_path / "a.jsonl", records)
    seen = []
    ld = loader([path], columns=("text",), on_error="skip")
    ld.transform = lambda row: seen.append(row) or {"input_ids": __import__("numpy").zeros(1, "int32")}
    drain(ld)
    assert ld.skipped == 1 and sorted(r["text"] for r in seen) == [f"t{i}" for i in range(6) if i != 2]
    with pytest.raises(SourceReadError, match=r"row 2: line 3 has no field\(s\) \['text'\]"):
        drain(loader([path], columns=("text",)))


def test_line_index_outlives_the_open_file_lru(tmp_path, monkeypatch):
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", rows(9, n)) for n in "abc"]
    scans = []
    index = formats._Index
    monkeypatch.setattr(formats, "_Index", lambda *a: scans.append(1) or index(*a))
    ld = loader(paths, epochs=2)
    drain(ld)
    assert len(scans) == 3, "each file is indexed once, however often the LRU reopens it"
    assert ld.state_bytes() >= ld.format.nbytes > 0


def test_curriculum_needs_parquet(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", rows(4))
    with pytest.raises(SchemaError, match="Source.difficulty='level'.*JSONL lacks; convert the source to Parquet"):
        loader([path], difficulty="level")


def test_a_local_parquet_file_holds_no_row_group_bytes_after_the_read(tmp_path):
    # pyarrow's pre_buffer kept the last row group's raw bytes per open file (as much
    # again as the decoded group): a loader process with 150 sources held ~50 MiB of
    # them. Measured in a process of its own: Arrow's pool counts the whole process's.
    path = tmp_path / "images.parquet"
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(64 << 10) for _ in range(96)]  # incompressible and distinct, like JPEGs
    pq.write_table(pa.table({"image": blobs}), path, row_group_size=32)
    code = """if True:
        import sys
        import time
        import pyarrow as pa
        from overlord.loader import formats, storage
        file = formats.ParquetFormat().open(storage.expand("images", sys.argv[1])[0], "test")
        before = pa.total_allocated_bytes()
        chunk = file.read_group(1, None)
        assert chunk.nbytes >= 32 * 65536, chunk.nbytes
        del chunk
        # Arrow sometimes frees a read's buffers a moment later, on its own threads
        # (seen: 8 MiB held for under 0.2 s), so wait a bounded while for them
        deadline = time.monotonic() + 5
        while pa.total_allocated_bytes() - before >= 256 << 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(pa.total_allocated_bytes() - before)
    """
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 256 << 10  # a 2 MiB group read, nothing of it left
    chunk = formats.ParquetFormat().open(storage.expand("images", str(path))[0], "test").read_group(1, None)
    assert chunk.row(3)["image"] == blobs[35]
