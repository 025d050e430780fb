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

import json
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from overlord.config import Job
from overlord.errors import ConfigError, OverlordError, RemoteRoleError
from overlord.shm import Ring, decode_batch
from overlord.store import Keys
from overlord.torch import compat, launch
from overlord.torch import state as states
from overlord.torch.control import Control
from overlord.torch.local import Leases, LocalReader
from overlord.torch.nodes import ServingNodeReader
from overlord.torch.remote import FlightReader
from overlord.torch.sidecar import NodeSidecar
from overlord.torch.stats import StatsPublisher, ring_of, totals_of
from overlord.torch.watchdog import Watchdog


class Reader(Protocol):
    """How a DataLoader reaches its rank's records: from its ring on this node
    (overlord.torch.local), from a sidecar at a given location over Flight
    (overlord.torch.remote), or from whichever node serves it on a job of several nodes
    (overlord.torch.nodes)."""

    ring: Ring | None  # the ring on this node read now, if any
    sidecar_pid: int | None  # the sidecar that made that ring

    def read(self, after: tuple[int, int], *, final: bool, resuming: bool) -> Any:
        """The next record's view, or None at the end of the job. `after`: the last batch
        delivered ((-1, -1): none), `final`: whether it was the job's last, `resuming`:
        whether a state was loaded or a sidecar died (a sidecar must resume for it)."""
        ...

    def drop_ring(self) -> None:
        """Detach from the ring on this node, if any; the next read attaches again."""
        ...

    def close(self) -> None: ...


class DataLoader:
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
        self._loaded = (-1, -1)  # (step, micro-batch) of the last batch before a resume
        self._position = states.Position()  # the loaded state's (or the start's) position
        self._total: int | None = None  # micro-batches of a finite job per rank, once counted
        self._last = (-1, -1)  # (step, micro-batch) of the last batch delivered
        self.dropped = 0  # micro-batches received twice (after a restart upstream) and dropped
        self.wait_s = 0.0  # time spent in __next__ waiting for batches
        self._stats: StatsPublisher | None = None  # from the first batch on
        self._done = False
        self.remote = remote or os.environ.get("OVERLORD_REMOTE") or None
        # the Data Constructor host of this rank's DP group (several nodes: where it runs
        # says which node serves the rank)
        first = self.job.mesh.ranks_of_dp(self.coords["dp"])[0]
        host = self.job.node_ids.index(self.job.node_of_rank(first))
        # its collaborators, none of which refers back to it (a dropped DataLoader is
        # freed at once, and detaches)
        self._control = Control(self.job)  # the job's Redis, opened on first use
        self._watchdog = Watchdog(self.job, self._control, host=host, timeout_s=self.timeout_s, rank=self.rank)
        self._sidecar = NodeSidecar(
            self.job, self.rank, self._control, timeout_s=self.timeout_s, may_spawn=spawn_sidecar
        )
        self._leases = Leases()
        self._reader: Reader
        if self.remote is not None:
            self._reader = FlightReader(self.job, self.rank, self.remote, timeout_s=self.timeout_s)
        elif self.job.multi_node:
            self._reader = ServingNodeReader(
                self.job,
                self.rank,
                host=host,
                control=self._control,
                sidecar=self._sidecar,
                leases=self._leases,
                watchdog=self._watchdog,
                timeout_s=self.timeout_s,
            )
        else:
            self._reader = LocalReader(
                self.job,
                self.rank,
                sidecar=self._sidecar,
                leases=self._leases,
                watchdog=self._watchdog,
                timeout_s=self.timeout_s,
                how=self.launcher.how,
            )

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """This loader (one pass over the whole job). Nothing is attached until the first
        batch is asked for, so `load_state_dict()` may still follow (Lightning checks
        that a loader is iterable before it loads the checkpoint's state)."""
        if self._done and self._position.end and self._sidecar.resume_at is not None and self._reader.ring is None:
            self._sidecar.report_end(local=not isinstance(self._reader, FlightReader))
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        if self._stats is None:
            ref = weakref.ref(self)
            # a rank reading its ring on this node leaves its figures in the ring's
            # consumer note (its Data Constructor host publishes them): no Redis here
            noted = ring_of(ref) if isinstance(self._reader, LocalReader) else None
            self._stats = self._watchdog.stats = StatsPublisher(self.job, self.rank, totals_of(ref), ring=noted)
        while True:
            view = self._reader.read(
                self._last, final=bool(self.last_meta.get("last")), resuming=self._sidecar.resume_at is not None
            )
            if view is None:
                self._finish()
                raise StopIteration
            arrays, meta = decode_batch(view)
            position = (meta["step"], meta["microbatch"])
            if position > self._last:
                break
            self.dropped += 1  # a restarted Data Constructor sent it again
            ring = self._reader.ring
            if ring is not None:
                # The rank may have had it from elsewhere (another node's stream, while
                # this node's constructor host ran there): the mark of the ring it reads
                # now must say how far it is, or the Planner, bound by that mark, plans
                # nothing more while the rank waits for the next step (a deadlock).
                ring.set_consumer_mark(max(ring.consumer_mark, self._last[0] + 1))
            del view, arrays  # the dropped record's lease ends now, not at the next batch
        if self.job.multi_node and position > states.Position(*self._last).next(self.job.batch.micro_batches):
            raise RemoteRoleError(
                f"rank {self.rank} of job {self.job.name!r}: after step {self._last[0]} micro-batch {self._last[1]} "
                f"the next batch from node {self.serving_node!r} is step {position[0]} micro-batch {position[1]}: "
                "batches were lost (the node serving this rank died while it was away from its own node's ring)"
            )
        self._last = position
        self.last_meta = meta
        self.batches += 1
        ring = self._reader.ring
        if ring is not None:  # the Data Constructor tells the Planner how far trainers are
            ring.set_consumer_mark(position[0] + 1)
        self.wait_s += time.perf_counter() - started
        # Zero-copy: the tensors lease the ring record they view until the last of them
        # (or anything made from them) is freed; see overlord.shm._lease.
        batch = {name: torch.from_numpy(a) for name, a in arrays.items()}
        if self.pin_memory:
            return {k: v.pin_memory() for k, v in batch.items()}
        if self.copy:
            return {k: v.clone() for k, v in batch.items()}
        return batch

    def _finish(self) -> None:
        self._done = True
        if self._stats is not None:
            self._stats.stop()
            self._stats = self._watchdog.stats = None
        self._reader.close()

    def close(self) -> None:
        """Detach from the ring (the sidecar keeps serving other ranks). Batches the
        trainer still holds stay valid: their mapping lives as long as they do."""
        self._finish()

    @property
    def copies(self) -> int:
        """Batches copied out of the ring because the trainer held more than it can lease."""
        return self._leases.copies

    @property
    def sidecar_pid(self) -> int | None:
        """The pid of the sidecar whose ring on this node this rank read last (None before)."""
        return self._reader.sidecar_pid

    @property
    def recoveries(self) -> int:
        """Sidecars this loader started again after one died (a job on one node)."""
        return self._reader.recoveries if isinstance(self._reader, LocalReader) else 0

    @property
    def serving_node(self) -> str | None:
        """The node this rank reads from now (a job on several nodes; else None)."""
        return self._reader.serving_node if isinstance(self._reader, ServingNodeReader) else None

    @property
    def switches(self) -> int:
        """Times this rank changed nodes: its sidecar died, or came back (several nodes)."""
        return self._reader.switches if isinstance(self._reader, ServingNodeReader) else 0

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
        record = {
            "step": self.last_meta.get("step", -1) if step is None else step,
            "metrics": {k: float(v) for k, v in metrics.items()},
        }
        self._control.client().hset(Keys(self.job.name).metrics, str(self.rank), json.dumps(record))

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
        (each rank loads a state); any other is refused, saying what to do. On a job of
        several nodes the nodes' sidecars serve it: one started with `--resume` waits for
        the positions, and running ones go back to them together (a rewind, e.g. after
        a node was lost with its trainers and torchrun restarted every rank: see
        overlord.sidecar.rewind). A state saved after the job's last batch resumes to an
        immediate end: StopIteration at once, `len()` 0.

        A state from a different mesh (another DP size) is accepted at a step boundary:
        the job continues exactly once from the Planner's per-source cursors, on the
        new mesh (its bytes then differ from the old mesh's, as they must).

        Raises:
            OverlordError: this DataLoader already yielded a batch.
            ConfigError: the state belongs to another job, or to another mesh and not at
                a step boundary.
        """
        if self._last != self._loaded:
            raise OverlordError(
                f"load_state_dict() after rank {self.rank}'s DataLoader yielded a batch (step {self._last[0]} "
                f"micro-batch {self._last[1]}): load the state before the first batch, or make a new DataLoader"
            )
        position = states.load(self.job, self.rank, state)
        self._reader.drop_ring()  # attached by a next() that yielded nothing: attach again
        self._position = position
        self._loaded = self._last = position.last
        self.batches = position.batches
        self._sidecar.resume_at = position.next(self.job.batch.micro_batches) if position.batches else None
        self._done = position.end

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
