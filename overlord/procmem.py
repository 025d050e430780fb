"""Memory of processes and process trees, read from Linux ``/proc``.

PSS (proportional set size) is the measure Overlord reports: each resident page is
charged to the processes mapping it in equal shares, so summing PSS over a set of
processes neither double-counts pages shared after ``fork`` or through shared
libraries, nor hides them. POSIX shared memory (``/dev/shm``: the rings, torch's
tensor hand-off between DataLoader workers and trainers) appears in ``smaps`` like any
other mapping, so it is counted too, split among the processes that map it.

Linux only. Reading another user's process needs the usual ptrace permission; reading
your own children does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from overlord.shm._proc import proc_stat_fields

_KIB = 1024


def _field_kib(lines: Iterable[str], field: str) -> int:
    """Sums the ``field:  N kB`` lines (smaps format) in ``lines``, in KiB."""
    total = 0
    for line in lines:
        if line.startswith(field):
            parts = line.split()
            if parts[0] == field:  # exact: "Pss:" must not match "Pss_Anon:"
                total += int(parts[1])
    return total


def _open_proc(pid: int, name: str):
    try:
        return open(f"/proc/{pid}/{name}", encoding="ascii", errors="replace")
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid} (/proc/{pid}/{name} is gone)") from None


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process.

    Reads ``/proc/<pid>/smaps_rollup`` (Linux >= 4.14), else sums every mapping's
    ``Pss`` in ``/proc/<pid>/smaps``.

    Args:
        pid: Process id.

    Returns:
        PSS in bytes (0 for a kernel thread or a zombie, which map nothing).

    Raises:
        ProcessLookupError: The process does not exist (or exited while being read).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii", errors="replace") as f:
            return _field_kib(f, "Pss:") * _KIB
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessLookupError(f"no process {pid}") from None
    except ProcessLookupError:  # reading a process that is exiting
        raise ProcessLookupError(f"process {pid} exited while being read") from None
    with _open_proc(pid, "smaps") as f:  # kernel without smaps_rollup
        return _field_kib(f, "Pss:") * _KIB


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (shared pages counted in full).

    Args:
        pid: Process id.

    Returns:
        RSS in bytes, from ``VmRSS`` in ``/proc/<pid>/status`` (0 when absent, as for
        kernel threads and zombies).

    Raises:
        ProcessLookupError: The process does not exist.
    """
    with _open_proc(pid, "status") as f:
        return _field_kib(f, "VmRSS:") * _KIB


def _parent_of(pid: int) -> int | None:
    """Parent pid from ``/proc/<pid>/stat``, or None if the process is gone."""
    fields = proc_stat_fields(pid)
    return None if fields is None else int(fields[1])


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants.

    Args:
        pid: Root process id.

    Returns:
        ``[pid, children..., grandchildren...]`` (breadth-first, each level sorted). A
        process that starts or exits during the scan may be missing or included.

    Raises:
        ProcessLookupError: ``pid`` does not exist.
    """
    if not os.path.exists(f"/proc/{pid}"):
        raise ProcessLookupError(f"no process {pid}")
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out = [pid]
    level = [pid]
    while level:
        level = sorted(c for p in level for c in children.get(p, ()))
        out.extend(level)
    return out


def pss_of(pids: Iterable[int]) -> int:
    """Summed PSS of several processes; those that have exited count 0.

    Args:
        pids: Process ids (e.g. from `tree_pids`).

    Returns:
        Total PSS in bytes.
    """
    total = 0
    for pid in pids:
        try:
            total += pss_bytes(pid)
        except ProcessLookupError:
            pass  # exited between listing and reading: it holds no memory any more
    return total


__all__ = sorted(["pss_bytes", "pss_of", "rss_bytes", "tree_pids"])
