"""`on_error: skip` over real damaged files: what is skipped, counted, and what still
arrives exactly once in the same order; under `raise`, the error names the place."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import Source
from overlord.errors import SchemaError, SourceReadError
from overlord.loader.hosting import ring_max_record
from overlord.loader.skips import per_file
from overlord.loader.source_loader import SourceLoader
from overlord.shm import Ring, segment_name, unlink_segment


def write(path, n, row_group_size=10, start=0, **columns):
    table = {"id": list(range(start, start + n)), "text": [f"row {start + i} " + "word " * 30 for i in range(n)]}
    pq.write_table(pa.table({**table, **columns}), path, row_group_size=row_group_size)
    return str(path)


def garble_row_group(path, group: int) -> None:
    """Overwrite the bytes of the `text` column chunk of `group` (its data pages, after
    their page headers), leaving the footer intact: the row group no longer decodes."""
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(group).column(meta.schema.to_arrow_schema().get_field_index("text"))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(open(path, "rb").read())
    for i in range(start + 24, start + chunk.total_compressed_size - 4):
        data[i] = (data[i] * 7 + 13) & 0xFF
    open(path, "wb").write(bytes(data))


def loader(paths, *, epochs=1, partition=0, partitions=1, **kw):
    src = Source(name="web", paths=tuple(paths), shuffle_window=7, partitions=partitions, **kw)
    return SourceLoader(src, partition, seed=3, epochs=epochs)


def drain(ld, limit=10_000):
    out = []
    while not ld.finished:
        got, _ = ld.prepare(9)
        out += got
        assert len(out) < limit
    return out


def keys(samples):
    return [s.key for s in samples]


@pytest.fixture
def damaged(tmp_path):
    """Five files: good, random bytes, truncated, lacking column 'lang', good with one
    garbled row group (rows 10..19 of 40)."""
    d = tmp_path / "data"
    d.mkdir()
    write(d / "0-good.parquet", 30, lang=["en"] * 30)
    (d / "1-random.parquet").write_bytes(np.random.default_rng(0).bytes(4000))
    whole = write(tmp_path / "whole.parquet", 30, lang=["en"] * 30)
    (d / "2-truncated.parquet").write_bytes(open(whole, "rb").read()[:-300])
    write(d / "3-nolang.parquet", 20)
    write(d / "4-garbled.parquet", 40, lang=["en"] * 40)
    garble_row_group(d / "4-garbled.parquet", 1)
    return str(d / "*.parquet")


READABLE = {f"web:0:{r}" for r in range(30)} | {f"web:4:{r}" for r in range(40) if not 10 <= r < 20}


def test_skip_reads_every_readable_row_once_and_counts_per_file(damaged):
    ld = loader([damaged], on_error="skip", columns=("id", "text", "lang"))
    got = keys(drain(ld))
    assert sorted(got) == sorted(READABLE) and len(got) == len(READABLE)  # each readable row once
    assert ld.skipped == 10  # the rows of the garbled row group
    assert (ld.skips.files_skipped, ld.skips.groups_skipped) == (3, 1)
    fields = ld.skips.fields()
    assert fields["skipped:web.0"] == 10
    for name in ("1-random", "2-truncated", "3-nolang"):
        assert fields[f"skipped_file:web.0:{os.path.dirname(damaged)}/{name}.parquet"] == 1
    garbled = f"{os.path.dirname(damaged)}/4-garbled.parquet"
    assert fields[f"skipped_groups:web.0:{garbled}"] == 1 and fields[f"skipped_rows:web.0:{garbled}"] == 10
    assert len(fields) == 6  # nothing for the good file


def test_the_order_of_readable_rows_is_that_of_the_undamaged_source(damaged, tmp_path):
    """Skipping a row group renumbers nothing: the readable rows come in the order the
    same files give undamaged (a file skipped whole is one with no rows)."""
    clean = tmp_path / "clean"
    clean.mkdir()
    write(clean / "0-good.parquet", 30, lang=["en"] * 30)
    for name in ("1-random", "2-truncated", "3-nolang"):  # files with no row group
        pq.ParquetWriter(
            clean / f"{name}.parquet", pa.schema({"id": pa.int64(), "text": pa.string(), "lang": pa.string()})
        ).close()
    write(clean / "4-garbled.parquet", 40, lang=["en"] * 40)
    undamaged = [k for k in keys(drain(loader([str(clean / "*.parquet")], epochs=2))) if k in READABLE]
    damaged_order = keys(drain(loader([damaged], epochs=2, on_error="skip", columns=("id", "text", "lang"))))
    assert damaged_order == undamaged


def test_a_resumed_or_shadow_loader_skips_the_same_rows(damaged):
    first = loader([damaged], on_error="skip", columns=("id", "text", "lang"))
    through = drain(first)
    # a loader resumed after seq 25 (as from a planner cursor) gives the same tail
    resumed = loader([damaged], on_error="skip", columns=("id", "text", "lang"))
    resumed.start_at(0, 26)
    tail = [(s.seq, s.key) for s in drain(resumed)]
    assert tail == [(s.seq, s.key) for s in through if s.seq >= 26]
    # deferred samples re-read out of order are the same bytes
    again = resumed.prepare_at(0, [s.seq for s in through[:5]])
    assert [(s.key, s.arrays["input_ids"].tobytes()) for s in again] == [
        (s.key, s.arrays["input_ids"].tobytes()) for s in through[:5]
    ]
    # a seq of the garbled row group is skipped by prepare_at too
    bad = next(
        q
        for q in range(first.epoch_length)
        if first._make_order(0).locate(q).file == 4 and 10 <= first._make_order(0).locate(q).row_in_file < 20
    )
    assert resumed.prepare_at(0, [bad]) == []


def test_partitions_share_the_work_and_count_their_own_row_groups(damaged):
    parts = [
        loader([damaged], partition=p, partitions=2, on_error="skip", columns=("id", "text", "lang")) for p in (0, 1)
    ]
    got = [k for ld in parts for k in keys(drain(ld))]
    assert sorted(got) == sorted(READABLE)
    assert sum(ld.skipped for ld in parts) == 10
    counters = {k.replace("web.0", f"web.{p}"): v for p, ld in enumerate(parts) for k, v in ld.skips.fields().items()}
    files = per_file(counters)
    assert {uri.rsplit("/", 1)[1]: n for (_, uri), n in files.items()} == {
        "1-random.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "2-truncated.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "3-nolang.parquet": {"whole": 1, "groups": 0, "rows": 0},
        "4-garbled.parquet": {"whole": 0, "groups": 1, "rows": 10},
    }


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("1-random", SourceReadError, r"1-random\.parquet' is not a readable Parquet file \(.*magic bytes"),
        ("2-truncated", SourceReadError, r"2-truncated\.parquet' is not a readable Parquet file"),
        ("3-nolang", SchemaError, r"3-nolang\.parquet' has no column\(s\) \['lang'\]"),
    ],
)
def test_raise_names_the_unreadable_file_and_the_fix(damaged, name, error, match):
    path = damaged.replace("*", name)
    with pytest.raises(error, match=rf"source 'web' file '.*{match}") as info:
        loader([path], columns=("id", "text", "lang"))
    assert "on_error: skip" in str(info.value)


def test_raise_names_the_garbled_row_group_and_its_rows(damaged):
    ld = loader([damaged.replace("*", "4-garbled")], columns=("id", "text", "lang"))
    with pytest.raises(
        SourceReadError,
        match=r"4-garbled\.parquet' row group 1 \(rows 10 to 19\) cannot be read "
        r"\(.*\); replace the file.*on_error: skip",
    ):
        drain(ld)


def test_a_bad_block_of_jsonl_lines_is_skipped_and_counted(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"line {i}"}) for i in range(30)]
    lines[12:17] = ["{not json"] * 5
    path.write_text("\n".join(lines) + "\n")
    ld = loader([str(path)], on_error="skip", format="jsonl")
    got = keys(drain(ld))
    assert sorted(got) == sorted(f"web:0:{r}" for r in range(30) if not 12 <= r < 17)
    assert ld.skipped == 5 and ld.skips.fields()[f"skipped_rows:web.0:{path}"] == 5
    with pytest.raises(SourceReadError, match=r"a\.jsonl' row 1[2-6]: line 1[3-7] is not valid JSON"):
        drain(loader([str(path)], format="jsonl"))


def test_an_oversize_sample_is_skipped_or_named_with_the_setting(tmp_path):
    texts = [f"short {i}" for i in range(12)]
    texts[5] = "word " * 40_000  # 40,002 int32 tokens: 160 KB, over a 64 KiB ring
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    limit = ring_max_record(1 << 16)
    src = Source(name="web", paths=(str(path),), shuffle_window=4, on_error="skip")
    ld = SourceLoader(src, 0, seed=1, epochs=1, max_sample_bytes=limit)
    assert sorted(keys(drain(ld))) == sorted(f"web:0:{r}" for r in range(12) if r != 5)
    assert ld.skipped == 1 and ld.skips.fields()[f"skipped_rows:web.0:{path}"] == 1
    ld = SourceLoader(
        Source(name="web", paths=(str(path),), shuffle_window=4), 0, seed=1, epochs=1, max_sample_bytes=limit
    )
    with pytest.raises(
        SourceReadError,
        match=r"a\.parquet' row 5: the sample is \d+ B as a ring record .*"
        r"\(65528 B\); raise Job.sample_ring_bytes",
    ):
        drain(ld)


@pytest.mark.parametrize("epochs", [1, None])
def test_a_source_whose_every_row_is_skipped_ends_with_the_counts(tmp_path, epochs):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.parquet").write_bytes(b"not parquet" * 100)
    write(d / "b.parquet", 20)
    garble_row_group(d / "b.parquet", 0)
    garble_row_group(d / "b.parquet", 1)
    ld = loader([str(d / "*.parquet")], epochs=epochs, on_error="skip")
    with pytest.raises(SourceReadError) as info:
        drain(ld)
    message = str(info.value)
    for words in (
        "source 'web' partition 0 of 1: every row of epoch 0 was skipped",
        "20 row(s) skipped",
        "a.parquet' skipped whole (not a readable Parquet file",
        "b.parquet': 20 row(s) skipped in 2 unreadable row group(s) [0, 1]",
    ):
        assert words in message, (words, message)
    # only whole files skipped: the same, at once (no endless loop over empty epochs)
    only = loader([str(d / "a.parquet")], epochs=epochs, on_error="skip")
    with pytest.raises(
        SourceReadError,
        match=r"every row of epoch 0 was skipped .* 0 row\(s\) skipped; .*a\.parquet' "
        r"skipped whole",
    ):
        only.prepare(9)


@pytest.mark.parametrize("capacity", [1 << 16, (1 << 16) + 1, 3 << 20, 8 << 20])
def test_ring_max_record_is_what_a_real_ring_holds(capacity):
    name = segment_name(f"skips{os.getpid()}", "local", "probe")
    ring = Ring.create(name, capacity)
    try:
        assert ring_max_record(capacity) == ring.max_record
    finally:
        ring.close()
        unlink_segment(name)
