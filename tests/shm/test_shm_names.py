"""Segment names, listing, and removal of segments left by dead processes."""

from __future__ import annotations

import os
import signal
import time

import posix_ipc
import pytest

from overlord.shm import Ring, cleanup_stale, job_prefix, list_segments, segment_name, unlink_all
from overlord.shm.names import GARBAGE_AGE_S


def test_segment_name_is_sanitised_and_prefixed():
    assert segment_name("job1", "node-a", "client_3") == "/ovl.job1.node-a.client_3"
    name = segment_name("my job", "host.example.com", "ctor/dp0")
    assert name.startswith(job_prefix("my job"))
    assert all(c.isalnum() or c in "_-." for c in name[1:])
    assert name.count(".") == 3  # exactly the three separators


def test_names_that_sanitise_alike_stay_distinct():
    assert segment_name("a.b", "n", "o") != segment_name("a_b", "n", "o")
    assert not segment_name("a_b", "n", "o").startswith(job_prefix("a.b"))


def test_long_names_are_bounded_and_unique():
    a = segment_name("j" * 500, "n" * 500, "o" * 499 + "a")
    b = segment_name("j" * 500, "n" * 500, "o" * 499 + "b")
    assert len(a) <= 200 and len(b) <= 200 and a != b


@pytest.mark.parametrize("bad", ["", None, 3])
def test_empty_or_non_str_components_are_rejected(bad):
    with pytest.raises(ValueError):
        segment_name("job", bad, "owner")


def test_list_and_unlink_all_are_per_job(job):
    other = job + "x"  # shares the text prefix, not the job prefix
    rings = [Ring.create(segment_name(j, "n0", o), 4096) for j in (job, other) for o in ("a", "b")]
    try:
        assert list_segments(job) == sorted(r.name for r in rings[:2])
        assert set(list_segments()) >= {r.name for r in rings}
        assert unlink_all(job) == sorted(r.name for r in rings[:2])
        assert list_segments(job) == []
        assert list_segments(other) == sorted(r.name for r in rings[2:])
    finally:
        for r in rings:
            r.close()
            r.unlink()


@pytest.mark.timeout(60)
def test_cleanup_stale_removes_segment_of_killed_creator(job, spawn):
    dead = segment_name(job, "n0", "dead")
    child = spawn(
        """
import sys, time
from overlord.shm import Ring
r = Ring.create(sys.argv[1], 4096)
print("ready", flush=True)
time.sleep(60)
""",
        dead,
    )
    child.ready()
    with Ring.create(segment_name(job, "n0", "live"), 4096) as live:
        try:
            assert cleanup_stale(job) == []  # both creators alive
            os.kill(child.pid, signal.SIGKILL)
            child.proc.wait(timeout=10)
            assert cleanup_stale(job) == [dead]
            assert list_segments(job) == [live.name]
        finally:
            live.unlink()


def test_cleanup_stale_removes_old_garbage_only(job):
    old, fresh = segment_name(job, "n0", "old"), segment_name(job, "n0", "fresh")
    for name in (old, fresh):
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=16)  # too short
        shm.close_fd()
    past = time.time() - GARBAGE_AGE_S - 60
    os.utime("/dev/shm/" + old[1:], (past, past))
    try:
        assert cleanup_stale(job) == [old]
        assert list_segments(job) == [fresh]
    finally:
        unlink_all(job)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a PID namespace (CI runs as root)")
def test_a_held_nodes_segments_from_another_pid_namespace_count_as_dead(job, tmp_path):
    """A node's host or container restarted in a new PID namespace, its /dev/shm kept:
    what the old namespace made is not judged by default (another namespace's pid says
    nothing here), and is removed for the node whose sidecar lock the caller holds."""
    import subprocess
    import sys

    theirs, other = segment_name(job, "n1", "l0-c0"), segment_name(job, "n2", "l0-c0")
    code = (
        "import sys, time\nfrom overlord.shm import Ring\n"
        "rings = [Ring.create(n, 4096) for n in sys.argv[1:]]\nprint('ready', flush=True)\ntime.sleep(60)\n"
    )
    child = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--", sys.executable, "-c", code, theirs, other],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        assert cleanup_stale(job) == []  # another namespace's creators: not ours to judge
        assert cleanup_stale(job, node="n1") == [theirs]  # the held node's are gone with its old namespace
        assert list_segments(job) == [other]  # another node's stay
    finally:
        child.kill()
        child.wait(timeout=10)
        unlink_all(job)
