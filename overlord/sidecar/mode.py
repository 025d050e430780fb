"""What a running sidecar serves, for a trainer: whether one runs on this node (it holds
the job's lock), and for a trainer that loads a state, a resume that still waits for
the trainers' positions, or a run that already chose where each rank starts.

The sidecar writes `<run dir>/sidecar-mode.json` (atomically, by rename) once its rings
exist, and again when a resume has fixed its step:

    {"pid": 4242, "resume": true, "decided": false, "spawned": true, "run": 1}

`spawned`: started by a DataLoader (which sets $OVERLORD_SPAWNED_BY to its pid in the
sidecar's environment; `--exit-when-idle` alone does not say it). A trainer that loads
a state and finds a sidecar that is not waiting for positions cannot be served by it:
the sidecar delivers the batches after the position it chose, never earlier ones. A
spawned one may be stopped and started again with --resume (`rewind`: once every live
process reading its rings asked for it, since each rank of the job loads a state);
one run by `overlord sidecar` or a service manager is not stopped by a trainer.

`run` counts the runs the sidecar began: 1 at its start, one more each time it went
back to the trainers' states in place (a rewind of a job on several nodes,
overlord.sidecar.rewind), so a trainer that asked for one tells the run after it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from overlord.config import Job
from overlord.errors import ConfigError, OverlordError, RingError
from overlord.runtime.layout import client_ring
from overlord.shm import Ring
from overlord.shm import pid_alive as alive
from overlord.store import Keys
from overlord.store.schema import encode_rewind, rewind_field, rewinds

MODE_NAME = "sidecar-mode.json"
SPAWNED_BY = "OVERLORD_SPAWNED_BY"  # environment: the pid of the DataLoader that started this sidecar
LOCK_NAME = "sidecar.lock"


@dataclass(frozen=True, slots=True)
class Mode:
    pid: int
    resume: bool  # started with --resume
    decided: bool  # a resume that fixed its step (every rank reported)
    spawned: bool  # started by a DataLoader
    run: int = 1  # the runs this sidecar began (a rewind begins another)

    @property
    def awaiting(self) -> bool:
        """A resume still waiting for the trainers' positions."""
        return self.resume and not self.decided


def _path(job: Job) -> Path:
    return job.run_path / MODE_NAME


def spawned_here() -> bool:
    """Whether this process (a sidecar) was started by a DataLoader."""
    return bool(os.environ.get(SPAWNED_BY))


def write(job: Job, *, resume: bool, decided: bool, spawned: bool, run: int = 1) -> None:
    path = _path(job)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record = {"pid": os.getpid(), "resume": resume, "decided": decided, "spawned": spawned, "run": run}
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read(job: Job) -> Mode | None:
    try:
        raw = json.loads(_path(job).read_text())
        return Mode(
            int(raw["pid"]), bool(raw["resume"]), bool(raw["decided"]), bool(raw["spawned"]), int(raw.get("run", 1))
        )
    except (OSError, ValueError, KeyError):
        return None


def lock_path(job: Job) -> Path:
    """The sidecar lock of the job on this node: one sidecar per job and node holds it."""
    return job.run_path / LOCK_NAME


def sidecar_running(job: Job) -> bool:
    """Whether some process holds this job's sidecar lock on this node."""
    path = lock_path(job)
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def holder(job: Job) -> int | None:
    """The pid written in the sidecar lock (the running sidecar's, while it holds it)."""
    try:
        text = lock_path(job).read_text().strip()
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


def readers(job: Job) -> dict[int, int]:
    """rank -> pid of the live process that reads its ring on this node (ranks read by none left out)."""
    out = {}
    for rank in job.ranks_of_node(job.node):
        try:
            ring = Ring.attach(client_ring(job, rank), timeout=0.01)
        except (RingError, OSError):
            continue
        try:
            pid = ring.consumer_pid
        finally:
            ring.close()
        if pid and alive(pid):
            out[rank] = pid
    return out


def rewind(job: Job, r, found: Mode, rank: int, at: tuple[int, int], timeout_s: float) -> None:
    """Restart the spawned sidecar `found` so that it resumes from the trainers' states,
    once every other live process reading one of its rings asked for the same (each
    trainer of a data-parallel job loads a state: the last of them to ask stops it).
    Returns when it is gone; the caller starts one with --resume and reports `at`.

    A trainer's request is `rewind:<rank>` in the job's `resume` hash (its pid and
    position); the hash goes with the old run (a new sidecar publishes afresh).

    Raises:
        ConfigError: the sidecar was not started by a DataLoader, or another process
            still reads from it and did not ask within `timeout_s`, or it did not stop.
    """
    if not found.spawned:
        raise ConfigError(
            f"rank {rank} of job {job.name!r}: the state resumes at step {at[0]} micro-batch {at[1]}, but the sidecar "
            f"(pid {found.pid}) already serves the job from its own position and cannot go back: it was not started "
            "by a DataLoader (`overlord sidecar` or a service manager runs it), so a trainer does not stop it. Stop "
            "it, start it with `overlord sidecar --config JOB.yaml --resume`, and load the state on every rank "
            "before iterating"
        )
    # deferred: a trainer imports this module without loading redis-py; `r` loaded it
    import redis

    me = os.getpid()
    keys = Keys(job.name)
    try:
        r.hset(keys.resume, rewind_field(rank), encode_rewind(me, at))
    except (redis.RedisError, OverlordError):
        pass  # its Redis is gone with it: nothing left to agree on
    deadline = time.monotonic() + timeout_s
    waiting: dict[int, int] = {}
    while alive(found.pid):
        try:
            asked = rewinds(r.hgetall(keys.resume))
        except (redis.RedisError, OverlordError):
            time.sleep(0.05)  # on its way out
            continue
        waiting = {rk: pid for rk, pid in readers(job).items() if pid != me and asked.get(rk) != pid}
        if not waiting:
            stop(job, found.pid, max(0.1, deadline - time.monotonic()))
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if alive(found.pid):
        who = ", ".join(f"rank {rk} (pid {pid})" for rk, pid in sorted(waiting.items())) or "nothing"
        raise ConfigError(
            f"rank {rank} of job {job.name!r}: resuming at step {at[0]} micro-batch {at[1]} needs the sidecar "
            f"(pid {found.pid}) started again, but within {timeout_s:g}s {who} still read from it without loading "
            f"a state: load the state on every rank before iterating (or stop the sidecar: kill -TERM {found.pid})"
        )


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
