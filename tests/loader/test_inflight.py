"""The in-flight table of a loader process (overlord/loader/inflight.py): what each
transform thread is on, readable by the process's deadline thread and, after the
process died, by the sidecar."""

from __future__ import annotations

import os
import stat
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import Job, Source
from overlord.errors import ConfigError
from overlord.loader.inflight import SLOTS, Deadline, Inflight, inflight_path, last_samples
from overlord.loader.source_loader import SourceLoader
from overlord.transforms import text

STREAMS = [("web", ["/d/a.parquet", "/d/b.parquet"]), ("code", ["/d/c.jsonl"])]


def test_a_slot_names_its_sample_while_in_a_transform_and_is_idle_after(tmp_path):
    table = Inflight(tmp_path / "t.bin", STREAMS)
    assert stat.S_IMODE(os.stat(tmp_path / "t.bin").st_mode) == 0o600
    slot = table.enter(0, 1, 7)
    [(start, stream, file, row, rows, ident)] = table.busy()
    assert (stream, file, row, rows, ident) == (0, 1, 7, 1, threading.get_ident())
    assert 0 < time.monotonic() - start < 5
    [(what, key, _)] = last_samples(tmp_path / "t.bin")
    assert (what, key) == ("source 'web' file '/d/b.parquet' row 7", (0, 1, 7))
    table.leave(slot)
    assert table.busy() == [] and last_samples(tmp_path / "t.bin") == []
    table.close()
    assert not (tmp_path / "t.bin").exists()


def test_each_thread_has_its_own_slot_and_dead_threads_give_theirs_back(tmp_path):
    table = Inflight(tmp_path / "t.bin", STREAMS)
    entered, release = threading.Barrier(4), threading.Event()

    def work(k):
        slot = table.enter(1, 0, k, rows=k + 1)
        entered.wait(timeout=10)
        release.wait(timeout=10)
        table.leave(slot)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    entered.wait(timeout=10)
    assert sorted((row, rows) for _, _, _, row, rows, _ in table.busy()) == [(0, 1), (1, 2), (2, 3)]
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert table.busy() == []
    for _ in range(SLOTS + 5):  # many short-lived threads (pools resized): slots are reused
        t = threading.Thread(target=lambda: table.leave(table.enter(0, 0, 0)))
        t.start()
        t.join(timeout=10)
    assert len(table._slots) == len(set(table._slots.values())) <= 4  # bounded, one slot per thread
    table.close()


def test_the_sidecar_reads_the_sample_a_killed_process_was_on(tmp_path):
    pid = os.fork()
    if pid == 0:  # the child: in a transform when it dies
        try:
            table = Inflight(inflight_path(tmp_path, os.getpid()), STREAMS)
            table.enter(0, 0, 3)
            table.enter(1, 0, 10, rows=32)  # (same thread: the batch replaces the row)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    [(what, key, _)] = last_samples(inflight_path(tmp_path, pid))
    assert what == "source 'code' file '/d/c.jsonl' a batch of 32 rows from row 10" and key == (1, 0, 10)
    assert last_samples(tmp_path / "inflight-1.bin") == []  # no table: nothing to say
    (tmp_path / "junk.bin").write_bytes(b"not a table")
    assert last_samples(tmp_path / "junk.bin") == []


def test_the_deadline_names_the_overdue_sample_and_where_its_transform_is(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(6)]}), path, row_group_size=3)
    streams = [("code", ["/d/c.jsonl"]), ("web", [str(path)])]
    table, stuck, fired = Inflight(tmp_path / "t.bin", streams), threading.Event(), []
    ld = SourceLoader(Source(name="web", paths=(str(path),), shuffle_window=1), 0, seed=1, epochs=1)
    ld.inflight, ld.stream_id = table, 1

    def stuck_transform(row):
        if row["text"] == "row 4":
            stuck.wait(timeout=10)
        return text(row)

    ld.transform = stuck_transform
    worker = threading.Thread(target=ld.prepare, args=(6,))
    worker.start()
    deadline = Deadline(table, streams, [0.05, 0.3], ["m:code", "m:web"], fired.append)
    watcher = threading.Thread(target=deadline.run, args=(threading.Event(),))
    watcher.start()
    watcher.join(timeout=10)
    stuck.set()
    worker.join(timeout=10)
    [message] = fired
    assert message.startswith(f"source 'web' file '{path}' row 4: transform m:web has run for "), message
    assert "past the per-sample deadline Source.transform_timeout_s=0.3s" in message
    assert "test_inflight.py:" in message and "in stuck_transform)" in message, message  # where it is stuck
    assert "raise Source.transform_timeout_s" in message and "on_error: skip does not skip a hang" in message
    assert table.busy() == []
    table.close()


def test_a_source_loader_records_each_sample_it_transforms(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(6)]}), path, row_group_size=3)
    table, seen = Inflight(tmp_path / "t.bin", [("web", [str(path)])]), []
    ld = SourceLoader(Source(name="web", paths=(str(path),), shuffle_window=1), 0, seed=1, epochs=1)
    ld.inflight = table

    def watching(row):
        [(_, stream, file, r, rows, _)] = table.busy()
        seen.append((stream, file, r, rows))
        return text(row)

    ld.transform = watching
    samples, _ = ld.prepare(6)
    assert sorted(seen) == [(0, 0, r, 1) for r in range(6)]
    assert [s.key for s in samples] == [f"web:0:{r}" for _, _, r, _ in seen]  # in the order transformed
    assert table.busy() == []
    table.close()


def test_transform_timeout_is_validated_and_defaults_to_half_the_job_timeout():
    src = Source(name="web", paths=("x",))
    assert Job(name="j", sources=(src,), timeout_s=20.0).transform_deadline(src) == 10.0
    quick = Source(name="web", paths=("x",), transform_timeout_s=2)
    assert Job(name="j", sources=(quick,)).transform_deadline(quick) == 2
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises(ConfigError, match="Source.transform_timeout_s=.* must be a number of seconds > 0"):
            Source(name="web", paths=("x",), transform_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"source\(s\) \['web'\] is not below Job.timeout_s=60.*raise Job.timeout_s"):
        Job(name="j", sources=(Source(name="web", paths=("x",), transform_timeout_s=60),))
