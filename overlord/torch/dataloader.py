"""`overlord.torch.DataLoader`: the trainer-side client, a drop-in for torch's DataLoader.

It reads finished micro-batches of its rank from a shared-memory ring that the node's
sidecar fills, and yields dicts of torch tensors. Tensors are zero-copy views into the
ring that stay valid while referenced (each batch leases its ring record until its last
tensor is freed); pass `copy=True` to own copies (or `pin_memory=True` on a CUDA
machine to get pinned copies).

If no sidecar serves the job on this node, the first rank to look starts one (detached,
exiting when its trainers are gone), so a single-machine job needs no setup. Every wait
is bounded: a sidecar that stalls, or fails with an error, surfaces here as
`RemoteRoleError` naming the role, pid and cause.

Failures it rides through: a Data Constructor restarted by the sidecar sends the
micro-batches of its unfinished step again, and this client drops those it already
has (batches arrive in (step, micro-batch) order, so that is a comparison). A sidecar
that died outright (kill -9: its Redis died with it) is started again by a loader that
may spawn one, with `--resume` at the batch after the last one delivered here: the
planner checkpoints persist in the embedded Redis's append-only file.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import torch

from overlord.config import Job
from overlord.errors import (
    ConfigError,
    OverlordError,
    PeerDied,
    RemoteRoleError,
    RingClosed,
    RingError,
    RingTimeout,
)
from overlord.runtime.layout import client_ring
from overlord.shm import Ring, decode_batch
from overlord.shm import pid_alive as alive
from overlord.shm._lease import LeasedReader
from overlord.sidecar import mode
from overlord.sidecar.sidecar import sidecar_running
from overlord.store.client import password_env
from overlord.torch import compat, launch
from overlord.torch import state as states
from overlord.torch.nodes import _SLICE_S, NodeReader

if TYPE_CHECKING:  # typing only: pyarrow.flight loads when a rank first reads over Flight
    from overlord.remote.flight import RemoteReader
    from overlord.torch.stats import StatsPublisher


class DataLoader(NodeReader):
    """Iterate the micro-batches Overlord delivers to this rank.

    Args:
        job: the job, or a path to its YAML/JSON config.
        rank: global rank; by default read where the launcher put it: an initialized
            torch.distributed process group, else $RANK, else $NODE_RANK x
            $LOCAL_WORLD_SIZE + $LOCAL_RANK (Lightning's launcher sets LOCAL_RANK and
            WORLD_SIZE only), else 0; sources that disagree raise ConfigError
            (overlord.torch.launch).
        world_size: read like rank, else the mesh's world size; must match the mesh.
        timeout_s: longest wait for one batch; defaults to Job.timeout_s.
        copy: yield tensors that own their memory instead of views into the ring.
        pin_memory: yield pinned copies (CUDA machines only; ignored with a warning elsewhere).
        spawn_sidecar: start a sidecar for the job if none runs on this node.
        remote: read this rank's micro-batches over Arrow Flight from a sidecar at this
            location (e.g. "grpc://node0:8815", its Job.flight_port) instead of from a
            local ring; defaults to $OVERLORD_REMOTE. The job's token comes from
            $OVERLORD_FLIGHT_TOKEN (or the run directory on the sidecar's node).

        *torch_args, **torch_kwargs: what a script passes to torch.utils.data.DataLoader
            (batch_size, shuffle, num_workers, drop_last, timeout, ...): each takes effect,
            is refused (ConfigError) or is warned about once, saying which Job field to set
            instead (overlord.torch.compat).

    Each item is one micro-batch: a dict of tensors (see overlord.constructor.packing).
    `last_meta` holds the current batch's step, micro-batch index and sample keys.

    Tensors are zero-copy views into the shared-memory ring, and stay valid for as long as
    anything references them, like the tensors torch's DataLoader yields: each batch
    leases its ring record until its last tensor is freed. A trainer that holds more
    batches than the ring can lease gets those copied out (counted in `copies`, the
    metrics and `overlord status`), never overwritten bytes and never a deadlock.
    """

    _leases: LeasedReader | None = None  # reading the local ring, one per ring
    _copies_before = 0  # copies made by the leasing readers of earlier rings

    def __init__(
        self,
        job: Job | str | os.PathLike,
        *torch_args: Any,
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float | None = None,
        copy: bool = False,
        pin_memory: bool = False,
        spawn_sidecar: bool = True,
        remote: str | None = None,
        **torch_kwargs: Any,
    ) -> None:
        compat.refuse_dataset(job)
        torch_kwargs = {**compat.positional(torch_args), **torch_kwargs}
        pin_memory = bool(torch_kwargs.pop("pin_memory", pin_memory))
        self.config_path = None if isinstance(job, Job) else Path(job)
        self.job = job if isinstance(job, Job) else Job.from_file(job)
        timeout_s = compat.apply(self.job, torch_kwargs, timeout_s=timeout_s)
        self.launcher = launch.detect(rank, world_size)  # and how it was found, for messages
        self.rank = self.launcher.rank
        if not 0 <= self.rank < self.job.mesh.world_size:
            raise ConfigError(
                f"rank {self.rank} ({self.launcher.how}) is not in job {self.job.name!r}'s mesh of "
                f"{self.job.mesh.world_size} ranks; fix the launch or Job.mesh"
            )
        launch.check_world(self.job, self.launcher)
        if self.job.multi_node:  # this rank's node, as torchrun placed it
            self.job = self.job.on_node(self.job.node_of_rank(self.rank))
        self.coords = self.job.mesh.coords(self.rank)
        self.timeout_s = timeout_s or self.job.timeout_s
        self.copy = copy
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but CUDA is not available; batches are not pinned", stacklevel=2)
            pin_memory = False
        self.pin_memory = pin_memory
        self.spawn_sidecar = spawn_sidecar
        self.last_meta: dict[str, Any] = {}
        self.batches = 0
        self.sidecar_pid: int | None = None
        self._ring: Ring | None = None
        self._redis = None  # opened by report_metrics and resumption only
        self._resume_at: tuple[int, int] | None = None  # (step, micro-batch) of the next batch
        self._loaded = (-1, -1)  # (step, micro-batch) of the last batch before a resume
        self._position = states.Position()  # the loaded state's (or the start's) position
        self._total: int | None = None  # micro-batches of a finite job per rank, once counted
        self._last = (-1, -1)  # (step, micro-batch) of the last batch delivered
        self.dropped = 0  # micro-batches received twice (after a restart upstream) and dropped
        self.recoveries = 0  # sidecars this loader started again after one died
        self.wait_s = 0.0  # time spent in __next__ waiting for batches
        self._stats: StatsPublisher | None = None  # from the first batch on
        self._redis_gone: float | None = None  # monotonic: when this rank found the job's Redis unreachable
        self._probe_redis = None  # see _probe
        self._outage_grace = False  # whether the roles had their extra timeout_s after the last outage
        m = self.job.mesh
        self._mesh = [m.dp, m.pp, m.cp, m.tp]
        self._done = False
        self.remote = remote or os.environ.get("OVERLORD_REMOTE") or None
        self._remote_reader: RemoteReader | None = None
        # several nodes: the Data Constructor host of this rank's DP group, and where it runs
        first = self.job.mesh.ranks_of_dp(self.coords["dp"])[0]
        self._host = self.job.node_ids.index(self.job.node_of_rank(first))
        self.serving_node: str | None = None  # the node this rank reads from now
        self.switches = 0  # times it changed nodes (its sidecar died, or came back)
        self._drained: set[int] = set()  # dead sidecars whose ring for this rank was read to its end

    # -- connecting ----------------------------------------------------------------------

    def _control(self):
        """The job's Redis, opened on first use (never on the data path of one node)."""
        from overlord.status import redis_url_of
        from overlord.store import connect

        if self._redis is None:
            self._redis = connect(redis_url_of(self.job), timeout_s=5)
        return self._redis

    def _probe(self):
        """A client of the job's Redis that answers within 1 s (no ride-through): a stalled
        rank says itself how long Redis has been away."""
        from overlord.status import redis_url_of
        from overlord.store import connect

        if self._probe_redis is None:
            self._probe_redis = connect(redis_url_of(self.job), timeout_s=1, ride_through_s=0)
        return self._probe_redis

    def _spawn(self) -> None:
        """Start a detached sidecar unless one runs; one rank wins, the others wait."""
        run_dir = self.job.make_run_path()
        with open(run_dir / "spawn.lock", "a+") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if sidecar_running(self.job):
                return
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
                        *(["--resume"] if self._resume_at is not None else []),
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
                        if line.startswith("overlord sidecar: ")
                    ]
                    raise RemoteRoleError(
                        f"rank {self.rank}: the sidecar this rank started (pid {proc.pid}) exited with "
                        f"{proc.returncode}"
                        + (f": {said[-1][len('overlord sidecar: ') :]}" if said else "")
                        + f"; see {run_dir / 'sidecar.log'}"
                    )
                if time.monotonic() > deadline:
                    raise RemoteRoleError(
                        f"rank {self.rank}: the sidecar (pid {proc.pid}) did not start within {self.timeout_s:g}s"
                    )
                time.sleep(0.05)

    def _connect(self) -> Ring:
        name = client_ring(self.job, self.rank)
        if self._resume_at is not None:
            self._resumable_sidecar()
        elif self.spawn_sidecar and not sidecar_running(self.job):
            self._spawn()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ring = Ring.attach(name, timeout=min(_SLICE_S, max(0.01, deadline - time.monotonic())))
            except RingTimeout:
                ring = None
            if ring is not None and alive(ring.creator_pid):
                break
            if ring is not None:
                ring.close()  # left by a dead sidecar; the next one replaces it
            if self.spawn_sidecar and not sidecar_running(self.job):
                self._spawn()  # the sidecar seen at first was on its way out (the job before a resume)
            if time.monotonic() > deadline:
                raise RemoteRoleError(
                    f"rank {self.rank}: no sidecar served job {self.job.name!r} on node {self.job.node!r} "
                    f"within {self.timeout_s:g}s (ring {name}); start one with "
                    "`overlord sidecar --config JOB.yaml` or pass spawn_sidecar=True "
                    f"(a sidecar that failed to start says why in its log; spawned ones in {self.job.run_path}/sidecar.log)"
                )
        try:
            ring.claim_consumer()
        except RingError:
            other = ring.consumer_pid
            ring.close()
            raise ConfigError(
                f"rank {self.rank} of job {self.job.name!r} is already read by another live process (pid {other}); "
                f"this process (pid {os.getpid()}) took rank {self.rank} from {self.launcher.how}. Two trainers claim "
                "one rank: check what the launcher sets (RANK, or NODE_RANK/LOCAL_WORLD_SIZE/LOCAL_RANK), or pass "
                "DataLoader(rank=...)"
            ) from None
        self.sidecar_pid = ring.creator_pid
        if self._resume_at is not None:
            self._report_position()
        return ring

    def _resumable_sidecar(self) -> None:
        """Before attaching with a loaded state: make sure the sidecar will serve the
        batches after it. One that still waits for the trainers' positions (started with
        --resume) will; none running: start one with --resume; one that already serves a
        run (fresh, or a resume that chose its step) delivers only what follows its own
        position, so a DataLoader that spawned it stops it and starts it again with
        --resume (a rewind), or the load is refused (overlord.sidecar.mode)."""
        if not sidecar_running(self.job):
            if self.spawn_sidecar:
                self._spawn()
            return  # else the attach loop waits for one started with --resume
        found = mode.current(self.job, self.timeout_s)
        if found is None or found.awaiting:
            return  # gone (the attach loop starts another), or waiting for this rank
        at = self._resume_at
        if at is None:
            return  # nothing was loaded: nothing to go back to
        step, mb = at
        if not self.spawn_sidecar:
            raise ConfigError(
                f"rank {self.rank} of job {self.job.name!r}: the state resumes at step {step} micro-batch {mb}, but "
                f"the sidecar (pid {found.pid}) already serves the job from its own position and cannot go back, "
                "and this DataLoader may not start another (spawn_sidecar=False). Stop it, start it with "
                "`overlord sidecar --config JOB.yaml --resume`, and load the state on every rank before iterating"
            )
        mode.rewind(self.job, self._control(), found, self.rank, at, self.timeout_s)
        warnings.warn(
            f"rank {self.rank}: stopped the sidecar of job {self.job.name!r} (pid {found.pid}) that served "
            f"later batches; starting one that resumes at step {step} micro-batch {mb}",
            stacklevel=4,
        )
        self._redis = self._probe_redis = None  # its embedded Redis stopped with it
        self._spawn()

    def _report_position(self) -> None:
        """Tell a resuming sidecar where this rank stopped (it waits for every rank)."""
        from overlord.store import Keys
        from overlord.store.schema import encode_position, position_field

        if self._resume_at is not None:
            self._control().hset(
                Keys(self.job.name).resume, position_field(self.rank), encode_position(self._resume_at)
            )

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """This loader (one pass over the whole job). Nothing is attached until the first
        batch is asked for, so `load_state_dict()` may still follow (Lightning checks
        that a loader is iterable before it loads the checkpoint's state)."""
        if self._done and self._position.end and self._resume_at is not None and self._ring is None:
            self._report_end()
        return self

    def _report_end(self) -> None:
        """A state saved after the job's last batch: nothing to wait for, but a sidecar
        that waits for every rank's position (to serve ranks a step behind) hears it."""
        if self.remote is None and not self.job.multi_node and sidecar_running(self.job):
            found = mode.current(self.job, self.timeout_s)  # at once unless it is starting
            if found is not None and found.awaiting:
                self._report_position()
        self._resume_at = None  # reported once

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        if self._stats is None:
            from overlord.torch.stats import StatsPublisher, totals_of

            self._stats = StatsPublisher(self.job, self.rank, totals_of(weakref.ref(self)))
        if self.remote is None and not self.job.multi_node and self._ring is None:
            self._ring = self._connect()
        while True:
            if self.remote is not None:
                view = self._read_remote()
            elif self.job.multi_node:
                view = self._read_nodes()
            else:
                view = self._read()
            if view is None:
                self._finish()
                raise StopIteration
            arrays, meta = decode_batch(view)
            position = (meta["step"], meta["microbatch"])
            if position > self._last:
                break
            self.dropped += 1  # a restarted Data Constructor sent it again
        if self.job.multi_node and position > (self._next_of(self._last) if self._last >= (0, 0) else (0, 0)):
            raise RemoteRoleError(
                f"rank {self.rank} of job {self.job.name!r}: after step {self._last[0]} micro-batch {self._last[1]} "
                f"the next batch from node {self.serving_node!r} is step {position[0]} micro-batch {position[1]}: "
                "batches were lost (the node serving this rank died while it was away from its own node's ring)"
            )
        self._last = position
        self.last_meta = meta
        self.batches += 1
        if self._ring is not None:  # the Data Constructor tells the Planner how far trainers are
            self._ring.set_consumer_mark(position[0] + 1)
        self.wait_s += time.perf_counter() - started
        # Zero-copy: the tensors lease the ring record they view until the last of them
        # (or anything made from them) is freed; see overlord.shm._lease.
        batch = {name: torch.from_numpy(a) for name, a in arrays.items()}
        if self.pin_memory:
            return {k: v.pin_memory() for k, v in batch.items()}
        if self.copy:
            return {k: v.clone() for k, v in batch.items()}
        return batch

    def _read(self):
        """The next record's view, or None at the end of the job."""
        ring = self._ring
        deadline = time.monotonic() + self.timeout_s
        origin = f"rank {self.rank} (dp={self.coords['dp']}) of job {self.job.name!r}"
        if ring is None:
            raise RemoteRoleError(f"{origin}: read before this DataLoader attached to its ring")
        while True:
            try:
                return self._leases_for(ring).read(timeout=min(_SLICE_S, max(0.001, deadline - time.monotonic())))
            except RingClosed:
                return None
            except (RingTimeout, PeerDied) as exc:
                if ring.creator_pid and not alive(ring.creator_pid) and not ring.error:
                    if self.spawn_sidecar:  # killed outright: start another that resumes here
                        ring = self._recover()
                        deadline = time.monotonic() + self.timeout_s
                        continue
                    raise RemoteRoleError(
                        f"{origin}: the sidecar (pid {ring.creator_pid}) died; see {self.job.run_path}/sidecar.log "
                        "and the role logs there"
                    ) from None
                if isinstance(exc, PeerDied):
                    if ring.error or time.monotonic() > deadline:
                        detail = ring.error or str(exc)
                        raise RemoteRoleError(
                            f"{origin}: the Data Constructor feeding this rank died: {detail}"
                        ) from None
                    time.sleep(0.01)  # the sidecar restarts it; it sends the unfinished step again
                    continue
                if time.monotonic() > deadline:
                    deadline = self._slow_or_hung(
                        origin, f"sidecar pid {ring.creator_pid}", "see the logs in the run directory"
                    )
            except RingError as exc:
                raise RemoteRoleError(f"{origin}: {exc}") from None

    def _read_remote(self):
        """The next record over Flight, or None at the end of the job."""
        from overlord.remote.flight import RemoteReader, job_token

        if self.remote is None:
            raise ConfigError("_read_remote needs DataLoader(remote=...) or $OVERLORD_REMOTE")
        if self._remote_reader is None:
            if self._resume_at is not None:
                raise ConfigError(
                    "load_state_dict() with a remote DataLoader is not supported yet; read from the local ring"
                )
            self._remote_reader = RemoteReader(
                self.job, self.remote, self.rank, token=job_token(self.job), after=self._last, timeout_s=self.timeout_s
            )
        try:
            return next(self._remote_reader)
        except StopIteration:
            return None
        except Exception as exc:  # noqa: BLE001 - pyarrow.flight errors, with their message
            raise RemoteRoleError(
                f"rank {self.rank} of job {self.job.name!r}: reading from {self.remote} over Flight failed: {exc}"
            ) from None

    def _recover(self) -> Ring:
        """Start the dead sidecar again, resuming at the batch after the last one delivered."""
        step, mb = max(self._last, self._loaded)
        self._resume_at = (0, 0) if step < 0 else self._next_of((step, mb))
        dead = self._ring.creator_pid if self._ring is not None else "?"
        warnings.warn(
            f"rank {self.rank}: the sidecar (pid {dead}) died; starting another that resumes "
            f"at step {self._resume_at[0]} micro-batch {self._resume_at[1]}",
            stacklevel=2,
        )
        if self._ring is not None:
            self._ring.close()  # batches the trainer still holds keep their mapping
        self._ring = None
        self._redis = self._probe_redis = None
        self.recoveries += 1
        self._ring = self._connect()
        return self._ring

    def _slow_or_hung(self, origin: str, serving: str, look: str) -> float:
        """After `timeout_s` without a batch: a new deadline when the Data Constructor host
        feeding this rank turned its loop within that time (slow, not hung: it waits on
        roles that answer for themselves the same way, so a hang upstream still reaches
        the trainer as an error), else RemoteRoleError naming what serves the rank. When
        the job's Redis does not answer, waits on up to `Job.redis_outage_s` (the roles wait
        for it too), then RemoteRoleError naming Redis; back without the job's state, at once."""
        from overlord.runtime.flow import alive_within
        from overlord.store import Keys

        keys = Keys(self.job.name)
        try:
            r = self._probe()
            turning = alive_within(r, keys, "constructor", self._host, self.timeout_s)
            job_known = r.exists(keys.job_config)
        except (OverlordError, redis.RedisError) as exc:
            self._probe_redis = None  # a fresh client, and a fresh ping, next time
            return self._redis_away(origin, exc)
        was_away = self._redis_gone is not None or self._missed_redis_lately()
        self._redis_gone = None
        if not job_known:
            raise RemoteRoleError(
                f"{origin}: the job's Redis at {self._redis_url()} no longer holds the state of job "
                f"{self.job.name!r} (its key {keys.job_config!r} is gone: Redis restarted without persistence, "
                "or was flushed); plans, cursors and checkpoints are lost. Restart the job (its trainers resume "
                "from their state_dict), and give Redis an append-only file (appendonly yes) or a replica"
            ) from None
        if turning:
            self._outage_grace = False
            warnings.warn(f"{origin}: no batch for {self.timeout_s:g}s; the pipeline is slow, not hung", stacklevel=2)
            return time.monotonic() + self.timeout_s
        if was_away and not self._outage_grace:
            # Redis just came back: the roles could not beat while it was away, so their
            # heartbeats are as old as the outage. One more timeout_s for them to turn
            # their loops (once per outage: a role that stays silent is then an error).
            self._outage_grace = True
            warnings.warn(
                f"{origin}: no batch for {self.timeout_s:g}s: the job's Redis at {self._redis_url()} answers "
                f"again after an outage; waiting up to {self.timeout_s:g}s more for constructor{self._host} "
                "to turn its loop",
                stacklevel=2,
            )
            return time.monotonic() + self.timeout_s
        raise RemoteRoleError(
            f"{origin}: no batch within {self.timeout_s:g}s ({serving}) and its Data Constructor host "
            f"(constructor{self._host}) has not turned its loop for as long: run `overlord status` and {look}"
        ) from None

    def _missed_redis_lately(self) -> bool:
        """Whether this trainer's stats thread failed to reach Redis within the last
        timeout_s (an outage this rank's probes did not see: it was reading batches)."""
        missed = self._stats.missed if self._stats is not None else None
        return missed is not None and time.monotonic() - missed < 2 * self.timeout_s

    def _redis_url(self) -> str:
        from overlord.status import redis_url_of  # deferred as in _control
        from overlord.store import redact

        return redact(redis_url_of(self.job))

    def _redis_away(self, origin: str, exc: BaseException) -> float:
        """No batch, and the job's Redis does not answer: wait on (the roles wait for it too)
        up to `Job.redis_outage_s` since it was last reached, then RemoteRoleError naming it."""
        now = time.monotonic()
        if self._redis_gone is None:
            reached = self._stats.reached if self._stats is not None else None  # written once a second
            self._redis_gone = reached if reached is not None else now
        gone, budget = now - self._redis_gone, self.job.redis_outage_s
        if gone >= budget:
            raise RemoteRoleError(
                f"{origin}: the job's Redis at {self._redis_url()} has been unreachable for {gone:.0f}s, past "
                f"Job.redis_outage_s={budget:g} ({type(exc).__name__}: {exc}); no batch within {self.timeout_s:g}s "
                "since the roles wait on it. Bring Redis back (or fail it over), or raise Job.redis_outage_s"
            ) from None
        warnings.warn(
            f"{origin}: no batch for {self.timeout_s:g}s: the job's Redis at {self._redis_url()} is "
            f"unreachable ({gone:.0f}s so far); waiting for it up to Job.redis_outage_s={budget:g}",
            stacklevel=2,
        )
        return now + min(self.timeout_s, max(0.5, budget - gone))

    def _finish(self) -> None:
        self._done = True
        if self._stats is not None:
            self._stats.stop()
            self._stats = None
        if self._remote_reader is not None:
            self._remote_reader.close()
            self._remote_reader = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def close(self) -> None:
        """Detach from the ring (the sidecar keeps serving other ranks). Batches the
        trainer still holds stay valid: their mapping lives as long as they do."""
        self._finish()

    def _leases_for(self, ring: Ring) -> LeasedReader:
        """The leasing reader of `ring` (a new one for a new ring: a sidecar came back)."""
        if self._leases is None or self._leases.ring is not ring:
            if self._leases is not None:
                self._copies_before += self._leases.copies
            self._leases = LeasedReader(ring)
        return self._leases

    @property
    def copies(self) -> int:
        """Batches copied out of the ring because the trainer held more than it can lease."""
        return self._copies_before + (self._leases.copies if self._leases is not None else 0)

    def __len__(self) -> int:
        """Micro-batches this rank gets from a finite job (`Job.epochs` set) from its start,
        whatever state was loaded, as torch's DataLoader's len() is its whole epoch's; 0
        once the job's last batch was consumed (a state saved after it). Lightning counts
        the batches done before a checkpoint against len() (`fetched += ready`): a len()
        that shrank on a resume ended its epoch that many batches early, and with
        `max_epochs=1` silently dropped the job's last batches. What is left: `remaining`.

        Raises:
            TypeError: the job runs forever, or its length is not known before it runs (a
                `Job.mixing` schedule, a source with `on_error: skip`); frameworks take
                that as a loader without length (overlord.torch.state).
        """
        if self._now().end:
            return 0
        if self._total is None:
            self._total = states.length(self.job)
        return self._total

    @property
    def remaining(self) -> int:
        """Micro-batches this rank still gets from a finite job: after a resume, those
        after the loaded state; 0 after the last batch. TypeError as len()."""
        position = self._now()
        return states.remaining(len(self), position, self.job.batch.micro_batches) if not position.end else 0

    # -- metrics for dynamic mixing ---------------------------------------------------

    def report_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Tell the Planner this rank's latest metrics (e.g. {"loss/web": 2.31}).

        A `mixing: {kind: dynamic}` schedule reads them (mean over ranks) to set the
        weights of later steps. One small Redis write; never on the data path.
        """
        from overlord.store import Keys

        record = {
            "step": self.last_meta.get("step", -1) if step is None else step,
            "metrics": {k: float(v) for k, v in metrics.items()},
        }
        self._control().hset(Keys(self.job.name).metrics, str(self.rank), json.dumps(record))

    # -- checkpointing -------------------------------------------------------------------

    def _now(self) -> states.Position:
        """This rank's position: the last batch yielded, or the loaded state's."""
        if self._last == self._loaded:  # nothing yielded since the load (or the start)
            return states.Position(*self._position.last, self.batches, self._position.end)
        return states.Position(*self._last, self.batches, bool(self.last_meta.get("last")))

    def state_dict(self) -> dict[str, Any]:
        """The job-wide state: where every rank stands, so any rank's state resumes all.

        The position is the last batch this DataLoader *yielded*; every rank of a
        data-parallel job is at the same one whenever it saves (overlord.torch.state).
        Small and cheap (no I/O): call it as often as a checkpoint needs.

        Prefetch rule: save the state when every batch yielded has been trained on.
        A loop that fetches batch i+1 before it saves the checkpoint of step i must
        save the state it took right after batch i (Lightning with a loader of no
        `len()`: overlord.lightning keeps it per batch). Under Lightning 2.6 with this
        loader as the train dataloader, a finite job has `len()`, so Lightning's
        fetcher does not prefetch and ModelCheckpoint (on_train_batch_end) saves
        exactly the batches trained; under Accelerate (`register_for_checkpointing`,
        `save_state` after the optimizer step) nothing is prefetched: the loader is not
        a torch DataLoader, so `prepare()` passes it through.
        """
        return states.make(self.job, self.rank, self._now())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after `state` (any rank's `state_dict()`, or a per-rank state of the
        first format), with the bytes of an uninterrupted run.

        Call it on every rank before the first batch; calling `iter()` before it is fine,
        and so is calling it again (the last state wins). The sidecar must serve the
        batches after the state: one started with `--resume` does (a sidecar this loader
        spawns is); one a DataLoader spawned that already serves the job is stopped and
        started again with `--resume` once every live process reading it asked for it
        (each rank loads a state); any other is refused, saying what to do. A state saved after the job's
        last batch resumes to an immediate end: StopIteration at once, `len()` 0.

        A state from a different mesh (another DP size) is accepted at a step boundary:
        the job continues exactly once from the Planner's per-source cursors, on the
        new mesh (its bytes then differ from the old mesh's, as they must).

        Raises:
            OverlordError: this DataLoader already yielded a batch.
            ConfigError: the state belongs to another job, or to another mesh and not at
                a step boundary; or the job runs on several nodes.
        """
        if self._last != self._loaded:
            raise OverlordError(
                f"load_state_dict() after rank {self.rank}'s DataLoader yielded a batch (step {self._last[0]} "
                f"micro-batch {self._last[1]}): load the state before the first batch, or make a new DataLoader"
            )
        position = states.load(self.job, self.rank, state)
        if position.batches and self.job.multi_node:
            raise ConfigError(
                "load_state_dict() on a job on several nodes is not supported yet: a node that "
                "restarts rejoins the running job by itself; restart a stopped job fresh"
            )
        if self._ring is not None:  # attached by a next() that yielded nothing: attach again
            self._ring.close()
            self._ring = None
        self._position = position
        self._loaded = self._last = position.last
        self.batches = position.batches
        self._resume_at = position.next(self.job.batch.micro_batches) if position.batches else None
        self._done = position.end

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
