"""Shared-memory segment names: the one place they are built, listed and cleaned.

Every Overlord segment is named ``/ovl.<job>.<node>.<owner>`` and lives in /dev/shm as
``ovl.<job>.<node>.<owner>``::

    /ovl.<job>.<node>.<owner>
         |     |      +-- role instance that created it (e.g. "client-r3", "ctor-dp0")
         |     +--------- node name (hostname or mesh node id)
         +--------------- job name: all of a job's segments share the prefix /ovl.<job>.

Each component keeps only [A-Za-z0-9_-]; any other character becomes '_'. Because the
substitution can make two names collide ("a.b" and "a_b"), a component that had to be
changed or shortened (to at most 64 characters) gets a '-' and 8 hex digits of a hash
of the original, so names stay unique and a job's prefix never matches another job.
The whole name is at most 200 characters.

`cleanup_stale` removes segments whose creator died (kill -9, OOM) before unlinking
them. A segment is stale when its header names a creator pid that is not alive (or
was reused: the creator's start time is recorded), or, for a segment whose header is
unreadable or not yet initialised, when it is older than `GARBAGE_AGE_S`. Segments
created in another pid namespace are left alone: their pids mean nothing here.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time

from overlord.shm import _ring as _native
from overlord.shm._proc import pid_alive, self_identity
from overlord.shm._segment import unlink_segment

SHM_DIR = "/dev/shm"
PREFIX = "ovl."
MAX_NAME = 200
MAX_COMPONENT = 64
GARBAGE_AGE_S = 5.0  # an uninitialised segment older than this is a crashed create

_BAD = re.compile(r"[^A-Za-z0-9_-]")
# magic u64, version u32, header_size u32, capacity u64, creator_pid i32, then at 48:
# creator_pidns u64, creator_start u64 (see native/ring.h).
_HEAD = struct.Struct("<QII Q i 20x QQ")


def _component(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"segment name {what} must be a non-empty str, got {value!r}")
    clean = _BAD.sub("_", value)
    if clean == value and len(clean) <= MAX_COMPONENT:
        return clean
    digest = hashlib.blake2b(value.encode(), digest_size=4).hexdigest()
    return f"{clean[: MAX_COMPONENT - 9]}-{digest}"


def job_prefix(job: str) -> str:
    """Name prefix shared by every segment of `job`, e.g. ``/ovl.myjob.``."""
    return f"/{PREFIX}{_component(job, 'job')}."


def segment_name(job: str, node: str, owner: str) -> str:
    """The segment name for one ring of a job.

    Args:
        job: Job name.
        node: Node name.
        owner: Role instance that owns the segment (unique on the node within the job).

    Returns:
        ``/ovl.<job>.<node>.<owner>``, sanitised, at most 200 characters.

    Raises:
        ValueError: A component is empty or not a str.
    """
    name = f"{job_prefix(job)}{_component(node, 'node')}.{_component(owner, 'owner')}"
    if len(name) > MAX_NAME:  # cannot happen with 3 x 64-char components; guards edits
        raise ValueError(f"segment name {name!r} longer than {MAX_NAME}")
    return name


def list_segments(job: str | None = None) -> list[str]:
    """Names (with leading '/') of Overlord segments in /dev/shm, sorted.

    Args:
        job: Only this job's segments; None for every ``ovl.`` segment.
    """
    prefix = job_prefix(job)[1:] if job is not None else PREFIX
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(f"/{e}" for e in entries if e.startswith(prefix))


def _is_stale(name: str, now: float, held: str | None = None) -> bool:
    path = os.path.join(SHM_DIR, name[1:])
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(_HEAD.size)
    except FileNotFoundError:
        return False  # already gone
    except OSError:
        return False  # not ours to judge (permissions): leave it
    if len(raw) == _HEAD.size:
        magic, version, header_size, _cap, pid, pidns, start = _HEAD.unpack(raw)
        if magic == _native.MAGIC and version == _native.VERSION and header_size == _native.HEADER_SIZE:
            if pidns and pidns != self_identity()[1]:
                # another PID namespace's: not ours to judge, unless it is the held node's
                # (the caller holds that node's sidecar lock, so its roles that made it are
                # gone: e.g. the node's container or host restarted in a new namespace)
                return held is not None and name.startswith(held)
            return not pid_alive(pid, start)
    return now - st.st_mtime > GARBAGE_AGE_S


def cleanup_stale(job: str | None = None, *, node: str | None = None) -> list[str]:
    """Unlink segments whose creator is dead, e.g. after a kill -9.

    Args:
        job: Only this job's segments; None for every ``ovl.`` segment on the node.
        node: A node of `job` whose sidecar lock the caller holds: that node's segments
            made in another PID namespace count as dead too (a node whose host or
            container restarted in a new namespace, its /dev/shm kept, left them; no
            live process of the node can be elsewhere while the lock is held).

    Returns:
        The names removed, sorted.
    """
    now = time.time()
    held = f"{job_prefix(job)}{_component(node, 'node')}." if job is not None and node is not None else None
    return [n for n in list_segments(job) if _is_stale(n, now, held) and unlink_segment(n)]


def unlink_all(job: str, node: str | None = None) -> list[str]:
    """Unlink every segment of `job` (of its `node` only, if given), live or not
    (tests, job shutdown; several nodes of a job may share a machine).

    Returns:
        The names removed, sorted.
    """
    prefix = f"{job_prefix(job)}{_component(node, 'node')}." if node is not None else job_prefix(job)
    return [n for n in list_segments(job) if n.startswith(prefix) and unlink_segment(n)]
