"""Start-up checks: what a sidecar needs from its host, checked before it starts
anything, each failure with what to change.

- **Shared memory.** Every ring lives in `/dev/shm`. Docker gives a container 64 MiB
  there by default, far less than a job's rings: the first write past it would kill
  the writer with SIGBUS mid-job. Each ring's pages are reserved when the sidecar
  creates it (overlord.shm), so the check compares the bytes of every ring this
  node's sidecar creates with what is free in /dev/shm now (this job's own segments,
  which a start replaces, counted as free), as well as with the filesystem's size.
- **Redis.** The configured Redis must answer a PING within a few seconds.
- **Sources.** Every source's paths must match at least one file.

`overlord check --config job.yaml` runs them all and prints each result; the sidecar
runs them on start and refuses to start with the first problem.
"""

from __future__ import annotations

import logging
import os

from overlord.config import Job
from overlord.errors import OverlordError, StartupError
from overlord.shm import list_segments, segment_bytes

log = logging.getLogger("overlord.checks")

SHM_PATH = "/dev/shm"
MIB = 1 << 20


def ring_bytes(job: Job, loaders: int) -> int:
    """The most this node's rings may hold: the rings from the loader processes it runs
    to every DP group, and the client rings of its ranks. On several nodes a node runs
    its share of the loader processes (their home placement); the rings of the others
    stay empty unless a loader moves here."""
    if job.multi_node:
        loaders = -(-loaders // len(job.node_ids))
    ranks = job.ranks_of_node(job.node) if job.multi_node else range(job.mesh.world_size)
    return loaders * job.mesh.dp * job.sample_ring_bytes + len(ranks) * job.batch.ring_bytes


def shm_problem(needed: int, total: int, free: int, path: str = SHM_PATH) -> tuple[str | None, str | None]:
    """(error, warning) for rings of `needed` bytes on a filesystem of `total` bytes
    with `free` bytes free (pure)."""
    fix = (f"give the sidecar more shared memory: `docker run --shm-size={_size(needed * 5 // 4)}` "
           f"(compose: shm_size), a larger tmpfs on {path}, or smaller Job.sample_ring_bytes / batch.ring_bytes")
    if needed > total:
        return (f"the job's rings may hold {_size(needed)} but {path} is only {_size(total)} "
                f"(Docker's default is 64m); {fix}", None)
    if needed > free:
        return (None, f"the job's rings may hold {_size(needed)} and {path} has {_size(free)} free now "
                      f"(of {_size(total)}); if they fill, a writer dies with SIGBUS: {fix}")
    return None, None


def _size(n: int) -> str:
    return f"{max(1, -(-n // MIB))}m" if n < 1 << 30 else f"{n / (1 << 30):.1f}g"


def check_shm(job: Job, loaders: int, path: str = SHM_PATH) -> None:
    st = os.statvfs(path)
    error, warning = shm_problem(ring_bytes(job, loaders), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, path)
    if error:
        raise StartupError(f"job {job.name!r} on node {job.node!r}: {error}")
    check_shm_reservation(job, loaders, path)
    if warning:
        log.warning("job %r: %s", job.name, warning)


def reserved_ring_bytes(job: Job, loaders: int) -> int:
    """The /dev/shm bytes this node's sidecar reserves: a segment per ring from every
    loader process to every DP group (on several nodes too: a loader may move here)
    and per client ring of its ranks, each its header page plus its capacity rounded
    up to a power of two (overlord.shm.segment_bytes)."""
    return (loaders * job.mesh.dp * segment_bytes(job.sample_ring_bytes)
            + _client_rings(job) * segment_bytes(job.batch.ring_bytes))


def _client_rings(job: Job) -> int:
    return len(job.ranks_of_node(job.node)) if job.multi_node else job.mesh.world_size


def check_shm_reservation(job: Job, loaders: int, path: str = SHM_PATH) -> None:
    """Refuse a start whose rings cannot all be reserved in `path` now.

    Raises:
        StartupError: naming the bytes the rings reserve, what is free, and the fix.
    """
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    own = 0  # this job's segments left in place: a start replaces them
    for name in list_segments(job.name):
        try:
            own += os.stat(os.path.join(path, name.lstrip("/"))).st_blocks * 512
        except OSError:
            pass
    needed = reserved_ring_bytes(job, loaders)
    if needed > free + own:
        raise StartupError(
            f"job {job.name!r} on node {job.node!r}: its rings reserve {_size(needed)} ({needed} B: "
            f"{loaders} loader process(es) x {job.mesh.dp} DP group(s) of Job.sample_ring_bytes="
            f"{job.sample_ring_bytes} and {_client_rings(job)} "
            f"client ring(s) of BatchSpec.ring_bytes={job.batch.ring_bytes}, each rounded up to a power of two) "
            f"but {path} has {_size(free + own)} free ({free + own} B of {st.f_blocks * st.f_frsize} B); give the "
            f"sidecar more shared memory (`docker run --shm-size={_size((needed + st.f_blocks * st.f_frsize - free - own) * 5 // 4)}`, "
            f"compose shm_size, a larger tmpfs on {path}) or lower Job.sample_ring_bytes / BatchSpec.ring_bytes"
        )


def check_redis(url: str, timeout_s: float = 5.0) -> None:
    from overlord.errors import StoreError
    from overlord.store import connect

    try:
        connect(url, timeout_s=timeout_s, ride_through_s=0).close()
    except StoreError as exc:
        raise StartupError(f"{exc}: start it, and check that this host may reach it (address, firewall, the ACL "
                           "user and password; TLS: rediss:// with $OVERLORD_REDIS_CA)") from None


def check_sources(job: Job) -> None:
    for source in job.sources:
        try:
            files = source.files()
        except OverlordError as exc:
            raise StartupError(str(exc)) from None
        if not files:
            raise StartupError(f"source {source.name!r}: paths {list(source.paths)} match no file; fix Source.paths")


def run_checks(job: Job, loaders: int, redis_url: str | None) -> list[tuple[str, str | None]]:
    """Every check as (name, problem or None); `redis_url` None skips Redis (embedded)."""
    checks = [("shared memory", lambda: check_shm(job, loaders))]
    if redis_url:
        checks.append(("redis", lambda: check_redis(redis_url)))
    checks.append(("sources", lambda: check_sources(job)))
    results = []
    for name, check in checks:
        try:
            check()
            results.append((name, None))
        except StartupError as exc:
            results.append((name, str(exc)))
    return results
