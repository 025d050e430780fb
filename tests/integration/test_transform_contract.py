"""The transform output contract end to end (issue 17): a sidecar's Source Loader
checks what a transform returns; a violation reaches the trainer naming source, file,
row and field, or, under on_error: skip, is counted (Redis, `overlord status`) while
every other row arrives exactly once."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from bad_transforms import is_bad
from harness import assert_delivered

from overlord import BatchSpec, Mesh, Source
from overlord.store import Keys, connect
from overlord.store.server import EmbeddedRedis

pytestmark = pytest.mark.timeout(180)

SMALL = dict(mesh=Mesh(dp=1), batch=BatchSpec(global_batch=8, context_length=256, ring_bytes=1 << 20))


def _rows(files: list[str]) -> dict[str, str]:
    """key -> text of every row of a source's files (keys as the Source Loader makes them)."""
    return {
        f"web:{f}:{row}": t
        for f, path in enumerate(sorted(files))
        for row, t in enumerate(pq.read_table(path, columns=["text"]).column("text").to_pylist())
    }


def test_a_violation_reaches_the_trainer_naming_source_file_row_and_field(cluster, corpus):
    bad = Source(name="web", paths=tuple(corpus["web"]), transform="tests.integration.bad_transforms:fractional_ids")
    c = cluster(sources=(bad,), **SMALL)
    c.start_sidecar()
    c.start_trainers(timeout=30)
    end = c.results(timeout=60)[0]["end"]
    assert end.startswith("RemoteRoleError"), end
    for words in (
        "SourceLoader process 0",
        "SourceReadError",
        "source 'web' file '",
        ".parquet' row ",
        "transform tests.integration.bad_transforms:fractional_ids breaks the contract",
        "field 'input_ids' (dtype float64) holds the fraction",
        "return an integer array",
        "on_error: skip",
    ):
        assert words in end, (words, end)
    assert c.stop() == 1


@pytest.fixture
def redis(tmp_path):
    """A redis-server of the test's own (the job's external Redis): its counters outlive
    the sidecar, which ends with a finite job."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_under_skip_bad_rows_are_counted_and_every_other_row_arrives_once(cluster, corpus, redis):
    rows = _rows(corpus["web"])
    bad_keys = {k for k, t in rows.items() if is_bad(t)}
    assert 10 < len(bad_keys) < len(rows) // 3
    src = Source(
        name="web",
        paths=tuple(corpus["web"]),
        transform="tests.integration.bad_transforms:nan_ids",
        on_error="skip",
        shuffle_window=48,
    )
    c = cluster(sources=(src,), epochs=1, redis_url=redis.url, **SMALL)
    c.start_sidecar()
    c.start_trainers(timeout=30)
    got = c.results(timeout=90)
    assert got[0]["end"] == "stop", f"{got[0]['end']}\n{c.log()}"
    assert_delivered(got, set(rows) - bad_keys, log=c.log)
    # the count reaches the job's counters hash in Redis (what `overlord status` and the metrics show)
    counters = connect(redis.url).hgetall(Keys(c.job.name).counters)
    assert int(counters[b"skipped:web.0"]) == len(bad_keys), counters
    status = subprocess.run(
        [sys.executable, "-m", "overlord.cli", "status", "--config", str(c.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert f"counter skipped:web.0 = {len(bad_keys)}" in status.stdout, status.stdout
    for f, path in enumerate(sorted(corpus["web"])):  # and per file
        n = sum(1 for k in bad_keys if k.startswith(f"web:{f}:"))
        assert f"source 'web' file '{path}': {n} row(s) skipped" in status.stdout, status.stdout
    assert c.stop() == 0
