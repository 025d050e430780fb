"""Whether a process is alive, for liveness checks across roles."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True if `pid` names a running (not zombie) process; False for 0 or a dead pid."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:  # a zombie child still answers kill(0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
