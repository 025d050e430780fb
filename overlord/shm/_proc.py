"""Is a process still there? Pid probes for ring peers and for stale-segment cleanup.

A pid alone is weak evidence: a killed child stays a zombie until reaped, a pid can be
reused, and pids mean nothing across pid namespaces (a sidecar container beside a
trainer container). So headers record the pid namespace (inode of /proc/<pid>/ns/pid)
and, for creators, the start time (clock ticks since boot, /proc/<pid>/stat field 22).
"""

from __future__ import annotations

import os

_identity: tuple[int, int, int] | None = None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process from procfs, None if gone."""
    fields = proc_stat_fields(pid)
    return None if fields is None else (fields[0].decode(), int(fields[19]))


def proc_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may contain spaces or ')': fields resume after the last ')'.
    return data[data.rfind(b")") + 2 :].split()


def pid_alive(pid: int, start: int = 0) -> bool:
    """Whether `pid` names a running process in this pid namespace (zombies are dead).

    Args:
        pid: Process id.
        start: If nonzero, the start time recorded for that process; a different one
            means the pid was reused, i.e. the recorded process is dead.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        stat = _proc_stat(pid)
    except (OSError, ValueError, IndexError):
        return True  # unreadable procfs: trust kill()
    if stat is None:
        return not os.path.isdir("/proc/self")
    # A killed child stays a zombie until its parent reaps it; it will never write again.
    if stat[0] in ("Z", "X"):
        return False
    return not start or stat[1] == start


def peer_alive(pid: int, pidns: int) -> bool:
    """Like `pid_alive`, but a pid from another pid namespace counts as alive.

    We cannot probe it from here; callers rely on timeouts and the error slot instead.
    """
    return pidns not in (0, self_identity()[1]) or pid_alive(pid)


def self_identity() -> tuple[int, int, int]:
    """(pid, pid-namespace inode, start time) of this process, as recorded in headers."""
    global _identity
    pid = os.getpid()
    if _identity is not None and _identity[0] == pid:  # cached; a fork has a new pid
        return _identity
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    try:
        stat = _proc_stat(pid)
        start = stat[1] if stat else 0
    except (OSError, ValueError, IndexError):
        start = 0
    _identity = (pid, ns, start)
    return _identity
