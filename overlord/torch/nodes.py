"""Reading a rank's micro-batches on a job of several nodes.

A rank reads from wherever its Data Constructor host runs: its own node's ring, or
another node's over Arrow Flight while its node's sidecar is down. A ring whose
sidecar died is read to its end first (its batches were built and nobody builds them
again); then the placement says where to go on, and batches already delivered are
dropped by position (the DataLoader compares them). The node's dead processes are
cleared from Redis as soon as the rank sees its sidecar dead, not once the ring is
read to its end: the other nodes take over this node's roles (and their shadows this
node's Source Loaders) while the rank still reads what was built, so the trainer
waits only for what the takeover takes beyond that.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import TYPE_CHECKING, Any

from overlord.config import Job
from overlord.errors import PeerDied, RemoteRoleError, RingClosed, RingError, RingTimeout
from overlord.runtime.layout import client_ring
from overlord.shm import Ring
from overlord.shm import pid_alive as alive
from overlord.store import Keys
from overlord.torch.control import Control
from overlord.torch.local import SLICE_S, Leases
from overlord.torch.sidecar import NodeSidecar
from overlord.torch.watchdog import Watchdog

if TYPE_CHECKING:  # typing only: pyarrow.flight loads when a rank first reads over Flight
    from overlord.remote.flight import RemoteReader

LOOK_S = 0.1  # between two looks at whether the sidecar of the ring read is alive
PLACEMENT_CHECK_S = 2.0  # how often a rank waiting on another node's stream looks where its constructor runs
_GONE = object()  # the source was read to its end; look up the next one
_AGAIN = object()  # nothing yet; wait on


class ServingNodeReader:
    """Rank `rank`'s records from the node that serves it now: the one that runs the
    Data Constructor host `host` (its index) of the rank's DP group."""

    def __init__(
        self,
        job: Job,
        rank: int,
        *,
        host: int,
        control: Control,
        sidecar: NodeSidecar,
        leases: Leases,
        watchdog: Watchdog,
        timeout_s: float,
    ) -> None:
        self.job, self.rank, self.host, self.timeout_s = job, rank, host, timeout_s
        self.control, self.sidecar, self.leases, self.watchdog = control, sidecar, leases, watchdog
        self.origin = f"rank {rank} (dp={job.mesh.coords(rank)['dp']}) of job {job.name!r}"
        self.ring: Ring | None = None  # this node's ring, while the rank reads it
        self.sidecar_pid: int | None = None
        self.serving_node: str | None = None  # the node this rank reads from now
        self.switches = 0  # times it changed nodes (its sidecar died, or came back)
        self._stream: RemoteReader | None = None  # another node's, over Flight
        self._drained: set[int] = set()  # dead sidecars whose ring for this rank was read to its end
        self._cleared: set[int] = set()  # dead sidecars whose node's dead processes were cleared
        self._looked = 0.0  # when the ring's sidecar was last looked at (monotonic)
        self._told = False  # a loaded state's position reached the job (NodeSidecar.resume_job)

    def read(self, after: tuple[int, int], *, final: bool = False, resuming: bool = False) -> Any:
        """The next record from wherever this rank's Data Constructor runs: this node's
        ring, or another node's over Flight while this node's sidecar is down. A source
        that ends without the job's last batch (its constructor stopped there, or the
        sidecar died) was read to its end first; then the placement says where to go on.
        `after`: the last batch delivered, `final`: whether it was the job's last. None
        at the end of the job."""
        if resuming and not self._told:
            self.sidecar.resume_job()  # before any source is opened: the job may go back first
            self._told = True
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.ring is None and self._stream is None:
                self._attach(after, deadline)
            if self.ring is not None:
                self._look_at_sidecar(self.ring)
            got = self._read_local() if self.ring is not None else self._read_remote(final)
            if got is not _GONE:
                if got is not _AGAIN:
                    return got
            else:
                self.switches += 1
                time.sleep(0.02)  # the node it read from is changing: look again shortly
            if time.monotonic() > deadline:
                deadline = self.watchdog.slow_or_hung(
                    self.origin,
                    f"from node {self.serving_node!r}",
                    f"the sidecar log of node {self.serving_node!r}",
                )

    def _attach(self, after: tuple[int, int], deadline: float) -> None:
        """Open the source this rank reads: its node's ring, or Flight to the node that
        runs its Data Constructor host now (the stream starts after `after`)."""
        # deferred: pyarrow.flight is heavy and only a rank reading over Flight needs it
        from overlord.remote.endpoint import job_token
        from overlord.remote.flight import RemoteReader

        keys = Keys(self.job.name)
        r = self.control.client()
        while True:
            node = r.hget(keys.placement, f"constructor{self.host}")
            node = node.decode() if node is not None else None
            if node == self.job.node or node is None:
                ring = self._attach_local()  # also a dead sidecar's ring: what it holds comes first
                if ring is not None:
                    self.ring, self.serving_node = ring, self.job.node
                    return
                if not self.sidecar.running():
                    # deferred: membership brings the autoscaler and the loaders, for a dead sidecar only
                    from overlord.sidecar.membership import clear_dead

                    clear_dead(r, keys, self.job.node)  # so the Planner moves this node's roles now
                    if self.sidecar.may_spawn:
                        self.sidecar.spawn()
            else:
                raw = r.hget(keys.nodes, node)
                location = json.loads(raw).get("flight") if raw else None
                if location:
                    self._stream = RemoteReader(
                        self.job,
                        location,
                        self.rank,
                        token=job_token(self.job, r=r),
                        after=after,
                        # a RingTimeout this often: the rank looks at the placement again
                        # (the Data Constructor host may have moved on; see _read_remote)
                        timeout_s=min(self.timeout_s, PLACEMENT_CHECK_S),
                        open_timeout_s=1.0,
                    )
                    if self.serving_node is not None and node != self.serving_node:
                        warnings.warn(f"rank {self.rank}: reading from node {node!r} over Flight", stacklevel=2)
                    self.serving_node = node
                    return
            if time.monotonic() > deadline:
                raise RemoteRoleError(
                    f"rank {self.rank} of job {self.job.name!r}: no node ran its Data Constructor host "
                    f"(constructor{self.host}, placed on {node!r}) within {self.timeout_s:g}s; "
                    "run `overlord status` on any node"
                )
            time.sleep(0.05)

    def _look_at_sidecar(self, ring: Ring) -> None:
        """At most every LOOK_S: where the sidecar that made `ring` died, clear its node's
        dead processes now (once), while the rank reads on what the ring holds."""
        now = time.monotonic()
        if now - self._looked < LOOK_S:
            return
        self._looked = now
        pid = ring.creator_pid
        if pid in self._cleared or alive(pid):
            return
        self._cleared.add(pid)
        # deferred: membership brings the autoscaler and the loaders, for a dead sidecar only
        from overlord.sidecar.membership import clear_dead

        clear_dead(self.control.client(), Keys(self.job.name), self.job.node)

    def _attach_local(self) -> Ring | None:
        """This rank's ring on this node: a live sidecar's, or once, to read it to its
        end, the one a dead sidecar left (its records were built; nobody builds them again)."""
        try:
            ring = Ring.attach(client_ring(self.job, self.rank), timeout=SLICE_S)
        except RingTimeout:
            return None
        if not alive(ring.creator_pid) and (ring.creator_pid in self._drained or ring.pending() == 0):
            self._drained.add(ring.creator_pid)
            ring.close()  # read to its end already; the next sidecar replaces it
            return None
        ring.claim_consumer(take_over=not alive(ring.creator_pid))
        self.sidecar_pid = ring.creator_pid
        return ring

    def _read_local(self) -> Any:
        ring = self.ring
        if ring is None:
            return _GONE
        try:
            return self.leases.of(ring).read(timeout=SLICE_S)
        except RingClosed:
            return None
        except (RingTimeout, PeerDied) as exc:
            if ring.error:
                raise RemoteRoleError(f"rank {self.rank} of job {self.job.name!r}: {ring.error}") from None
            if alive(ring.creator_pid):
                if isinstance(exc, RingTimeout) or self._placed_here():
                    if isinstance(exc, PeerDied):
                        time.sleep(0.01)  # its constructor restarts here; it sends the unfinished step again
                    return _AGAIN
            else:  # read to its end: this node's sidecar died
                self._drained.add(ring.creator_pid)
                warnings.warn(
                    f"rank {self.rank}: the sidecar of node {self.job.node!r} (pid {ring.creator_pid}) died; "
                    "reading from the node that takes over its Data Constructor",
                    stacklevel=2,
                )
            ring.close()
            self.ring = None
            return _GONE
        except RingError as exc:
            raise RemoteRoleError(f"rank {self.rank} of job {self.job.name!r}: {exc}") from None

    def _placed_here(self) -> bool:
        return self._placed() in (None, self.job.node)

    def _placed(self) -> str | None:
        """The node the Planner places this rank's Data Constructor host on now."""
        node = self.control.client().hget(Keys(self.job.name).placement, f"constructor{self.host}")
        return node.decode() if node is not None else None

    def _read_remote(self, final: bool) -> Any:
        stream = self._stream
        if stream is None:
            return _GONE
        try:
            return next(stream)
        except StopIteration:
            end = final
        except RingTimeout:
            # A node that stops running the Data Constructor host (it moved: this rank's
            # node is back, or the node was cut off) still serves its ring, which nobody
            # writes any more: the placement, not the stream, says when to go elsewhere.
            if self._placed() in (None, self.serving_node):
                return _AGAIN
            end = False
        except Exception as exc:  # noqa: BLE001 - pyarrow.flight: the serving node went away
            warnings.warn(
                f"rank {self.rank}: Flight stream from node {self.serving_node!r} broke: {str(exc).splitlines()[0]}",
                stacklevel=2,
            )
            end = False
        stream.close()
        self._stream = None
        return None if end else _GONE

    def drop_ring(self) -> None:
        """Detach from this node's ring; the next read looks up the source again."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.drop_ring()
