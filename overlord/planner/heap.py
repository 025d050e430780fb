"""The Planner process keeps its heap: per-step arrays reuse memory instead of fresh pages.

A step at 512 DP x 65,536 samples allocates and frees tens of arrays of 0.5-2 MiB
(costs, orders, the balancers' tables, the plan). glibc serves each block above its
mmap threshold (128 KiB at start, raised only as such blocks are freed) with a fresh
mmap, and munmaps it when freed: every step then faults in and zeroes every page of
every such array again, a few milliseconds a step on a VM and the step's slowest,
least even part (its p99). Raising the mmap threshold and the trim threshold keeps
those blocks in the heap, where the next step reuses them: the Planner's resident
memory stays at its largest step's working set (tens of MiB at 512 DP) instead of
falling back between steps. Only the Planner does this; no other role plans.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("overlord.planner")

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks up to this come from the heap (glibc refuses more on 64-bit)
TRIM_THRESHOLD = 256 << 20  # free memory the heap keeps at its top before returning it


def keep_heap() -> bool:
    """Make this process's allocator keep and reuse large blocks (glibc only).

    Returns:
        True where the thresholds were set; False elsewhere (another libc): plans are
        the same, steps only slower.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this libc; the Planner's large arrays use the allocator's defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_heap"]
