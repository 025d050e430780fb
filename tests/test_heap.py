"""glibc malloc settings of long-running roles and the embedded Redis (overlord.heap).

Each case runs in a fresh interpreter: malloc settings are per process and these
change them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlord import heap
from overlord.store.server import EmbeddedRedis

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="the C library is not glibc")

REPO = Path(__file__).resolve().parent.parent
_MALLOC = """
import ctypes, sys
sys.path.insert(0, {repo!r})
import os
from overlord import heap, procmem
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def in_heap(address):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo <= address < hi
    return False
"""


def _run(body: str, *argv: str) -> str:
    code = _MALLOC.format(repo=str(REPO)) + body
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


def test_tuned_malloc_keeps_large_blocks_out_of_the_heap():
    """glibc raises its mmap threshold to the size of a freed mapped block, so later
    blocks of up to that size land in the heap and leave holes there; tuned, they stay
    mapped and go back to the kernel on free."""
    body = """
if sys.argv[1] == "tune":
    assert heap.tune()
libc.free(libc.malloc(4 << 20))
print(in_heap(libc.malloc(1 << 20)))
"""
    assert _run(body, "plain") == "True", "glibc's dynamic threshold should put the block in the heap"
    assert _run(body, "tune") == "False"


def test_planner_keeps_its_step_arrays_in_the_heap():
    """After the sidecar's `tune`, the Planner's `tune_planner`: an 8 MiB block (a
    512-DP step's arrays are 0.5-2 MiB) comes from the heap, and freed and asked again
    it is the same memory, not a fresh mapping to fault in."""
    out = _run("""
assert heap.tune()
print(in_heap(libc.malloc(8 << 20)))
assert heap.tune_planner()
a = libc.malloc(8 << 20)
libc.free(a)
b = libc.malloc(8 << 20)
print(in_heap(a), a == b)
""")
    assert out.split() == ["False", "True", "True"]


def test_trim_hands_free_heap_pages_back():
    """64 MiB of small blocks, freed but for every 16th (so the holes between cannot
    merge into the heap's top and shrink it), stay resident until trim."""
    out = _run("""
heap.tune()
blocks = [libc.malloc(4096) for _ in range(16384)]
for b in blocks:
    ctypes.memset(b, 1, 4096)
for i, b in enumerate(blocks):
    if i % 16:
        libc.free(b)
before = procmem.rss_bytes(os.getpid())
heap.trim()
print(before - procmem.rss_bytes(os.getpid()))
""")
    assert int(out) > 48 << 20


def test_embedded_redis_runs_with_the_malloc_tunables(tmp_path):
    server = EmbeddedRedis(tmp_path / "run").start()
    try:
        environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
        tunables = [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
        assert tunables and f"glibc.malloc.mmap_threshold={heap.REDIS_MMAP_THRESHOLD}".encode() in tunables[0]
    finally:
        server.stop()


def test_redis_env_keeps_the_callers_tunables():
    env = heap.redis_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=")


def test_arrow_buffers_come_from_the_tuned_malloc_unless_the_user_chose_a_pool():
    body = """
first = sys.argv[1] == "pyarrow-first"
if first:
    import pyarrow
print(heap.use_system_arrow_pool())
import pyarrow as pa
kept = pa.allocate_buffer(1 << 20)
print(pa.system_memory_pool().bytes_allocated() >= 1 << 20)
"""
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}

    def run(order: str, **env: str) -> list[str]:
        code = _MALLOC.format(repo=str(REPO)) + body
        return subprocess.run(
            [sys.executable, "-c", code, order],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**clean, **env},
        ).stdout.split()

    assert run("overlord-first") == ["system", "True"]  # Arrow's own default pool, scratch buffers too
    assert run("pyarrow-first") == ["system", "True"]  # pyarrow's allocations at least
    assert run("overlord-first", ARROW_DEFAULT_MEMORY_POOL="mimalloc") == ["mimalloc", "False"]
