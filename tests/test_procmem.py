"""Process memory from /proc: PSS, RSS, process trees."""

from __future__ import annotations

import builtins
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from overlord import procmem

MIB = 1 << 20


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_pss_and_rss_of_self():
    pid = os.getpid()
    pss, rss = procmem.pss_bytes(pid), procmem.rss_bytes(pid)
    assert 1 * MIB < pss <= rss
    block = bytearray(64 * MIB)  # zero-filled: every page written
    try:
        assert procmem.pss_bytes(pid) - pss > 60 * MIB
    finally:
        del block


def test_pss_splits_pages_shared_after_fork():
    block = bytearray(b"x" * (64 * MIB))
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits to be measured
        time.sleep(30)
        os._exit(0)
    try:
        time.sleep(0.2)
        rss, pss = procmem.rss_bytes(child), procmem.pss_bytes(child)
        assert rss > 60 * MIB
        assert pss < rss - 25 * MIB  # the block counts half to each of the two
        assert abs(procmem.pss_of([child, child]) - 2 * pss) < 4 * MIB  # sums, no dedup
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        del block


def test_smaps_fallback_matches_rollup(monkeypatch):
    pid = os.getpid()
    rollup = procmem.pss_bytes(pid)
    real_open = builtins.open

    def no_rollup(path, *args, **kwargs):
        if str(path).endswith("smaps_rollup"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_rollup)
    summed = procmem.pss_bytes(pid)
    assert abs(summed - rollup) < 16 * MIB  # same process, read moments apart


def test_missing_process_raises_and_counts_zero():
    dead = _dead_pid()
    with pytest.raises(ProcessLookupError, match=str(dead)):
        procmem.pss_bytes(dead)
    with pytest.raises(ProcessLookupError):
        procmem.rss_bytes(dead)
    with pytest.raises(ProcessLookupError):
        procmem.tree_pids(dead)
    assert procmem.pss_of([dead]) == 0
    assert procmem.pss_of([os.getpid(), dead]) > 0


def test_tree_pids_finds_children_and_grandchildren():
    code = (
        "import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
        " for _ in range(2)]\n"
        "print(*[k.pid for k in kids], flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 30)
        assert ready, "the parent did not report its children in 30 s"
        grandchildren = sorted(int(p) for p in parent.stdout.readline().split())
        assert len(grandchildren) == 2
        assert procmem.tree_pids(parent.pid) == [parent.pid, *grandchildren]
        assert parent.pid in procmem.tree_pids(os.getpid())
        assert procmem.tree_pids(grandchildren[0]) == [grandchildren[0]]
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        parent.stdout.close()
