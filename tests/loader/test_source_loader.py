"""A Source Loader over real Parquet files: order, epochs, and bad input."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import Source
from overlord.errors import SchemaError, SourceReadError
from overlord.loader.source_loader import SourceLoader


def write(path, texts, row_group_size=4):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=row_group_size)
    return str(path)


def loader(paths, *, epochs=1, **kw):
    return SourceLoader(Source(name="web", paths=tuple(paths), shuffle_window=5, **kw), 0, seed=1, epochs=epochs)


def drain(ld, limit=10_000):
    out = []
    while not ld.finished:
        got, _ = ld.prepare(7)
        out += got
        assert len(out) < limit
    return out


def test_each_epoch_is_a_permutation_and_epochs_differ(tmp_path):
    a = write(tmp_path / "a.parquet", [f"a {i}" for i in range(13)])
    b = write(tmp_path / "b.parquet", [f"b {i}" for i in range(9)])
    samples = drain(loader([a, b], epochs=2))
    by_epoch = [[s.key for s in samples if s.epoch == e] for e in (0, 1)]
    expected = {f"web:0:{r}" for r in range(13)} | {f"web:1:{r}" for r in range(9)}
    assert set(by_epoch[0]) == set(by_epoch[1]) == expected
    assert len(by_epoch[0]) == len(expected) and by_epoch[0] != by_epoch[1]
    # and the same again from a fresh loader
    assert [s.key for s in drain(loader([a, b], epochs=2))] == [s.key for s in samples]


def test_missing_path_names_it(tmp_path):
    with pytest.raises(SourceReadError, match="nothing-here.*matches no file"):
        loader([str(tmp_path / "nothing-here.parquet")])


def test_corrupt_file_names_file(tmp_path):
    good = write(tmp_path / "a.parquet", ["x"] * 4)
    bad = tmp_path / "b.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all PAR1")
    with pytest.raises(SourceReadError, match=r"source 'web' file '.*b\.parquet' is not a readable Parquet file"):
        loader([good, str(bad)])


def test_missing_column_names_column_and_file(tmp_path):
    path = write(tmp_path / "a.parquet", ["x"] * 4)
    with pytest.raises(SchemaError, match=r"a\.parquet' has no column\(s\) \['caption'\]"):
        loader([path], columns=("text", "caption"))


def test_transform_error_names_source_file_and_row(tmp_path):
    texts = ["fine"] * 10
    texts[6] = None  # row 6 of the file has no text
    path = write(tmp_path / "a.parquet", texts)
    with pytest.raises(
        SourceReadError,
        match=r"source 'web' file '.*a\.parquet' row 6: transform overlord.transforms:text raised TypeError",
    ):
        drain(loader([path]))


def test_skip_policy_drops_and_counts(tmp_path):
    texts = [f"t{i}" for i in range(20)]
    for bad in (3, 11, 17):
        texts[bad] = None
    path = write(tmp_path / "a.parquet", texts)
    ld = loader([path], on_error="skip")
    keys = {s.key for s in drain(ld)}
    assert ld.skipped == 3
    assert keys == {f"web:0:{r}" for r in range(20) if r not in (3, 11, 17)}


def test_file_removed_after_start_names_file(tmp_path):
    path = write(tmp_path / "a.parquet", ["x"] * 40, row_group_size=4)
    other = write(tmp_path / "b.parquet", ["y"] * 40, row_group_size=4)
    ld = loader([path, other])
    (tmp_path / "b.parquet").unlink()
    ld._files.clear()  # as if the handle had been evicted from the LRU
    with pytest.raises(SourceReadError, match=r"b\.parquet' is missing"):
        drain(ld)


def test_curriculum_reads_row_groups_easy_to_hard(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    # each row group of 4 rows holds one difficulty level, the groups stored out of order
    levels = rng.permutation(10)
    path = str(tmp_path / "c.parquet")
    pq.write_table(
        pa.table(
            {"text": [f"t{i}" for i in range(40)], "difficulty": [float(level) for level in np.repeat(levels, 4)]}
        ),
        path,
        row_group_size=4,
    )
    ld = SourceLoader(Source(name="web", paths=(path,), shuffle_window=4, difficulty="difficulty"), 0, seed=1, epochs=1)
    rows = [int(s.key.rsplit(":", 1)[1]) for s in drain(ld)]
    seen = [levels[r // 4] for r in rows]
    assert seen == sorted(seen) and sorted(rows) == list(range(40))
    assert rows != sorted(rows, key=lambda r: (levels[r // 4], r))  # still shuffled inside each window


def test_curriculum_without_the_column_names_it(tmp_path):
    path = write(tmp_path / "a.parquet", ["x"] * 4)
    with pytest.raises(SchemaError, match="no difficulty column 'level'"):
        loader([path], difficulty="level")


def test_start_at_and_prepare_at_give_the_same_samples_as_reading_through(tmp_path):
    import numpy as np

    a = write(tmp_path / "a.parquet", [f"a {i} " * (i % 7 + 1) for i in range(30)])
    through = drain(loader([a], epochs=2))
    by_pos = {(s.epoch, s.seq): s for s in through}
    resumed = loader([a], epochs=2)
    resumed.start_at(0, 17)
    again = drain(resumed)
    assert [(s.epoch, s.seq, s.key) for s in again] == [
        (s.epoch, s.seq, s.key) for s in through if (s.epoch, s.seq) >= (0, 17)
    ]
    for s in resumed.prepare_at(0, [3, 9]):
        ref = by_pos[(0, s.seq)]
        assert s.key == ref.key and np.array_equal(s.arrays["input_ids"], ref.arrays["input_ids"])


def test_worker_threads_change_neither_samples_nor_order_even_when_resized(tmp_path):
    texts = [f"t{i}" * (i % 7 + 1) if i % 9 else None for i in range(60)]
    path = write(tmp_path / "a.parquet", texts)
    reference = [
        (s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes())
        for s in drain(loader([path], epochs=2, on_error="skip"))
    ]
    ld = loader([path], epochs=2, on_error="skip")
    threads, transform = set(), ld.transform

    def recording(row):
        import threading

        threads.add(threading.get_ident())
        return transform(row)

    ld.transform = recording
    got, step = [], 0
    while not ld.finished:
        ld.set_workers([1, 4, 2, 3][step % 4])  # scaled up and down between calls, as the Planner may
        batch, _ = ld.prepare(7)
        got += [(s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in batch]
        step += 1
    ld.close()
    assert got == reference
    assert len(threads) > 1, "the transforms ran on worker threads"
    assert ld.skipped == 2 * sum(t is None for t in texts)
    assert ld.profile.samples == len(reference) and ld.profile.seconds > 0


def test_a_window_holds_only_its_own_rows_and_reads_the_same_samples(tmp_path):
    # row groups of 10 rows, windows of 4: a window straddles two row groups every so
    # often, and reads only part of each; the loader holds that part, not both groups
    import numpy as np

    from overlord import transforms
    from overlord.loader.order import EpochOrder

    texts = [f"row {i} " + "x" * 990 for i in range(50)]  # about 1 KB each
    path = write(tmp_path / "a.parquet", texts, row_group_size=10)
    ld = SourceLoader(Source(name="web", paths=(path,), shuffle_window=4), 0, seed=3, epochs=1)
    got, held = [], 0
    while not ld.finished:
        batch, _ = ld.prepare(1)
        got += batch
        held = max(held, ld.state_bytes() - ld.format.nbytes - sum(f.nbytes for f in ld._files.values()))
    order = EpochOrder(ld.groups, seed=3, source="web", epoch=0, partition=0, partitions=1, shuffle_window=4)
    rows = [order.locate(q).row_in_file for q in range(50)]
    assert sorted(rows) == list(range(50))  # exactly once
    assert [s.key for s in got] == [f"web:0:{r}" for r in rows]  # in the order's order
    for s, r in zip(got, rows):  # each sample is its row's
        assert np.array_equal(s.arrays["input_ids"], transforms.text({"text": texts[r]})["input_ids"])
    assert 0 < held <= 4 * 1100  # one window's rows (was: every row group it overlaps, 10 to 20 rows)


def test_a_compressed_jsonl_file_is_read_once_an_epoch(tmp_path, monkeypatch):
    # its one block is the whole file, decompressed at each read: kept whole while the
    # windows read it, never read again for each window
    import gzip
    import json

    from overlord.loader import formats

    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps({"text": f"t {i}"}).encode() + b"\n" for i in range(40))))
    reads = []
    real = formats.JsonlFile.read_group

    def counting(self, group, columns):
        reads.append(group)
        return real(self, group, columns)

    monkeypatch.setattr(formats.JsonlFile, "read_group", counting)
    got = drain(loader([str(path)], format="jsonl", epochs=2))
    assert sorted(s.key for s in got) == sorted(f"web:0:{r}" for r in range(40) for _ in range(2))
    assert reads == [0, 0]
