"""Type stub for the C extension `overlord.plan.balance._native` (native/balancemodule.c).

Each kernel writes its answer into `out` (and `refine_pairs` also updates `table` and
`loads` in place); see `_kernels.py` for the Python forms they stand in for.
"""

from typing_extensions import Buffer

def cost_order(costs: Buffer, descending: bool, out: Buffer, /) -> None: ...
def differencing(vals: Buffer, k: int, equal_count: bool, out: Buffer, /) -> None: ...
def greedy_groups(
    costs: Buffer, sizes: Buffer | None, capacity: float, order: Buffer, start: Buffer, k: int, out: Buffer, /
) -> None: ...
def bin_table(bin: Buffer, costs: Buffer, k: int, m: int, table: Buffer, loads: Buffer, /) -> None: ...
def refine_pairs(
    cn: Buffer,
    cz: Buffer,
    table: Buffer,
    k: int,
    m: int,
    loads: Buffer,
    stop: float,
    scale: float,
    max_swaps: int,
    out: Buffer,
    /,
) -> None: ...
def two_level(costs: Buffer, buckets: int, bins: int, tol: float, bucket: Buffer, mbin: Buffer, /) -> None: ...
def same_once(given: Buffer, wanted: Buffer, /) -> bool: ...
