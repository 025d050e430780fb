"""keep_heap: the Planner's large per-step arrays come from the heap, not fresh mappings."""

import subprocess
import sys

import pytest

# In a child process, so this test's own allocator is left as it was. mallinfo2's
# hblks counts the blocks glibc mapped with mmap; an 8 MiB array is one before
# keep_heap, and none after it (the heap serves it, and keeps it when freed).
CHILD = """
import ctypes, numpy as np
from overlord.planner.heap import keep_heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def mapped_with(nbytes):
    a = np.ones(nbytes // 8)
    return libc.mallinfo2().hblks
before = libc.mallinfo2().hblks
print(mapped_with(8 << 20) - before, keep_heap(), mapped_with(8 << 20) - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_arrays_come_from_the_heap_after_keep_heap():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", "True", "0"], out.stdout + out.stderr
