"""The "karmarkar_karp" balancer: k-way largest differencing, repaired to the limits.

Without `equal_count` it starts from one partition per item (classic; O(n k log k),
slow for large n*k); with `equal_count` from the items sorted and cut into chunks of k,
one item per subset (the equal-size variant used by verl and Megatron), which needs
only n/k - 1 merges. Limits differencing cannot express (capacity, max_count) are
repaired afterwards (`_limits.repair`).
"""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import ArrayLike, NDArray

from overlord.plan.balance._kernels import NATIVE
from overlord.plan.balance._limits import Bins, Costs, check, lpt_order, repair

# A partition: its k subset sums, sorted descending, and the item naming each subset (-1
# if empty). On the heap a singleton partition is only its item's index until popped.
_Partition = tuple[Costs, Bins]
_Entry = tuple[float, int, _Partition | int]  # (-spread, creation order, partition)


def karmarkar_karp(
    costs: ArrayLike,
    k: int,
    *,
    sizes: ArrayLike | None = None,
    capacity: float | None = None,
    max_count: int | None = None,
    equal_count: bool = False,
    order: NDArray[np.intp] | None = None,
) -> Bins:
    """k-way Karmarkar-Karp (largest differencing), repaired to honour the limits.

    Args:
        costs: [n] non-negative item costs.
        k: number of bins.
        sizes: [n] item sizes, needed with `capacity`.
        capacity: maximum sum of sizes per bin (repaired after differencing).
        max_count: maximum items per bin; only the k*max_count largest items take part.
        equal_count: use the equal-size variant: bin counts differ by at most 1.
        order: `cost_order(costs, descending=True)`, where the caller has it.

    Returns:
        int64 [n]: the bin of each item, -1 where no bin can take it. Bins are
        numbered by decreasing load before any repair.

    Raises:
        PlanError: costs or sizes are not finite and >= 0.
        ConfigError: k, capacity or max_count is invalid.
    """
    c, s, k = check(costs, k, sizes, capacity, max_count)
    out = np.full(len(c), -1, dtype=np.int64)
    order = lpt_order(c, s, capacity, order)
    if max_count is not None:
        order = order[: k * max_count]  # the rest could never all be placed: defer the smallest
    out[order] = differencing(c[order], k, equal_count)
    if capacity is not None or (max_count is not None and not equal_count):
        out = repair(c, s, k, out, capacity, max_count, equal_count)
    return out


def differencing(vals: Costs, k: int, equal_count: bool) -> Bins:
    """Largest differencing over `vals` (sorted descending); returns the bin of each.

    Runs the compiled kernel where it was built (a heap of partitions and k-element
    merges are a loop numpy can only take a few small calls at a time), else
    `differencing_numpy`; both give the same bins."""
    if NATIVE is None:
        return differencing_numpy(vals, k, equal_count)
    out = np.empty(len(vals), dtype=np.int64)
    NATIVE.differencing(np.ascontiguousarray(vals, dtype=np.float64), k, equal_count, out)
    return out


def differencing_numpy(vals: Costs, k: int, equal_count: bool) -> Bins:
    """`differencing` in numpy: the reference the compiled kernel follows step for step."""
    m = len(vals)
    if k == 1 or m < 2:
        return np.zeros(m, dtype=np.int64)
    # union-find `parent` records which subsets were merged into which
    parent = np.arange(m)
    heap: list[_Entry]
    if equal_count:
        # Chunks of k consecutive sorted items, one item per subset (padded with empty
        # subsets): all subsets of a partition hold as many items, and merging keeps it so.
        pad = -m % k
        sums = np.concatenate([vals, np.zeros(pad)]).reshape(-1, k)
        ids = np.concatenate([np.arange(m), np.full(pad, -1)]).reshape(-1, k)
        heap = [(-(s_[0] - s_[-1]), j, (s_, i_)) for j, (s_, i_) in enumerate(zip(sums, ids))]
    else:
        heap = [(-v, j, j) for j, v in enumerate(vals.tolist())]  # singletons
    heapq.heapify(heap)  # largest spread first; ties by creation order (unique seq)

    def pop() -> _Partition:
        part = heapq.heappop(heap)[2]
        if isinstance(part, int):  # singleton (v, 0, ..., 0), built only now: memory stays O(heap)
            j, part = part, (np.zeros(k), np.full(k, -1, dtype=np.int64))
            part[0][0], part[1][0] = vals[j], j
        return part

    seq = len(heap)
    while len(heap) > 1:
        (sa, ia), (sb, ib) = pop(), pop()
        sb, ib = sb[::-1], ib[::-1]  # largest subset of one meets the smallest of the other
        both = (ia >= 0) & (ib >= 0)
        parent[ib[both]] = ia[both]
        new_s, new_i = sa + sb, np.where(ia >= 0, ia, ib)
        o = np.argsort(-new_s, kind="stable")
        heapq.heappush(heap, (-(new_s[o[0]] - new_s[o[-1]]), seq, (new_s[o], new_i[o])))
        seq += 1
    final = pop()[1]
    while True:  # pointer jumping: log(depth) vectorised passes to each item's root
        nxt = parent[parent]
        if np.array_equal(nxt, parent):
            break
        parent = nxt
    where = np.full(m, -1, dtype=np.int64)
    named = final >= 0
    where[final[named]] = np.flatnonzero(named)
    return where[parent]
