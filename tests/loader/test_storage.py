"""Sources on pyarrow.fs filesystems: Hugging Face-style shards locally and as file://
URIs, and a real S3 endpoint (moto's standalone server, over HTTP on localhost)."""

from __future__ import annotations

import json
import logging
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import Source
from overlord.errors import SourceReadError
from overlord.loader import formats
from overlord.loader.source_loader import SourceLoader

BUCKET = "corpus"


def hf_shards(root, n=4, rows=11, split="train"):
    """`data/train-0000i-of-0000n.parquet`, as Hugging Face datasets lay Parquet out."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        table = pa.table({"id": list(range(rows)), "text": [f"{split} {i}/{r} " * (r % 4 + 1) for r in range(rows)]})
        pq.write_table(table, root / "data" / f"{split}-{i:05d}-of-{n:05d}.parquet", row_group_size=4)


def jsonl_shards(root, n=2, rows=9):
    (root / "jsonl").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        lines = [json.dumps({"text": f"line {i}/{r} " * (r % 3 + 1)}) for r in range(rows)]
        (root / "jsonl" / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")


def loader(*paths, format="parquet", **kw):
    return SourceLoader(Source(name="web", paths=paths, format=format, shuffle_window=6, **kw), 0, seed=3, epochs=2)


def drain(ld):
    out = []
    while not ld.finished:
        got, _ = ld.prepare(8)
        out += got
    return [(s.epoch, s.seq, s.key, s.arrays["input_ids"].tobytes()) for s in out]


def test_hf_shard_glob_locally_and_as_file_uri(tmp_path):
    hf_shards(tmp_path)
    hf_shards(tmp_path, n=1, split="validation")  # beside the train split, not matched
    local = loader(str(tmp_path / "data/train-*.parquet"))
    assert [p.rsplit("/", 1)[1] for p in local.paths] == [f"train-{i:05d}-of-00004.parquet" for i in range(4)]
    got = drain(local)
    assert {k for e, _, k, _ in got if e == 0} == {f"web:{f}:{r}" for f in range(4) for r in range(11)}
    uri = loader(f"file://{tmp_path}/data/train-*.parquet")
    assert uri.paths == [f"file://{p}" for p in local.paths]
    assert drain(uri) == got


def test_uri_wildcards_match_one_component_each(tmp_path):
    for split in ("a", "b"):
        hf_shards(tmp_path / split, n=2, rows=3)
    (tmp_path / "a/data/nested").mkdir()
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "a/data/nested/train-9.parquet")
    ld = loader(f"file://{tmp_path}/*/data/train-*.parquet")
    assert ld.paths == [f"file://{tmp_path}/{s}/data/train-{i:05d}-of-00002.parquet" for s in "ab" for i in range(2)]
    with pytest.raises(SourceReadError, match=r"source 'web': URI 'file://.*/data/test-\*\.parquet' matches no file"):
        loader(f"file://{tmp_path}/a/data/test-*.parquet")


# -- a real S3 endpoint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on a free port, with HF Parquet shards and JSONL shards uploaded
    (by boto3: another client than the one under test). Yields (endpoint, local root)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    root = tmp_path_factory.mktemp("s3-data")
    hf_shards(root)
    jsonl_shards(root)
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(root.rglob("*.*")):
        client.upload_file(str(path), BUCKET, str(path.relative_to(root)))
    yield endpoint, root
    server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    """Credentials from the standard environment; no endpoint (each test chooses how)."""
    for name, value in dict(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


def test_s3_parquet_shards_arrive_exactly_once_in_the_local_order(s3, aws_env):
    endpoint, root = s3
    host = endpoint.removeprefix("http://")
    remote = loader(f"s3://{BUCKET}/data/train-*.parquet?endpoint_override={host}&scheme=http")
    assert remote.paths == [f"s3://{BUCKET}/data/train-{i:05d}-of-00004.parquet" for i in range(4)]
    got = drain(remote)
    assert got == drain(loader(str(root / "data/train-*.parquet")))
    for epoch in (0, 1):
        keys = [k for e, _, k, _ in got if e == epoch]
        assert len(keys) == 44 and set(keys) == {f"web:{f}:{r}" for f in range(4) for r in range(11)}


def test_s3_jsonl_with_the_endpoint_from_the_environment(s3, aws_env, monkeypatch):
    endpoint, root = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setattr(formats, "BLOCK_ROWS", 4)  # ranged reads of several blocks per object
    remote = loader(f"s3://{BUCKET}/jsonl/part-*.jsonl", format="jsonl", partitions=2)
    assert remote.groups.rows.tolist() == [4, 4, 1, 4, 4, 1]
    assert drain(remote) == drain(loader(str(root / "jsonl/part-*.jsonl"), format="jsonl", partitions=2))


def test_s3_missing_object_bucket_and_vanished_file_say_what_to_change(s3, aws_env, monkeypatch):
    endpoint, _ = s3
    host = endpoint.removeprefix("http://")
    with pytest.raises(
        SourceReadError,
        match=rf"source 'web': URI 's3://{BUCKET}/data/nope\.parquet\?endpoint_override=.*' matches no file; fix Source\.paths or upload",
    ):
        loader(f"s3://{BUCKET}/data/nope.parquet?endpoint_override={host}&scheme=http")
    with pytest.raises(
        SourceReadError,
        match=r"source 'web': cannot list 's3://testing:\*\*\*@no-such-bucket/data/\*\.parquet.*NO_SUCH_BUCKET.*check the bucket and key, the credentials",
    ) as err:
        loader(f"s3://testing:sekrit@no-such-bucket/data/*.parquet?endpoint_override={host}&scheme=http")
    assert "sekrit" not in str(err.value)
    # an object deleted after the loader listed it
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.copy_object(Bucket=BUCKET, Key="gone/a.parquet", CopySource=f"{BUCKET}/data/train-00000-of-00004.parquet")
    client.copy_object(Bucket=BUCKET, Key="gone/b.parquet", CopySource=f"{BUCKET}/data/train-00001-of-00004.parquet")
    ld = loader(f"s3://{BUCKET}/gone/*.parquet")
    client.delete_object(Bucket=BUCKET, Key="gone/b.parquet")
    ld._files.clear()  # as if the LRU had closed it
    with pytest.raises(SourceReadError, match=rf"source 'web' file 's3://{BUCKET}/gone/b\.parquet' is missing"):
        drain(ld)


def test_a_chunks_rows_are_the_python_values_of_its_table_for_every_arrow_type():
    """ArrowChunk.row reads a value per column (faster than a one-row slice): the same
    values as pyarrow's to_pylist, for nested, dictionary, temporal and null values, over
    a table of several chunks and over a record batch (a mapped Arrow file's rows)."""
    from overlord.loader.storage import ArrowChunk

    table = pa.table(
        {
            "i": pa.array([1, None, 3], pa.int64()),
            "f": pa.array([0.5, float("nan"), None], pa.float32()),
            "s": pa.array(["a", None, "ç"]),
            "b": pa.array([b"\x00\xff", b"", None], pa.binary()),
            "l": pa.array([[1, 2], None, []], pa.list_(pa.int32())),
            "st": pa.array([{"x": 1, "y": "u"}, None, {"x": None, "y": "v"}]),
            "d": pa.array(["p", "q", "p"]).dictionary_encode(),
            "t": pa.array([0, 1_700_000_000_000_000, None], pa.timestamp("us")),
        }
    )
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1, 2)])
    assert chunked.column("i").num_chunks == 2
    for data in (table, chunked, table.to_batches()[0]):
        chunk = ArrowChunk(data)
        want = data.to_pylist()
        got = [chunk.row(i) for i in range(data.num_rows)]
        assert [list(r) for r in got] == [list(r) for r in want]  # the columns' order too
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for k in w:
                same = g[k] == w[k] or (g[k] != g[k] and w[k] != w[k])  # NaN is NaN
                assert same and type(g[k]) is type(w[k]), (k, g[k], w[k])
