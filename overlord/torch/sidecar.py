"""This node's sidecar as one trainer rank sees it: starting one when none runs, making
the one that runs serve a loaded state, telling a resuming one where the rank stands.

A rank that may spawn (`DataLoader(spawn_sidecar=True)`) starts a detached sidecar
(`overlord sidecar --exit-when-idle`, with `--resume` once a state was loaded or the
last sidecar died); one rank wins a file lock, the others wait for it. A sidecar that
already serves a run delivers only what follows its own position, so a loaded state
that goes back needs it started again with `--resume` (a rewind, overlord.sidecar.mode).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import warnings

from overlord.config import Job
from overlord.errors import ConfigError, RemoteRoleError
from overlord.sidecar import mode, rewind
from overlord.sidecar.mode import sidecar_running
from overlord.store import Keys
from overlord.store.schema import encode_position, position_field
from overlord.torch.control import Control
from overlord.torch.state import next_of

_SAID = "overlord sidecar: "  # how a sidecar's log line says why it stopped


class NodeSidecar:
    """The job's sidecar on this node, for rank `rank`.

    `resume_at` is the (step, micro-batch) the rank reads next when a sidecar must
    resume for it (a state was loaded, or the last sidecar died): a sidecar started
    then gets `--resume`, and hears the position.
    """

    def __init__(self, job: Job, rank: int, control: Control, *, timeout_s: float, may_spawn: bool) -> None:
        self.job, self.rank, self.control, self.timeout_s = job, rank, control, timeout_s
        self.may_spawn = may_spawn
        self.resume_at: tuple[int, int] | None = None

    def running(self) -> bool:
        """Whether a sidecar of the job runs on this node."""
        return sidecar_running(self.job)

    def ensure(self) -> None:
        """Start one unless one runs or this rank may not."""
        if self.may_spawn and not sidecar_running(self.job):
            self.spawn()

    def spawn(self) -> None:
        """Start a detached sidecar unless one runs; one rank wins, the others wait."""
        run_dir = self.job.make_run_path()
        with open(run_dir / "spawn.lock", "a+") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if sidecar_running(self.job):
                return
            # deferred: redis-py loads in a trainer on one node only when it talks to Redis
            from overlord.store.client import password_env

            config = run_dir / "spawned-job.json"
            config.write_text(self.job.to_json())
            with open(run_dir / "sidecar.log", "ab") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "overlord.cli",
                        "sidecar",
                        "--config",
                        str(config),
                        "--exit-when-idle",
                        *(["--resume"] if self.resume_at is not None else []),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # a loader may restart it (a rewind); the Redis password, cut from the config
                    # file, travels in the environment
                    env={**os.environ, **password_env(self.job.redis_url), mode.SPAWNED_BY: str(os.getpid())},
                    start_new_session=True,  # outlives this rank: the other ranks still need it
                )
            deadline = time.monotonic() + self.timeout_s
            while not sidecar_running(self.job):
                if proc.poll() is not None:
                    said = [
                        line
                        for line in (run_dir / "sidecar.log").read_text(errors="replace").splitlines()
                        if line.startswith(_SAID)
                    ]
                    raise RemoteRoleError(
                        f"rank {self.rank}: the sidecar this rank started (pid {proc.pid}) exited with "
                        f"{proc.returncode}"
                        + (f": {said[-1][len(_SAID) :]}" if said else "")
                        + f"; see {run_dir / 'sidecar.log'}"
                    )
                if time.monotonic() > deadline:
                    raise RemoteRoleError(
                        f"rank {self.rank}: the sidecar (pid {proc.pid}) did not start within {self.timeout_s:g}s"
                    )
                time.sleep(0.05)

    def make_resumable(self) -> None:
        """Before attaching with a loaded state: make sure the sidecar will serve the
        batches after it. One that still waits for the trainers' positions (started with
        --resume) will; none running: start one with --resume; one that already serves a
        run (fresh, or a resume that chose its step) delivers only what follows its own
        position, so a DataLoader that spawned it stops it and starts it again with
        --resume (a rewind), or the load is refused (overlord.sidecar.mode)."""
        if not sidecar_running(self.job):
            if self.may_spawn:
                self.spawn()
            return  # else the attach loop waits for one started with --resume
        found = mode.current(self.job, self.timeout_s)
        if found is None or found.awaiting:
            return  # gone (the attach loop starts another), or waiting for this rank
        at = self.resume_at
        if at is None:
            return  # nothing was loaded: nothing to go back to
        step, mb = at
        if not self.may_spawn:
            raise ConfigError(
                f"rank {self.rank} of job {self.job.name!r}: the state resumes at step {step} micro-batch {mb}, but "
                f"the sidecar (pid {found.pid}) already serves the job from its own position and cannot go back, "
                "and this DataLoader may not start another (spawn_sidecar=False). Stop it, start it with "
                "`overlord sidecar --config JOB.yaml --resume`, and load the state on every rank before iterating"
            )
        mode.rewind(self.job, self.control.client(), found, self.rank, at, self.timeout_s)
        warnings.warn(
            f"rank {self.rank}: stopped the sidecar of job {self.job.name!r} (pid {found.pid}) that served "
            f"later batches; starting one that resumes at step {step} micro-batch {mb}",
            stacklevel=5,  # the trainer's next(): DataLoader.__next__, the reader's read and attach between
        )
        self.control.reset()  # its embedded Redis stopped with it
        self.spawn()

    def resume_job(self) -> None:
        """A job on several nodes, before the first read after a loaded state: have the
        job serve the batches after it. The node's sidecar that waits for positions (a
        `--resume` start, or a rewind under way) hears this rank's; one that serves the
        running job makes every node's sidecar go back to the trainers' states (a rewind,
        overlord.sidecar.rewind), then waits for it. Returns once the position is told.

        Raises:
            RemoteRoleError: no sidecar of the job on this node came to wait for
                positions within the timeout.
        """
        at = self.resume_at
        if at is None:
            return
        r, keys = self.control.client(), Keys(self.job.name)
        deadline = time.monotonic() + self.timeout_s
        asked: tuple[int, int] | None = None  # the sidecar (pid, run) that served when this rank asked for a rewind
        while True:
            if sidecar_running(self.job):
                found = mode.current(self.job, min(1.0, self.timeout_s))
                if found is not None and found.awaiting:
                    self.report_position()
                    return
                if found is not None and asked is not None and (found.pid, found.run) != asked:
                    return  # a run after the rewind, decided already: the position it asked with counted
                if found is not None and asked is None:
                    rewind.ask(r, keys, self.rank, os.getpid(), at)
                    asked = (found.pid, found.run)
                    warnings.warn(
                        f"rank {self.rank}: the state resumes at step {at[0]} micro-batch {at[1]}, before what job "
                        f"{self.job.name!r} serves: every node's sidecar goes back to the trainers' states",
                        stacklevel=5,  # the trainer's next(): DataLoader.__next__, the reader's read and attach between
                    )
            elif self.may_spawn:
                self.spawn()
            if time.monotonic() > deadline:
                raise RemoteRoleError(
                    f"rank {self.rank} of job {self.job.name!r}: resuming at step {at[0]} micro-batch {at[1]} needs "
                    f"the sidecar on node {self.job.node!r} to wait for the trainers' positions, and none did within "
                    f"{self.timeout_s:g}s (asked for a rewind: {asked is not None}); start it (`overlord sidecar --config "
                    "JOB.yaml`, with --resume for a stopped job) and see its log"
                )
            time.sleep(0.05)

    def died(self, after: tuple[int, int]) -> tuple[int, int]:
        """The sidecar died outright, its embedded Redis with it: the next one resumes at
        the batch after `after` (the last one delivered; (-1, -1): none yet). Returns
        that (step, micro-batch)."""
        self.resume_at = (0, 0) if after[0] < 0 else next_of(after, self.job.batch.micro_batches)
        self.control.reset()
        return self.resume_at

    def report_position(self) -> None:
        """Tell a resuming sidecar where this rank stopped (it waits for every rank)."""
        if self.resume_at is not None:
            self.control.client().hset(
                Keys(self.job.name).resume, position_field(self.rank), encode_position(self.resume_at)
            )

    def report_end(self, *, local: bool) -> None:
        """A state saved after the job's last batch: nothing to wait for, but a sidecar
        that waits for every rank's position (to serve ranks a step behind) hears it.
        `local`: whether the rank reads a ring on this node's sidecar (one reading over
        Flight from a given location has no sidecar here waiting for it)."""
        if local and sidecar_running(self.job):
            found = mode.current(self.job, self.timeout_s)  # at once unless it is starting
            if found is not None and found.awaiting:
                self.report_position()
        self.resume_at = None  # reported once
