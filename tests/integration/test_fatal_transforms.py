"""A transform that hangs on a row, or ends its loader process there, reaches the
trainer as an error naming source, file and row (issue 17), in bounded time: a hang
past Source.transform_timeout_s (the loader's deadline thread), a death by os._exit or
SIGKILL (the sidecar reads the dead process's in-flight table, and does not restart a
loader that died twice on the same row)."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from overlord import BatchSpec, Mesh, Source
from overlord.store import Keys, connect
from overlord.store.server import EmbeddedRedis

pytestmark = pytest.mark.timeout(120)

SMALL = dict(mesh=Mesh(dp=1), batch=BatchSpec(global_batch=8, context_length=256, ring_bytes=1 << 20))
FILE, ROW = 1, 5  # the row the transforms break on: web's second file, row 5


def _target(corpus) -> tuple[str, str]:
    path = sorted(corpus["web"])[FILE]
    return path, pq.read_table(path, columns=["text"]).column("text")[ROW].as_py()


def _run(cluster, corpus, factory: str, **source_args):
    path, text = _target(corpus)
    src = Source(
        name="web",
        paths=tuple(corpus["web"]),
        transform=f"tests.integration.fatal_transforms:{factory}",
        transform_args={"text": text},
        shuffle_window=48,
        **source_args,
    )
    c = cluster(sources=(src,), **SMALL)
    c.start_sidecar()
    started = time.monotonic()
    c.start_trainers(timeout=60)
    end = c.results(timeout=90)[0]["end"]
    return c, end, time.monotonic() - started, path


def _names_the_row(end: str, path: str) -> None:
    assert end.startswith("RemoteRoleError"), end
    assert f"source 'web' file '{path}' row {ROW}" in end, end
    assert "hung or dead" not in end, end


def test_a_hung_transform_is_named_within_its_deadline(cluster, corpus):
    c, end, took, path = _run(cluster, corpus, "hang_on", transform_timeout_s=2.0)
    _names_the_row(end, path)
    for words in (
        "SourceLoader process 0",
        "SourceReadError",
        "tests.integration.fatal_transforms:hang_on",
        "past the per-sample deadline Source.transform_timeout_s=2s",
        "fatal_transforms.py:",
        "raise Source.transform_timeout_s",
    ):
        assert words in end, (words, end)
    # the trainer starts (imports torch) and reaches the row within seconds, 6-7 s here in
    # all; a busy 2-core machine takes twice that. The Job.timeout_s path this deadline
    # replaces is caught by its words above ("hung or dead"), not by the clock
    assert took < 2.0 + 30, took
    assert c.stop() == 1


def test_a_hang_is_named_under_skip_too(cluster, corpus):
    c, end, _, path = _run(cluster, corpus, "hang_on", transform_timeout_s=1.0, on_error="skip")
    _names_the_row(end, path)
    assert "on_error: skip does not skip a hang" in end, end
    assert c.stop() == 1


def test_a_transform_that_exits_names_its_row_and_status(cluster, corpus):
    c, end, took, path = _run(cluster, corpus, "exit_on")
    _names_the_row(end, path)
    assert "loader0 (pid " in end and "died with status 3 while transforming" in end, end
    assert took < 30, took
    assert c.stop() == 1


@pytest.fixture
def redis(tmp_path):
    """A redis-server of the test's own: the restart count outlives the sidecar."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_transform_killed_by_a_signal_is_restarted_once_then_named(cluster, corpus, redis):
    path, text = _target(corpus)
    src = Source(
        name="web",
        paths=tuple(corpus["web"]),
        transform="tests.integration.fatal_transforms:kill_on",
        transform_args={"text": text},
        shuffle_window=48,
    )
    c = cluster(sources=(src,), redis_url=redis.url, **SMALL)
    c.start_sidecar()
    started = time.monotonic()
    c.start_trainers(timeout=60)
    end = c.results(timeout=90)[0]["end"]
    _names_the_row(end, path)
    assert "died by signal 9 (SIGKILL) while transforming" in end, end
    assert "twice in a row (not restarted again)" in end, end
    assert time.monotonic() - started < 40
    r = connect(redis.url)
    [record] = [json.loads(raw) for raw in r.lrange(Keys(c.job.name).errors, 0, -1)]  # what other nodes read
    assert record["type"] == "LoaderDied" and record["role"] == "loader" and record["message"] in end, record
    restarts = r.hgetall(Keys(c.job.name).restarts)
    assert {k: int(v) for k, v in restarts.items()} == {b"loader0": 1}, restarts  # not 10 blind restarts
    assert c.stop() == 1
    assert not list(c.job.run_path.glob("inflight-*")), "the sidecar removes a dead loader's table"


def test_a_shadowed_loader_that_dies_on_a_row_fails_once_its_shadow_dies_there_too(cluster, corpus):
    path, text = _target(corpus)
    src = Source(
        name="web",
        paths=tuple(corpus["web"]),
        transform="tests.integration.fatal_transforms:kill_on",
        transform_args={"text": text},
        shuffle_window=48,
        shadow=True,
    )
    c = cluster(sources=(src,), **SMALL)
    c.start_sidecar()
    c.start_trainers(timeout=60)
    end = c.results(timeout=90)[0]["end"]
    _names_the_row(end, path)
    assert "died by signal 9 (SIGKILL) while transforming" in end and "twice in a row" in end, end
    assert c.stop() == 1
