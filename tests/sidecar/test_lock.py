"""The sidecar's lock on its job and node, over a real file and real processes: a
running sidecar's is refused, a dead sidecar's is waited for while what it forked lets go."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from overlord.config import Job, Source
from overlord.errors import OverlordError
from overlord.sidecar.mode import lock_path
from overlord.sidecar.sidecar import Sidecar

# holds the lock file's lock for `seconds` after writing `pid` in it (as a sidecar does;
# a forked child of a sidecar holds it the same way, through the descriptor it inherited)
HOLD = """
import fcntl, sys, time
fh = open(sys.argv[1], "a+")
fcntl.flock(fh, fcntl.LOCK_EX)
fh.seek(0); fh.truncate(); fh.write(sys.argv[2]); fh.flush()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _job(tmp_path) -> Job:
    return Job(
        name=f"k{uuid.uuid4().hex[:8]}", sources=(Source(name="x", paths=("/dev/null",)),), run_dir=str(tmp_path)
    )


def _hold(job: Job, pid: str, seconds: float) -> subprocess.Popen:
    job.make_run_path()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock_path(job)), pid, str(seconds)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def test_the_lock_of_a_dead_sidecar_is_taken_once_its_children_let_go(tmp_path):
    job = _job(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = _hold(job, dead.stdout.strip(), 1.0)  # a child of the dead sidecar, about to die with it
    sidecar = Sidecar(job)
    try:
        start = time.monotonic()
        sidecar._take_lock()
        assert holder.wait(timeout=5) == 0 and time.monotonic() - start < 5
        assert lock_path(job).read_text().strip() == str(os.getpid())
    finally:
        if sidecar._lock_fh is not None:
            sidecar._lock_fh.close()


def test_the_lock_of_a_running_sidecar_is_refused_at_once_naming_its_pid(tmp_path):
    job = _job(tmp_path)
    holder = _hold(job, str(os.getpid()), 30.0)  # this (live) process stands for the sidecar
    try:
        start = time.monotonic()
        with pytest.raises(OverlordError, match=r"already runs on this node .*pid \d+"):
            Sidecar(job)._take_lock()
        assert time.monotonic() - start < 2, "a live sidecar's lock is refused, not waited for"
    finally:
        holder.kill()
        holder.wait(timeout=5)
