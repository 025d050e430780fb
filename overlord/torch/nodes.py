"""The DataLoader's reading on a job of several nodes (mixed into
overlord.torch.DataLoader, whose `job`, `rank`, `timeout_s`, `coords`, `last_meta`,
`_ring`, `_remote_reader`, `_last`, `_host`, `serving_node`, `switches`, `_drained`,
`_control`, `_spawn` and `_slow_or_hung` it uses).

A rank reads from wherever its Data Constructor host runs: its own node's ring, or
another node's over Arrow Flight while its node's sidecar is down. A ring whose
sidecar died is read to its end first (its batches were built and nobody builds them
again); then the placement says where to go on, and batches already delivered are
dropped by position.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from overlord.errors import PeerDied, RemoteRoleError, RingClosed, RingError, RingTimeout
from overlord.runtime.layout import client_ring
from overlord.shm import Ring
from overlord.shm import pid_alive as alive
from overlord.sidecar.sidecar import sidecar_running

if TYPE_CHECKING:  # typing only: pyarrow.flight loads when a rank first reads over Flight
    from overlord.config import Job
    from overlord.remote.flight import RemoteReader
    from overlord.shm._lease import LeasedReader

_SLICE_S = 0.5  # how often a waiting client checks that its sidecar still lives
_GONE = object()  # the source was read to its end; look up the next one
_AGAIN = object()  # nothing yet; wait on


class NodeReader:
    """Reading this rank's micro-batches on a job of several nodes (mixed into
    overlord.torch.DataLoader, whose attributes and methods below it uses)."""

    # what the DataLoader provides (see DataLoader.__init__)
    job: Job
    rank: int
    coords: dict[str, int]
    timeout_s: float
    spawn_sidecar: bool
    last_meta: dict[str, Any]
    sidecar_pid: int | None
    serving_node: str | None
    switches: int
    _ring: Ring | None
    _remote_reader: RemoteReader | None
    _host: int
    _drained: set[int]
    _last: tuple[int, int]
    _control: Callable[[], Any]
    _spawn: Callable[[], None]
    _leases_for: Callable[[Ring], LeasedReader]
    _slow_or_hung: Callable[[str, str, str], float]

    def _next_of(self, position: tuple[int, int]) -> tuple[int, int]:
        step, mb = position
        return (step + 1, 0) if mb + 1 >= self.job.batch.micro_batches else (step, mb + 1)

    def _read_nodes(self):
        """Several nodes: the next record from wherever this rank's Data Constructor
        runs: this node's ring, or another node's over Flight while this node's
        sidecar is down. A source that ends without the job's last batch (its
        constructor stopped there, or the sidecar died) was read to its end first;
        then the placement says where to go on, and batches already delivered are
        dropped by position. None at the end of the job."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._ring is None and self._remote_reader is None:
                self._attach_nodes(deadline)
            got = self._read_local_node() if self._ring is not None else self._read_remote_node()
            if got is not _GONE:
                if got is not _AGAIN:
                    return got
            else:
                self.switches += 1
                time.sleep(0.02)  # the node it read from is changing: look again shortly
            if time.monotonic() > deadline:
                deadline = self._slow_or_hung(
                    f"rank {self.rank} (dp={self.coords['dp']}) of job {self.job.name!r}",
                    f"from node {self.serving_node!r}",
                    f"the sidecar log of node {self.serving_node!r}",
                )

    def _attach_nodes(self, deadline: float) -> None:
        """Open the source this rank reads: its node's ring, or Flight to the node that
        runs its Data Constructor host now."""
        from overlord.remote.flight import RemoteReader, job_token
        from overlord.sidecar.membership import clear_dead
        from overlord.store import Keys

        keys = Keys(self.job.name)
        r = self._control()
        while True:
            node = r.hget(keys.placement, f"constructor{self._host}")
            node = node.decode() if node is not None else None
            if node == self.job.node or node is None:
                ring = self._attach_local()  # also a dead sidecar's ring: what it holds comes first
                if ring is not None:
                    self._ring, self.serving_node = ring, self.job.node
                    return
                if not sidecar_running(self.job):
                    clear_dead(r, keys, self.job.node)  # so the Planner moves this node's roles now
                    if self.spawn_sidecar:
                        self._spawn()
            else:
                raw = r.hget(keys.nodes, node)
                location = json.loads(raw).get("flight") if raw else None
                if location:
                    self._remote_reader = RemoteReader(
                        self.job,
                        location,
                        self.rank,
                        token=job_token(self.job, r=r),
                        after=self._last,
                        timeout_s=self.timeout_s,
                        open_timeout_s=1.0,
                    )
                    if self.serving_node is not None and node != self.serving_node:
                        warnings.warn(f"rank {self.rank}: reading from node {node!r} over Flight", stacklevel=2)
                    self.serving_node = node
                    return
            if time.monotonic() > deadline:
                raise RemoteRoleError(
                    f"rank {self.rank} of job {self.job.name!r}: no node ran its Data Constructor host "
                    f"(constructor{self._host}, placed on {node!r}) within {self.timeout_s:g}s; "
                    "run `overlord status` on any node"
                )
            time.sleep(0.05)

    def _attach_local(self) -> Ring | None:
        """This rank's ring on this node: a live sidecar's, or once, to read it to its
        end, the one a dead sidecar left (its records were built; nobody builds them again)."""
        try:
            ring = Ring.attach(client_ring(self.job, self.rank), timeout=_SLICE_S)
        except RingTimeout:
            return None
        if not alive(ring.creator_pid) and (ring.creator_pid in self._drained or ring.pending() == 0):
            self._drained.add(ring.creator_pid)
            ring.close()  # read to its end already; the next sidecar replaces it
            return None
        ring.claim_consumer(take_over=not alive(ring.creator_pid))
        self.sidecar_pid = ring.creator_pid
        return ring

    def _read_local_node(self):
        ring = self._ring
        if ring is None:
            return _GONE
        try:
            return self._leases_for(ring).read(timeout=_SLICE_S)
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
            self._ring = None
            return _GONE
        except RingError as exc:
            raise RemoteRoleError(f"rank {self.rank} of job {self.job.name!r}: {exc}") from None

    def _placed_here(self) -> bool:
        from overlord.store import Keys

        node = self._control().hget(Keys(self.job.name).placement, f"constructor{self._host}")
        return node is None or node.decode() == self.job.node

    def _read_remote_node(self):
        reader = self._remote_reader
        if reader is None:
            return _GONE
        try:
            return next(reader)
        except StopIteration:
            end = bool(self.last_meta.get("last"))
        except RingTimeout:
            return _AGAIN
        except Exception as exc:  # noqa: BLE001 - pyarrow.flight: the serving node went away
            warnings.warn(
                f"rank {self.rank}: Flight stream from node {self.serving_node!r} broke: {str(exc).splitlines()[0]}",
                stacklevel=2,
            )
            end = False
        reader.close()
        self._remote_reader = None
        return None if end else _GONE
