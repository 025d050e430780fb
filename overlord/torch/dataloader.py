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
from pathlib import Path
from typing import Any, Iterator

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
from overlord.shm import pid_alive as alive
from overlord.shm import Ring, decode_batch
from overlord.shm._lease import LeasedReader
from overlord.sidecar.layout import client_ring
from overlord.sidecar.sidecar import sidecar_running
from overlord.torch.nodes import _SLICE_S, NodeReader



def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class DataLoader(NodeReader):
    """Iterate the micro-batches Overlord delivers to this rank.

    Args:
        job: the job, or a path to its YAML/JSON config.
        rank: global rank; defaults to $RANK (torchrun), else 0.
        world_size: defaults to $WORLD_SIZE, else the mesh's world size; must match the mesh.
        timeout_s: longest wait for one batch; defaults to Job.timeout_s.
        copy: yield tensors that own their memory instead of views into the ring.
        pin_memory: yield pinned copies (CUDA machines only; ignored with a warning elsewhere).
        spawn_sidecar: start a sidecar for the job if none runs on this node.
        remote: read this rank's micro-batches over Arrow Flight from a sidecar at this
            location (e.g. "grpc://node0:8815", its Job.flight_port) instead of from a
            local ring; defaults to $OVERLORD_REMOTE. The job's token comes from
            $OVERLORD_FLIGHT_TOKEN (or the run directory on the sidecar's node).

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
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float | None = None,
        copy: bool = False,
        pin_memory: bool = False,
        spawn_sidecar: bool = True,
        remote: str | None = None,
    ) -> None:
        self.config_path = None if isinstance(job, Job) else Path(job)
        self.job = job if isinstance(job, Job) else Job.from_file(job)
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        if self.job.multi_node:  # this rank's node, as torchrun placed it
            self.job = self.job.on_node(self.job.node_of_rank(self.rank))
        world = world_size if world_size is not None else _env_int("WORLD_SIZE", self.job.mesh.world_size)
        self.job.check_world(world)
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
        self._last = (-1, -1)  # (step, micro-batch) of the last batch delivered
        self.dropped = 0  # micro-batches received twice (after a restart upstream) and dropped
        self.recoveries = 0  # sidecars this loader started again after one died
        self.wait_s = 0.0  # time spent in __next__ waiting for batches
        self._stats = None  # StatsPublisher, from the first batch on
        m = self.job.mesh
        self._mesh = [m.dp, m.pp, m.cp, m.tp]
        self._done = False
        self.remote = remote or os.environ.get("OVERLORD_REMOTE") or None
        self._remote_reader = None
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
                    [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config), "--exit-when-idle",
                     *(["--resume"] if self._resume_at is not None else [])],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # outlives this rank: the other ranks still need it
                )
            deadline = time.monotonic() + self.timeout_s
            while not sidecar_running(self.job):
                if proc.poll() is not None:
                    said = [line for line in (run_dir / "sidecar.log").read_text(errors="replace").splitlines()
                            if line.startswith("overlord sidecar: ")]
                    raise RemoteRoleError(
                        f"rank {self.rank}: the sidecar this rank started (pid {proc.pid}) exited with "
                        f"{proc.returncode}" + (f": {said[-1][len('overlord sidecar: '):]}" if said else "")
                        + f"; see {run_dir / 'sidecar.log'}"
                    )
                if time.monotonic() > deadline:
                    raise RemoteRoleError(f"rank {self.rank}: the sidecar (pid {proc.pid}) did not start within {self.timeout_s:g}s")
                time.sleep(0.05)

    def _connect(self) -> Ring:
        name = client_ring(self.job, self.rank)
        if self.spawn_sidecar and not sidecar_running(self.job):
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
        ring.claim_consumer()
        self.sidecar_pid = ring.creator_pid
        if self._resume_at is not None:
            self._report_position()
        return ring

    def _report_position(self) -> None:
        """Tell a resuming sidecar where this rank stopped (it waits for every rank)."""
        from overlord.store import Keys

        self._control().hset(Keys(self.job.name).resume, f"position:{self.rank}", json.dumps(list(self._resume_at)))

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.remote is None and not self.job.multi_node and self._ring is None and not self._done:
            self._ring = self._connect()
        return self

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
                        raise RemoteRoleError(f"{origin}: the Data Constructor feeding this rank died: {detail}") from None
                    time.sleep(0.01)  # the sidecar restarts it; it sends the unfinished step again
                    continue
                if time.monotonic() > deadline:
                    deadline = self._slow_or_hung(origin, f"sidecar pid {ring.creator_pid}",
                                                  "see the logs in the run directory")
            except RingError as exc:
                raise RemoteRoleError(f"{origin}: {exc}") from None

    def _read_remote(self):
        """The next record over Flight, or None at the end of the job."""
        from overlord.remote.flight import RemoteReader, job_token

        if self._remote_reader is None:
            if self._resume_at is not None:
                raise ConfigError("load_state_dict() with a remote DataLoader is not supported yet; read from the local ring")
            self._remote_reader = RemoteReader(self.job, self.remote, self.rank, token=job_token(self.job),
                                               after=self._last, timeout_s=self.timeout_s)
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
        warnings.warn(
            f"rank {self.rank}: the sidecar (pid {self._ring.creator_pid}) died; starting another that resumes "
            f"at step {self._resume_at[0]} micro-batch {self._resume_at[1]}"
        )
        self._ring.close()  # batches the trainer still holds keep their mapping
        self._ring = None
        self._redis = None
        self.recoveries += 1
        self._ring = self._connect()
        return self._ring

    def _slow_or_hung(self, origin: str, serving: str, look: str) -> float:
        """After `timeout_s` without a batch: a new deadline when the Data Constructor host
        feeding this rank turned its loop within that time (slow, not hung: it waits on
        roles that answer for themselves the same way, so a hang upstream still reaches
        the trainer as an error), else RemoteRoleError naming what serves the rank."""
        from overlord.sidecar.flow import alive_within
        from overlord.store import Keys

        try:
            turning = alive_within(self._control(), Keys(self.job.name), "constructor", self._host, self.timeout_s)
        except OverlordError:
            turning = False  # no control path either: report the stall
        if turning:
            warnings.warn(f"{origin}: no batch for {self.timeout_s:g}s; the pipeline is slow, not hung")
            return time.monotonic() + self.timeout_s
        raise RemoteRoleError(
            f"{origin}: no batch within {self.timeout_s:g}s ({serving}) and its Data Constructor host "
            f"(constructor{self._host}) has not turned its loop for as long: run `overlord status` and {look}"
        ) from None

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
        raise TypeError("overlord.torch.DataLoader has no length: sources are mixed by weight step by step")

    # -- metrics for dynamic mixing ---------------------------------------------------

    def report_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Tell the Planner this rank's latest metrics (e.g. {"loss/web": 2.31}).

        A `mixing: {kind: dynamic}` schedule reads them (mean over ranks) to set the
        weights of later steps. One small Redis write; never on the data path.
        """
        from overlord.store import Keys

        record = {"step": self.last_meta.get("step", -1) if step is None else step,
                  "metrics": {k: float(v) for k, v in metrics.items()}}
        self._control().hset(Keys(self.job.name).metrics, str(self.rank), json.dumps(record))

    # -- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position this rank has consumed (step, micro-batch, batches)."""
        return {
            "job": self.job.name,
            "rank": self.rank,
            "batches": self.batches,
            "step": self.last_meta.get("step", self._loaded[0]),
            "microbatch": self.last_meta.get("microbatch", self._loaded[1]),
            "mesh": self._mesh,
            "micro_batches": self.job.batch.micro_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the batch after `state` (from `state_dict()`), with identical bytes.

        Call it before iterating, on every rank, with a sidecar started with `--resume`
        (a sidecar this loader spawns is). The sidecar continues from the planner
        checkpoint of the earliest rank's step, kept in Redis across restarts.

        A state from a different mesh (another DP size) is accepted at a step boundary:
        the job continues exactly once from the Planner's per-source cursors, on the
        new mesh (its bytes then differ from the old mesh's, as they must).

        Raises:
            OverlordError: iteration already began.
            ConfigError: the state belongs to another job or rank, or to another mesh
                and not at a step boundary.
        """
        if self._ring is not None or self.batches:
            raise OverlordError("load_state_dict() must be called before iterating the DataLoader")
        same_mesh = state.get("mesh", self._mesh) == self._mesh
        if state.get("job") != self.job.name or (same_mesh and state.get("rank") != self.rank):
            raise ConfigError(
                f"state is for job {state.get('job')!r} rank {state.get('rank')}, "
                f"not job {self.job.name!r} rank {self.rank}"
            )
        if not state.get("batches"):
            return  # nothing consumed yet: a fresh start
        if self.job.multi_node:
            raise ConfigError("load_state_dict() on a job on several nodes is not supported yet: a node that "
                              "restarts rejoins the running job by itself; restart a stopped job fresh")
        last_mb = self.job.batch.micro_batches - 1
        if not same_mesh and (state.get("micro_batches") != self.job.batch.micro_batches or state["microbatch"] != last_mb):
            # the Planner's cursors are per source, not per rank: a new mesh can continue
            # from them, but only where every old rank had finished the same step
            raise ConfigError(
                f"resuming job {self.job.name!r} on mesh dp/pp/cp/tp={self._mesh} from a state of mesh "
                f"{state.get('mesh')} needs a state taken at a step boundary (after micro-batch {last_mb} of a step, "
                f"with the same micro_batches); this one stopped at step {state['step']} micro-batch "
                f"{state['microbatch']}. Save the loader state right after a step's last micro-batch"
            )
        self._loaded = self._last = (int(state["step"]), int(state["microbatch"]))
        step, mb = int(state["step"]), int(state["microbatch"]) + 1
        if mb == self.job.batch.micro_batches:
            step, mb = step + 1, 0
        self._resume_at = (step, mb)
        self.batches = int(state["batches"])

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

