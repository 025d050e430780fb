"""Keeping the C heap of long-running processes flat (glibc malloc).

A sidecar runs for the whole job, days. Its Source Loaders allocate and free sample
buffers of every size from several threads, and the embedded redis-server (built with
libc malloc) allocates and frees plans, checkpoint deltas and client buffers every step.
glibc's defaults let such a process's resident memory creep for minutes to a high-water
mark and swing around it:

- the mmap threshold is dynamic: after a large block is freed, blocks up to that size
  come from the heap instead of mmap, where a freed one leaves a hole that smaller,
  long-lived blocks pin;
- every thread that allocates may get its own arena (up to 8 per core), each with its
  own free lists and high-water mark;
- free pages inside the heap (not at its top) go back to the kernel only on
  `malloc_trim`.

`tune()` fixes the mmap threshold (so blocks of 128 KiB and more are mapped and
unmapped, never pinning the heap) and caps the arenas at 2; `trim()` hands free heap
pages back. The sidecar calls `tune()` and `use_system_arrow_pool()` before it forks
its roles, and every role calls `trim()` from its heartbeat thread. The embedded
redis-server gets the settings through `GLIBC_TUNABLES` (`redis_env`), with a 16 KiB
threshold, so the 10 MiB blocks of an append-only-file rewrite are mapped and unmapped
instead of raising glibc's threshold and then staying in its heap. (Replaying a
4-minute capture of a soak's writes 12 times, its RSS rose from 13.8 to 22.3 MiB at
the rewrites with glibc's defaults and stayed at 13.7-13.9 MiB with these.) glibc maps
a block at or over the threshold only when no free chunk of its heap holds it: a
malloc trace of a soak's redis-server showed 10-20% of its 16 and 32 KiB client reply
and query buffers mapped and the rest cut from the heap's free top, so those still
churn in the heap. These are no-ops where the C library is not glibc (musl, macOS).

The Planner is the exception (`tune_planner`, called as its process starts): a step at
512 DP x 65,536 samples allocates and frees tens of numpy arrays of 0.5-2 MiB (costs,
orders, the balancers' tables, the plan), and with every such block mapped and
unmapped each step faulted in and zeroed all their pages again: a few ms a step on a
VM, and most of its p99. With a 32 MiB mmap threshold and a 256 MiB trim threshold the
blocks stay in the heap, where the next step reuses them; its RSS holds its largest
step's working set (tens of MiB at 512 DP) between steps. Its heartbeat thread still
calls `trim()`, so once every TRIM_EVERY_S one step pays the faults again.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 128 << 10  # glibc's own initial threshold, made fixed
REDIS_MMAP_THRESHOLD = 16 << 10  # redis-server's AOF-rewrite blocks are mapped, not left in its heap
ARENA_MAX = 2
PLANNER_MMAP_THRESHOLD = 32 << 20  # the Planner's per-step arrays come from the heap (glibc's most on 64-bit)
PLANNER_TRIM_THRESHOLD = 256 << 20  # and stay there when freed, for the next step
TRIM_EVERY_S = 10.0  # how often a role hands free heap pages back

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # <malloc.h>


def _glibc():
    """The process's C library if it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - probing for the glibc symbols
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def tune() -> bool:
    """Set this process's malloc as described above; True when it took effect."""
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # also fixes it: no dynamic raise
    ok &= _LIBC.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD)
    ok &= _LIBC.mallopt(_M_ARENA_MAX, ARENA_MAX)
    return bool(ok)


def tune_planner() -> bool:
    """The Planner's malloc, as described above (after `tune`, which the sidecar made
    before forking it; the arena cap stays); True when it took effect."""
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, PLANNER_MMAP_THRESHOLD)
    ok &= _LIBC.mallopt(_M_TRIM_THRESHOLD, PLANNER_TRIM_THRESHOLD)
    return bool(ok)


def trim() -> None:
    """Return free pages of every malloc arena to the kernel (milliseconds for a 100 MiB heap)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def use_system_arrow_pool() -> str:
    """Arrow's buffers (Parquet pages, row groups, columns) from the C library's malloc,
    tuned as above, instead of its bundled mimalloc, unless $ARROW_DEFAULT_MEMORY_POOL
    chooses. mimalloc keeps the pages of freed buffers resident: a Source Loader holding
    3-8 MiB of row groups showed 30-46 MiB in mimalloc's arena, rising and falling with
    its reads. Arrow reads the variable when pyarrow is first imported, so call this
    before that; imported earlier, pyarrow's own allocations switch (`set_memory_pool`)
    but Arrow's internal scratch buffers stay where they were. Returns the backend."""
    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "system"
    import pyarrow as pa  # deferred: pyarrow (~0.1 s), imported after the variable is set: Arrow reads it then

    if os.environ["ARROW_DEFAULT_MEMORY_POOL"] == "system" and pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())
    return pa.default_memory_pool().backend_name


def redis_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child program (redis-server) with the same malloc settings,
    through glibc's tunables (read at its start; ignored by other C libraries)."""
    env = dict(os.environ if base is None else base)
    tunables = (
        f"glibc.malloc.mmap_threshold={REDIS_MMAP_THRESHOLD}:"
        f"glibc.malloc.trim_threshold={MMAP_THRESHOLD}:glibc.malloc.arena_max={ARENA_MAX}"
    )
    env["GLIBC_TUNABLES"] = f"{env['GLIBC_TUNABLES']}:{tunables}" if env.get("GLIBC_TUNABLES") else tunables
    return env
