"""Reading a rank's micro-batches from its ring on this node: a job on one node.

The ring is attached on the first read (so `load_state_dict()` may come first), after
starting a sidecar if none runs and the rank may (overlord.torch.sidecar). Records are
read through a leasing reader: each batch holds its ring record until its last tensor
is freed (overlord.shm._lease).

A Data Constructor that the sidecar restarts sends its unfinished step again (the
DataLoader drops what it has). A sidecar killed outright (its ring's creator is dead,
no error in the ring) is started again by a rank that may spawn one, with `--resume`
at the batch after the last one delivered here; otherwise RemoteRoleError names it.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from overlord.config import Job
from overlord.errors import ConfigError, PeerDied, RemoteRoleError, RingClosed, RingError, RingTimeout
from overlord.runtime.layout import client_ring
from overlord.shm import Ring
from overlord.shm import pid_alive as alive
from overlord.shm._lease import LeasedReader
from overlord.torch.sidecar import NodeSidecar
from overlord.torch.watchdog import Watchdog

SLICE_S = 0.5  # how often a waiting client checks that its sidecar still lives


class Leases:
    """The leasing reader of the ring a rank reads (a new one for a new ring: a sidecar
    came back), and the copies all of them made."""

    def __init__(self) -> None:
        self._reader: LeasedReader | None = None
        self._copies_before = 0  # copies made by the leasing readers of earlier rings

    def of(self, ring: Ring) -> LeasedReader:
        """The leasing reader of `ring`."""
        if self._reader is None or self._reader.ring is not ring:
            if self._reader is not None:
                self._copies_before += self._reader.copies
            self._reader = LeasedReader(ring)
        return self._reader

    @property
    def copies(self) -> int:
        """Batches copied out of a ring because the trainer held more than it can lease."""
        return self._copies_before + (self._reader.copies if self._reader is not None else 0)


class LocalReader:
    """Rank `rank`'s records from its ring on this node (`how`: where the launcher put
    the rank, for a message when another process reads it already)."""

    def __init__(
        self,
        job: Job,
        rank: int,
        *,
        sidecar: NodeSidecar,
        leases: Leases,
        watchdog: Watchdog,
        timeout_s: float,
        how: str,
    ) -> None:
        self.job, self.rank, self.timeout_s, self.how = job, rank, timeout_s, how
        self.sidecar, self.leases, self.watchdog = sidecar, leases, watchdog
        self.origin = f"rank {rank} (dp={job.mesh.coords(rank)['dp']}) of job {job.name!r}"
        self.ring: Ring | None = None
        self.sidecar_pid: int | None = None
        self.recoveries = 0  # sidecars started again after one died

    def read(self, after: tuple[int, int], *, final: bool = False, resuming: bool = False) -> Any:
        """The next record's view, or None at the end of the job; `after`: the last batch
        delivered, where a sidecar started after one died resumes."""
        if self.ring is None:
            self.ring = self._attach()
        ring = self.ring
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.leases.of(ring).read(timeout=min(SLICE_S, max(0.001, deadline - time.monotonic())))
            except RingClosed:
                return None
            except (RingTimeout, PeerDied) as exc:
                if ring.creator_pid and not alive(ring.creator_pid) and not ring.error:
                    if self.sidecar.may_spawn:  # killed outright: start another that resumes here
                        ring = self._recover(ring, after)
                        deadline = time.monotonic() + self.timeout_s
                        continue
                    raise RemoteRoleError(
                        f"{self.origin}: the sidecar (pid {ring.creator_pid}) died; see {self.job.run_path}/sidecar.log "
                        "and the role logs there"
                    ) from None
                if isinstance(exc, PeerDied):
                    if ring.error or time.monotonic() > deadline:
                        detail = ring.error or str(exc)
                        raise RemoteRoleError(
                            f"{self.origin}: the Data Constructor feeding this rank died: {detail}"
                        ) from None
                    time.sleep(0.01)  # the sidecar restarts it; it sends the unfinished step again
                    continue
                if time.monotonic() > deadline:
                    deadline = self.watchdog.slow_or_hung(
                        self.origin, f"sidecar pid {ring.creator_pid}", "see the logs in the run directory"
                    )
            except RingError as exc:
                raise RemoteRoleError(f"{self.origin}: {exc}") from None

    def _attach(self) -> Ring:
        """Attach to this rank's ring, once a live sidecar serves it (one that will serve
        the batches after a loaded state), and claim it as its only reader."""
        name = client_ring(self.job, self.rank)
        if self.sidecar.resume_at is not None:
            self.sidecar.make_resumable()
        else:
            self.sidecar.ensure()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ring = Ring.attach(name, timeout=min(SLICE_S, max(0.01, deadline - time.monotonic())))
            except RingTimeout:
                ring = None
            if ring is not None and alive(ring.creator_pid):
                break
            if ring is not None:
                ring.close()  # left by a dead sidecar; the next one replaces it
            self.sidecar.ensure()  # the sidecar seen at first was on its way out (the job before a resume)
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
                f"this process (pid {os.getpid()}) took rank {self.rank} from {self.how}. Two trainers claim "
                "one rank: check what the launcher sets (RANK, or NODE_RANK/LOCAL_WORLD_SIZE/LOCAL_RANK), or pass "
                "DataLoader(rank=...)"
            ) from None
        self.sidecar_pid = ring.creator_pid
        self.sidecar.report_position()
        return ring

    def _recover(self, ring: Ring, after: tuple[int, int]) -> Ring:
        """Start the dead sidecar again, resuming at the batch after `after`."""
        step, mb = self.sidecar.died(after)
        warnings.warn(
            f"rank {self.rank}: the sidecar (pid {ring.creator_pid}) died; starting another that resumes "
            f"at step {step} micro-batch {mb}",
            stacklevel=2,
        )
        ring.close()  # batches the trainer still holds keep their mapping
        self.ring = None
        self.recoveries += 1
        self.ring = self._attach()
        return self.ring

    def drop_ring(self) -> None:
        """Detach from the ring; the next read attaches again."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def close(self) -> None:
        self.drop_ring()
