"""A real job whose sources live on S3 (moto's server over HTTP) as Parquet and JSONL:
every sample of the corpus arrives exactly once, as with local files."""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
from harness import assert_delivered

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_sources_on_s3_as_parquet_and_jsonl_arrive_exactly_once(cluster, corpus, corpus_keys, s3_endpoint, monkeypatch):
    import boto3

    for name, value in dict(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    ).items():
        monkeypatch.setenv(name, value)  # the sidecar and its loader processes inherit them
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    client = boto3.client("s3", endpoint_url=f"http://{s3_endpoint}")
    client.create_bucket(Bucket="corpus")
    for i, path in enumerate(sorted(corpus["web"])):
        client.upload_file(path, "corpus", f"web/data/train-{i:05d}-of-{len(corpus['web']):05d}.parquet")
    for i, path in enumerate(sorted(corpus["code"])):  # the same rows as JSON lines
        lines = [json.dumps(row) for row in pq.read_table(path).to_pylist()]
        client.put_object(Bucket="corpus", Key=f"code/part-{i}.jsonl", Body="\n".join(lines).encode())
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    c0 = cluster()
    remote = {
        "web": dict(paths=(f"s3://corpus/web/data/train-*.parquet{query}",)),
        "code": dict(paths=(f"s3://corpus/code/part-*.jsonl{query}",), format="jsonl"),
    }
    c = cluster(epochs=1, sources=tuple(replace(s, **remote.get(s.name, {})) for s in c0.job.sources))
    c.start_sidecar()
    c.start_trainers()
    results = c.results()
    assert {r["end"] for r in results.values()} == {"stop"}, c.log()
    assert_delivered(results, corpus_keys, log=c.log)
    assert c.stop() == 0
