"""Hugging Face datasets on disk (format: hf): save_to_disk directories, DatasetDict
splits and the HF cache's Arrow files, read memory-mapped with the order, exactly-once
and resume guarantees of Parquet and JSONL; and errors that say what to give instead."""

from __future__ import annotations

import json
import os
import shutil
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from overlord import transforms
from overlord.config import Source
from overlord.errors import ConfigError, SchemaError, SourceReadError
from overlord.loader import formats, hf
from overlord.loader.source_loader import SourceLoader

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(hf, "BLOCK_ROWS", 4)  # several row groups per small record batch
    monkeypatch.setattr(formats, "BLOCK_ROWS", 4)


def records(n, prefix="t"):
    return {"id": list(range(n)), "text": [f"{prefix} {i} " * (i % 5 + 1) for i in range(n)]}


def saved(path, n=37, shards=3, prefix="t"):
    """A Dataset saved with save_to_disk into `path` (state.json, data-0000i-of-0000n.arrow)."""
    datasets.Dataset.from_dict(records(n, prefix)).save_to_disk(str(path), num_shards=shards)
    return str(path)


def loader(paths, *, epochs=1, partition=0, transform=None, **kw):
    kw = {"format": "hf", "shuffle_window": 5, **kw}
    source = Source(name="web", paths=tuple(paths), **kw)
    ld = SourceLoader(source, partition, seed=1, epochs=epochs)
    if transform is not None:
        ld.transform = transform
    return ld


def drain(ld):
    out = []
    while not ld.finished:
        got, _ = ld.prepare(7)
        out += got
    return [(s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in out]


def expected_rows(path):
    """key -> text of every row of a saved dataset, files in state.json's order."""
    state = json.loads(open(os.path.join(path, "state.json")).read())
    out = {}
    for f, entry in enumerate(state["_data_files"]):
        with pa.memory_map(os.path.join(path, entry["filename"])) as m:
            for r, text in enumerate(pa.ipc.open_stream(m).read_all().column("text").to_pylist()):
                out[f"web:{f}:{r}"] = text
    return out


def test_saved_dataset_every_row_once_per_epoch_with_its_bytes(tmp_path):
    path = saved(tmp_path / "ds")
    rows = expected_rows(path)
    assert len(rows) == 37
    got = drain(loader([path], epochs=2))
    for epoch in (0, 1):
        mine = [(k, ids) for e, _, k, ids in got if e == epoch]
        assert sorted(k for k, _ in mine) == sorted(rows), "every row exactly once"
        for key, ids in mine:  # the row the key names, through the source's transform
            assert ids == transforms.text({"text": rows[key]})["input_ids"].tobytes()
    assert [k for e, _, k, _ in got if e == 0] != [k for e, _, k, _ in got if e == 1], "epochs are reshuffled"
    assert got == drain(loader([path], epochs=2)), "the order is a pure function of the seed"


def test_file_order_is_state_json_not_names(tmp_path):
    path = saved(tmp_path / "ds", shards=2)
    state_file = os.path.join(path, "state.json")
    state = json.loads(open(state_file).read())
    state["_data_files"].reverse()  # the dataset's row order, whatever the file names say
    open(state_file, "w").write(json.dumps(state))
    assert [os.path.basename(p) for p in loader([path]).paths] == [
        "data-00001-of-00002.arrow",
        "data-00000-of-00002.arrow",
    ]


def test_a_state_json_that_needs_datasets_to_read_is_refused(tmp_path):
    path = saved(tmp_path / "ds", shards=1)
    state_file = os.path.join(path, "state.json")
    state = json.loads(open(state_file).read())
    open(state_file, "w").write(json.dumps({**state, "_indices_data_files": [{"filename": "indices.arrow"}]}))
    with pytest.raises(SourceReadError, match=r"was saved with an indices mapping .* save it again with datasets >= 2"):
        loader([path])
    os.remove(os.path.join(path, "data-00000-of-00001.arrow"))
    open(state_file, "w").write(json.dumps(state))
    with pytest.raises(SourceReadError, match=r"lacks \['data-00000-of-00001.arrow'\] that its state.json lists"):
        loader([path])


def test_hf_reads_the_same_order_and_bytes_as_the_same_rows_in_jsonl(tmp_path):
    # one record batch of 22 rows, cut into blocks of 4, and 22 JSON lines in blocks of 4:
    # the same row groups, hence the same order and samples
    data = records(22)
    lines = tmp_path / "x.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(data["id"], data["text"])))
    path = saved(tmp_path / "ds", n=22, shards=1)
    assert loader([path]).groups.rows.tolist() == [4, 4, 4, 4, 4, 2]
    assert drain(loader([path], epochs=2)) == drain(loader([str(lines)], format="jsonl", epochs=2))


def test_partitions_split_row_groups_exactly_once(tmp_path):
    path = saved(tmp_path / "ds", n=50)
    keys = [k for p in range(3) for _, _, k, _ in drain(loader([path], partition=p, partitions=3))]
    assert sorted(keys) == sorted(expected_rows(path))


def test_resume_from_a_cursor_reads_the_rest_of_the_order(tmp_path):
    path = saved(tmp_path / "ds", n=40)
    full = drain(loader([path], epochs=2))
    for cut in (0, 13, 39, 40, 55):  # inside epoch 0, its last sample, inside epoch 1
        epoch, seq = full[cut][0], full[cut][1]
        ld = loader([path], epochs=2)
        ld.start_at(epoch, seq + 1)  # the cursor: the last sample the Planner took
        assert drain(ld) == full[cut + 1 :]
    # deferred samples behind a cursor come back byte-identical, and the position stays
    ld = loader([path], epochs=2)
    ld.start_at(1, 5)
    again = ld.prepare_at(0, [full[3][1], full[17][1]])
    assert [(s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in again] == [full[3], full[17]]
    assert drain(ld) == [r for r in full if (r[0], r[1]) >= (1, 5)]


def test_dataset_dict_split_and_the_dict_itself(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(records(12, "train")),
            "test": datasets.Dataset.from_dict(records(5, "test")),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    got = drain(loader([str(tmp_path / "dd" / "test")]))
    assert sorted(k for *_, k, _ in got) == [f"web:0:{r}" for r in range(5)]
    with pytest.raises(
        SourceReadError,
        match=r"'.*dd' is a DatasetDict with splits \['train', 'test'\]; point "
        r"Source.paths at one split, e.g. '.*dd/train'",
    ):
        loader([str(tmp_path / "dd")])


def cached(tmp_path, n=30):
    """A dataset load_dataset built from a local JSON-lines file into a fresh cache:
    (its rows, the cache directory holding dataset_info.json and json-train.arrow)."""
    data = records(n, "cached")
    lines = tmp_path / "src.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(data["id"], data["text"])))
    ds = datasets.load_dataset(
        "json", data_files={"train": str(lines)}, cache_dir=str(tmp_path / "cache"), split="train"
    )
    (arrow,) = [f["filename"] for f in ds.cache_files]
    return data, os.path.dirname(arrow), arrow


def test_hf_cache_split_and_cache_files(tmp_path):
    data, directory, arrow = cached(tmp_path)
    assert os.path.basename(arrow) == "json-train.arrow" and os.path.isfile(
        os.path.join(directory, "dataset_info.json")
    )
    by_split = drain(loader([os.path.join(directory, "train")]))
    assert loader([os.path.join(directory, "train")]).paths == [arrow]
    assert by_split == drain(loader([arrow]))  # ds.cache_files, as given
    assert sorted(k for *_, k, _ in by_split) == sorted(f"web:0:{r}" for r in range(30))
    with pytest.raises(
        SourceReadError,
        match=r"is a cached dataset with splits \['train'\]; point Source.paths at one split, e\.g\. '.*/train'",
    ):
        loader([directory])
    with pytest.raises(SourceReadError, match=r"has no split 'validation'; its splits are \['train'\]"):
        loader([os.path.join(directory, "validation")])


def test_hf_cache_shards_read_in_shard_order(tmp_path):
    # a cache split written in shards: <name>-train-0000i-of-0000n.arrow (the shard index
    # is the dataset's order; numbered past 9 to show it is not the names' order)
    _, directory, arrow = cached(tmp_path, n=24)
    table = pa.ipc.open_stream(pa.memory_map(arrow)).read_all()
    shards = tmp_path / "sharded"
    shards.mkdir()
    shutil.copy(os.path.join(directory, "dataset_info.json"), shards)
    n = 12
    for i in range(n):
        with pa.ipc.new_stream(str(shards / f"json-train-{i:05d}-of-{n:05d}.arrow"), table.schema) as out:
            out.write_table(table.slice(2 * i, 2))
    ld = loader([str(shards / "train")])
    assert [os.path.basename(p) for p in ld.paths] == [f"json-train-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
    texts = [r["text"] for f in range(n) for r in [ld._open(f).read_group(0, None).row(k) for k in (0, 1)]]
    assert texts == table.column("text").to_pylist()
    os.remove(shards / "json-train-00003-of-00012.arrow")
    with pytest.raises(SourceReadError, match=r"split 'train' in .* should be one <name>-train.arrow or every shard"):
        loader([str(shards / "train")])


def test_memory_mapped_reading_allocates_no_row_groups(tmp_path):
    big = {"id": list(range(4000)), "text": ["x" * 500 + str(i) for i in range(4000)]}  # 2 MB of text
    datasets.Dataset.from_dict(big).save_to_disk(str(tmp_path / "ds"))
    ld = loader([str(tmp_path / "ds")], transform=lambda row: {"input_ids": np.zeros(1, np.int32)})
    before = pa.total_allocated_bytes()
    n = len(drain(ld))
    assert n == 4000
    deadline = time.monotonic() + 5  # Arrow may free a buffer a moment later, on its own threads
    while pa.total_allocated_bytes() - before >= 64 << 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pa.total_allocated_bytes() - before < 64 << 10, "row groups are slices of the map, not copies"
    assert 0 < ld.format.nbytes < 64 << 10, "what stays is an index of O(row groups) integers"


def test_index_outlives_the_open_file_lru(tmp_path, monkeypatch):
    path = saved(tmp_path / "ds", n=30, shards=3)
    scans = []
    index = hf._Index
    monkeypatch.setattr(hf, "_Index", lambda *a: scans.append(1) or index(*a))
    drain(loader([path], epochs=2))
    assert len(scans) == 3, "each file is scanned once, however often the LRU reopens it"


def test_columns_are_checked_and_selected(tmp_path):
    path = saved(tmp_path / "ds", n=8)
    seen = []
    drain(
        loader(
            [path], columns=("text",), transform=lambda row: seen.append(row) or {"input_ids": np.zeros(1, np.int32)}
        )
    )
    assert {tuple(r) for r in seen} == {("text",)} and len(seen) == 8
    with pytest.raises(
        SchemaError, match=r"data-00000-of-00003\.arrow' has no column\(s\) \['caption'\]; it has \['id', 'text'\]"
    ):
        loader([path], columns=("text", "caption"))


def test_curriculum_orders_row_groups_by_a_numeric_column(tmp_path):
    n = 20
    data = {"level": [(i * 7) % n for i in range(n)], "text": [f"t{i}" for i in range(n)]}
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "ds"))
    ld = loader([str(tmp_path / "ds")], difficulty="level", shuffle_window=1)
    levels = []
    ld.transform = lambda row: levels.append(row["level"]) or {"input_ids": np.zeros(1, np.int32)}
    drain(ld)
    mids = [(min(g) + max(g)) / 2 for g in (levels[i : i + 4] for i in range(0, n, 4))]
    assert mids == sorted(mids) and sorted(levels) == sorted(data["level"])
    with pytest.raises(SchemaError, match="difficulty column 'text' is string, not numeric"):
        loader([str(tmp_path / "ds")], difficulty="text")


# -- errors ------------------------------------------------------------------------------


def test_files_that_are_not_a_dataset_s_arrow_stream(tmp_path):
    good = saved(tmp_path / "ds", n=8, shards=1)
    text = tmp_path / "notes.arrow"
    text.write_text("these are notes, not Arrow\n" * 20)
    feather.write_feather(pa.table({"text": ["a"]}), tmp_path / "table.arrow")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "table.parquet")
    cases = {
        str(
            text
        ): r"is not a readable Hugging Face datasets \(Arrow stream\) file \(it is not the Arrow stream datasets writes",
        str(
            tmp_path / "table.arrow"
        ): r"\(it is an Arrow IPC file \(Feather v2\), not the Arrow stream datasets writes",
        str(tmp_path / "table.parquet"): r"\(it is a Parquet file: give it to a source with format: parquet\)",
        os.path.join(good, "state.json"): r"\(it is JSON text: for a save_to_disk directory give the directory",
    }
    for path, message in cases.items():
        with pytest.raises(
            SourceReadError, match=rf"source 'web' file '{path}' {message}" if message.startswith("is") else message
        ):
            loader([good, path])


def test_paths_that_name_no_dataset(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceReadError, match=r"directory '.*empty' is not a datasets directory \(no state.json"):
        loader([str(tmp_path / "empty")])
    with pytest.raises(SourceReadError, match=r"path '.*nothing' matches no file; give a directory save_to_disk wrote"):
        loader([str(tmp_path / "nothing")])
    with pytest.raises(
        SourceReadError, match=r"is a URI, and format 'hf' memory-maps local files; .* \(ds.to_parquet\)"
    ):
        loader(["s3://bucket/ds/data-00000-of-00001.arrow"])


def test_a_dataset_given_to_another_format_says_set_format_hf(tmp_path):
    path = saved(tmp_path / "ds", n=4, shards=1)
    with pytest.raises(
        SourceReadError,
        match=r"'.*ds' is a Hugging Face datasets directory, and the source's format is 'parquet'; set format: hf",
    ):
        loader([path], format="parquet")
    with pytest.raises(
        SourceReadError,
        match=r"is a Hugging Face datasets Arrow file, and the source's format is 'jsonl'; set format: hf",
    ):
        loader([os.path.join(path, "*.arrow")], format="jsonl")
    assert Source(name="web", paths=(path,), format="hf").files() == [os.path.join(path, "data-00000-of-00001.arrow")]


def test_a_dataset_object_as_paths_says_how_to_give_its_files(tmp_path):
    path = saved(tmp_path / "ds", n=4, shards=1)
    ds = datasets.load_from_disk(path)
    for given in (ds, [ds]):
        with pytest.raises(
            ConfigError,
            match=r"source 'web': Source.paths is a datasets.Dataset object; .* "
            r"ds.save_to_disk\('/data/x'\) with Source\(format='hf', .*ds.cache_files \(\['.*data-00000-of-00001.arrow'\]",
        ):
            Source(name="web", paths=given, format="hf")
    with pytest.raises(ConfigError, match=r"in memory: it has no files yet"):
        Source(name="web", paths=datasets.Dataset.from_dict(records(3)), format="hf")
    with pytest.raises(
        ConfigError,
        match=r"a datasets.DatasetDict object; .* give one split: Source\(format='hf', paths=\('/data/x/train',\)\)",
    ):
        Source(name="web", paths=datasets.DatasetDict({"train": ds}), format="hf")
