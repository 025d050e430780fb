"""Start-up checks: what a sidecar needs from its host, checked before it starts
anything, each failure with what to change.

- **Shared memory.** Every ring lives in `/dev/shm`. Docker gives a container 64 MiB
  there by default, far less than a job's rings: the first write past it would kill
  the writer with SIGBUS mid-job. Each ring's pages are reserved when the sidecar
  creates it (overlord.shm), so the check compares the bytes of every ring this
  node's sidecar creates with what is free in /dev/shm now (this job's own segments,
  which a start replaces, counted as free), as well as with the filesystem's size.
- **Redis.** The configured Redis must answer a PING within a few seconds.
- **Sources.** Every source's paths must match at least one file, and the job must be
  able to yield: a job whose sources all have 0 rows (an empty JSONL or Parquet file)
  would "complete" with no batch, and with `epochs: null` a source with 0 rows would
  stall the Planner, which waits for every source's samples. Counting stops at the
  first row of each source (a JSONL file is scanned, a Parquet footer read).
- **Transforms.** Every source's transform (and decode) imports and builds here, so a
  missing module, one that raises at import, a missing attribute or a failing
  `transform_args` factory is named with its source now, not by a loader at the first
  batch. The modules are imported into the checking process.

`overlord check --config job.yaml` runs them all and prints each result; the sidecar
runs them on start and refuses to start with the first problem.
"""

from __future__ import annotations

import logging
import os

import pyarrow as pa

from overlord.config import Job, Source
from overlord.errors import ConfigError, OverlordError, StartupError, StoreError
from overlord.loader.formats import FORMATS, locations
from overlord.shm import list_segments, segment_bytes
from overlord.store import connect
from overlord.transforms import build, resolve

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
    fix = (
        f"give the sidecar more shared memory: `docker run --shm-size={_size(needed * 5 // 4)}` "
        f"(compose: shm_size), a larger tmpfs on {path}, or smaller Job.sample_ring_bytes / batch.ring_bytes"
    )
    if needed > total:
        return (
            f"the job's rings may hold {_size(needed)} but {path} is only {_size(total)} "
            f"(Docker's default is 64m); {fix}",
            None,
        )
    if needed > free:
        return (
            None,
            f"the job's rings may hold {_size(needed)} and {path} has {_size(free)} free now "
            f"(of {_size(total)}); if they fill, a writer dies with SIGBUS: {fix}",
        )
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
    """The /dev/shm bytes this node's rings take when full: a segment per ring from every
    loader process to every DP group (on several nodes too: a loader may move here)
    and per client ring of its ranks, each its header page plus its capacity rounded
    up to a power of two (overlord.shm.segment_bytes)."""
    return loaders * job.mesh.dp * segment_bytes(job.sample_ring_bytes) + _client_rings(job) * segment_bytes(
        job.batch.ring_bytes
    )


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
    used_by_others = st.f_blocks * st.f_frsize - free - own
    if needed > free + own:
        raise StartupError(
            f"job {job.name!r} on node {job.node!r}: its rings reserve {_size(needed)} ({needed} B: "
            f"{loaders} loader process(es) x {job.mesh.dp} DP group(s) of Job.sample_ring_bytes="
            f"{job.sample_ring_bytes} and {_client_rings(job)} "
            f"client ring(s) of BatchSpec.ring_bytes={job.batch.ring_bytes}, each rounded up to a power of two) "
            f"but {path} has {_size(free + own)} free ({free + own} B of {st.f_blocks * st.f_frsize} B); give the "
            f"sidecar more shared memory (`docker run --shm-size={_size((needed + used_by_others) * 5 // 4)}`, "
            f"compose shm_size, a larger tmpfs on {path}) or lower Job.sample_ring_bytes / BatchSpec.ring_bytes"
        )


def check_redis(url: str, timeout_s: float = 5.0) -> None:
    try:
        connect(url, timeout_s=timeout_s, ride_through_s=0).close()
    except StoreError as exc:
        raise StartupError(
            f"{exc}: start it, and check that this host may reach it (address, firewall, the ACL "
            "user and password; TLS: rediss:// with $OVERLORD_REDIS_CA)"
        ) from None


def check_sources(job: Job) -> None:
    for source in job.sources:
        try:
            files = source.files()
        except OverlordError as exc:
            raise StartupError(str(exc)) from None
        if not files:
            raise StartupError(f"source {source.name!r}: paths {list(source.paths)} match no file; fix Source.paths")
    check_yield(job)


def source_rows(source: Source) -> tuple[int, list[str], list[str]]:
    """(rows, files, unreadable): whether the source has a row, counting file by file
    until the first file with rows; `files` are those looked at, `unreadable` those that
    did not open, each with its error (the Source Loader reports or skips them by
    `on_error`)."""
    fmt = FORMATS[source.format]()
    seen: list[str] = []
    unreadable: list[str] = []
    for loc in locations(source.name, source.format, source.paths):
        seen.append(loc.uri)
        try:
            rows = sum(fmt.open(loc, f"source {source.name!r} file {loc.uri!r}").group_rows())
        except (pa.ArrowException, OSError, OverlordError) as exc:
            unreadable.append(f"{loc.uri!r}: {exc}")
            continue
        if rows:
            return rows, seen, unreadable
    return 0, seen, unreadable


def yield_problem(job: Job, empty: dict[str, tuple[list[str], list[str]]]) -> tuple[str | None, str | None]:
    """(error, warning) for a job whose sources in `empty` (name -> (files, unreadable))
    have no row (pure)."""
    if not empty:
        return None, None

    def named(name: str) -> str:
        files, unreadable = empty[name]
        shown = ", ".join(repr(f) for f in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        more = f" and {len(unreadable) - 1} more" if len(unreadable) > 1 else ""
        bad = f" (unreadable: {unreadable[0]}{more})" if unreadable else ""
        return f"source {name!r} has 0 rows in its file(s) {shown}{bad}"

    what = "; ".join(named(n) for n in empty)
    if len(empty) == len(job.sources):
        return (
            f"job {job.name!r} has no data at all: {what}. It could never yield a batch; give the source(s) "
            "files with rows (fix Source.paths) or write the data first",
            None,
        )
    if job.epochs is None:
        return (
            f"job {job.name!r}: {what}; with epochs: null it can never yield a sample and every step would wait "
            "for it. Give it files with rows, or remove it from Job.sources",
            None,
        )
    return None, f"job {job.name!r}: {what}; it yields nothing in the job's {job.epochs} epoch(s)"


def check_yield(job: Job) -> None:
    """Refuses a job that can never yield (see the module docstring)."""
    empty: dict[str, tuple[list[str], list[str]]] = {}
    for source in job.sources:
        try:
            rows, files, unreadable = source_rows(source)
        except OverlordError as exc:
            raise StartupError(str(exc)) from None
        if not rows:
            empty[source.name] = (files, unreadable)
    error, warning = yield_problem(job, empty)
    if error:
        raise StartupError(error)
    if warning:
        log.warning("%s", warning)


def check_transforms(job: Job) -> None:
    """Every source's transform and decode resolve and build; every failure is named
    with its source, in one error."""
    problems = []
    for source in job.sources:
        try:
            build(source.transform, source.transform_args, context_length=job.batch.context_length)
            if source.decode:
                resolve(source.decode)
        except ConfigError as exc:
            problems.append(f"source {source.name!r}: {exc}")
    if problems:
        raise StartupError("; ".join(problems))


def run_checks(job: Job, loaders: int, redis_url: str | None) -> list[tuple[str, str | None]]:
    """Every check as (name, problem or None); `redis_url` None skips Redis (embedded)."""
    checks = [("shared memory", lambda: check_shm(job, loaders))]
    if redis_url:
        checks.append(("redis", lambda: check_redis(redis_url)))
    checks.append(("sources", lambda: check_sources(job)))
    checks.append(("transforms", lambda: check_transforms(job)))
    results: list[tuple[str, str | None]] = []
    for name, check in checks:
        try:
            check()
            results.append((name, None))
        except StartupError as exc:
            results.append((name, str(exc)))
    return results
