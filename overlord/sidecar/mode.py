"""What a running sidecar serves, for a trainer that loads a state: a resume that still
waits for the trainers' positions, or a run that already chose where each rank starts.

The sidecar writes `<run dir>/sidecar-mode.json` (atomically, by rename) once its rings
exist, and again when a resume has fixed its step:

    {"pid": 4242, "resume": true, "decided": false, "spawned": true}

`spawned`: started by a DataLoader (which sets $OVERLORD_SPAWNED_BY to its pid in the
sidecar's environment; `--exit-when-idle` alone does not say it); such a sidecar may be stopped
and started again by a DataLoader of the same job to go back to an earlier state
(nothing else depends on it). A trainer that loads a state and finds a sidecar that
is not waiting for positions cannot be served by it: the sidecar delivers the batches
after the position it chose, never earlier ones. `rewind_blockers` names what stops a
restart; `stop` ends a spawned sidecar within a bound.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from overlord.config import Job
from overlord.errors import RingError
from overlord.shm import Ring
from overlord.shm import pid_alive as alive
from overlord.sidecar.layout import client_ring

MODE_NAME = "sidecar-mode.json"
SPAWNED_BY = "OVERLORD_SPAWNED_BY"  # environment: the pid of the DataLoader that started this sidecar
LOCK_NAME = "sidecar.lock"


@dataclass(frozen=True, slots=True)
class Mode:
    pid: int
    resume: bool  # started with --resume
    decided: bool  # a resume that fixed its step (every rank reported)
    spawned: bool  # started by a DataLoader

    @property
    def awaiting(self) -> bool:
        """A resume still waiting for the trainers' positions."""
        return self.resume and not self.decided


def _path(job: Job) -> Path:
    return job.run_path / MODE_NAME


def spawned_here() -> bool:
    """Whether this process (a sidecar) was started by a DataLoader."""
    return bool(os.environ.get(SPAWNED_BY))


def write(job: Job, *, resume: bool, decided: bool, spawned: bool) -> None:
    path = _path(job)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "resume": resume, "decided": decided, "spawned": spawned}))
    os.replace(tmp, path)


def read(job: Job) -> Mode | None:
    try:
        raw = json.loads(_path(job).read_text())
        return Mode(int(raw["pid"]), bool(raw["resume"]), bool(raw["decided"]), bool(raw["spawned"]))
    except (OSError, ValueError, KeyError):
        return None


def holder(job: Job) -> int | None:
    """The pid written in the sidecar lock (the running sidecar's, while it holds it)."""
    try:
        text = (job.run_path / LOCK_NAME).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def current(job: Job, timeout_s: float) -> Mode | None:
    """The mode of the sidecar that holds the lock now, once it wrote it (it does so within
    its start-up); None if it did not within `timeout_s` or holds no lock any more."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid = holder(job)
        mode = read(job)
        if pid is not None and mode is not None and mode.pid == pid:
            return mode
        if pid is not None and not alive(pid):
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def rewind_blockers(job: Job, mode: Mode) -> list[str]:
    """Why this process may not restart the sidecar (empty: it may): one not spawned by a
    DataLoader, or a trainer in another live process reading one of its rings."""
    if not mode.spawned:
        return [f"the sidecar (pid {mode.pid}) was not started by a DataLoader (`overlord sidecar` or a service "
                "manager runs it), so a trainer does not stop it"]
    why = []
    for rank in job.ranks_of_node(job.node):
        try:
            ring = Ring.attach(client_ring(job, rank), timeout=0.01)
        except (RingError, OSError):
            continue
        try:
            pid = ring.consumer_pid
        finally:
            ring.close()
        if pid and pid != os.getpid() and alive(pid):
            why.append(f"rank {rank} is read by another live process (pid {pid})")
    return why


def stop(job: Job, pid: int, timeout_s: float) -> bool:
    """SIGTERM the sidecar `pid` and wait until it let its lock go; whether it did in time."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
