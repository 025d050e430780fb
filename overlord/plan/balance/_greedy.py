"""The "greedy" balancer: LPT, largest cost first into the least-loaded bin that can
take it; and its batched form, which balances many groups of items at once."""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import ArrayLike, NDArray

from overlord.plan.balance._kernels import NATIVE
from overlord.plan.balance._limits import Bins, Costs, check, group_order, lpt_order, repair, slots


def greedy(
    costs: ArrayLike,
    k: int,
    *,
    sizes: ArrayLike | None = None,
    capacity: float | None = None,
    max_count: int | None = None,
    equal_count: bool = False,
    order: NDArray[np.intp] | None = None,
) -> Bins:
    """LPT: largest cost first, each into the least-loaded bin that can take it.

    Args:
        costs: [n] non-negative item costs.
        k: number of bins.
        sizes: [n] item sizes, needed with `capacity`.
        capacity: maximum sum of sizes per bin.
        max_count: maximum items per bin.
        equal_count: bin counts differ by at most 1 (each bin gets floor or ceil of
            placed/k); the ceil slots go to the bins that reach them first.
        order: `cost_order(costs, descending=True)`, where the caller has it.

    Returns:
        int64 [n]: the bin of each item, -1 where no bin can take it.

    Raises:
        PlanError: costs or sizes are not finite and >= 0.
        ConfigError: k, capacity or max_count is invalid.
    """
    c, s, k = check(costs, k, sizes, capacity, max_count)
    out = np.full(len(c), -1, dtype=np.int64)
    order = lpt_order(c, s, capacity, order)
    n_eff = len(order) if max_count is None else min(len(order), k * max_count)
    q, r = divmod(n_eff, k)
    limit = max_count if max_count is not None else len(c) + 1
    cap = np.inf if capacity is None else capacity  # read only with sizes, so with a capacity
    counts, used, n_hi = [0] * k, [0.0] * k, 0
    heap = [(0.0, b) for b in range(k)]  # (load, bin): pops least-loaded, ties by bin
    cl = c.tolist()
    sl = s.tolist() if capacity is not None and s is not None else None
    too_big = np.inf  # bins only fill up: an item this large or larger can never fit
    for i in order.tolist():
        size = sl[i] if sl is not None else 0.0
        if size >= too_big:
            continue
        skipped = []
        while heap:
            load, b = heapq.heappop(heap)
            n_b = counts[b]
            if n_b >= limit or (equal_count and (n_b > q or (n_b == q and n_hi >= r))):
                continue  # closed for good: counts only grow and ceil slots only run out
            if sl is not None and used[b] + size > cap:
                skipped.append((load, b))
                continue
            out[i] = b
            counts[b] = n_b + 1
            used[b] += size
            n_hi += equal_count and n_b + 1 == q + 1
            heapq.heappush(heap, (load + cl[i], b))
            break
        else:
            too_big = size
        for entry in skipped:
            heapq.heappush(heap, entry)
        if not heap:
            break  # every bin is closed
    if equal_count and capacity is not None:
        # Capacity can leave ceil slots unused: trim to floor/ceil and refill.
        out = repair(c, s, k, out, capacity, max_count, equal_count)
    return out


def greedy_groups(
    c: Costs,
    s: Costs | None,
    group: NDArray[np.int64],
    n_groups: int,
    k: int,
    capacity: float | None,
    order: NDArray[np.intp] | None = None,
) -> Bins:
    """`greedy` (no count limits) run in every group at once, one numpy round per rank.

    Round r places the r-th largest item of every group; identical, item for item, to
    calling `greedy` on each group, but the Python loop runs max(group size) times
    instead of n times. `order`: `cost_order(c, descending=True)`, where the caller has it.
    """
    out = np.full(len(c), -1, dtype=np.int64)
    idx = lpt_order(c, s, capacity, order)
    if not len(idx):
        return out
    o = idx[group_order(group[idx], n_groups)]  # by group, then LPT order (idx is in it)
    g = group[o]
    if NATIVE is not None:  # the same rounds, group by group, item by item, in C
        start = np.zeros(n_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(g, minlength=n_groups), out=start[1:])
        sizes = None if capacity is None or s is None else np.ascontiguousarray(s, dtype=np.float64)
        cap = np.inf if capacity is None else float(capacity)
        NATIVE.greedy_groups(np.ascontiguousarray(c, dtype=np.float64), sizes, cap, o.astype(np.int64), start, k, out)
        return out
    return _rounds(c, s, o, g, n_groups, k, capacity, out)


def _rounds(
    c: Costs,
    s: Costs | None,
    o: NDArray[np.intp],
    g: NDArray[np.int64],
    n_groups: int,
    k: int,
    capacity: float | None,
    out: Bins,
) -> Bins:
    """`greedy_groups`' numpy form, one round per item rank: `o` the items by group, then
    LPT order, `g` their groups. The reference the compiled kernel follows."""
    rank = slots(g, n_groups)  # position within its group
    table = np.full((n_groups, int(rank.max()) + 1), -1, dtype=np.int64)
    table[g, rank] = o
    loads = np.zeros((n_groups, k))
    used = np.zeros((n_groups, k))  # read only with a capacity
    sz = s if s is not None else np.zeros(len(c))
    rows_all = np.arange(n_groups)
    full = int((table >= 0).all(axis=0).sum())  # the first columns hold an item in every group
    if capacity is None:
        flat, base = loads.reshape(-1), rows_all * k  # a view: one flat scatter-add per round
        for col in table.T[:full]:
            b = loads.argmin(axis=1)  # first minimum: ties go to the lowest bin
            flat[base + b] += c[col]
            out[col] = b
        table = table[:, full:]
    for col in table.T:
        live = col >= 0
        rows, ids = (rows_all, col) if live.all() else (rows_all[live], col[live])
        if capacity is None:
            b = loads[rows].argmin(axis=1)  # first minimum: ties go to the lowest bin
        else:
            ok = used[rows] + sz[ids][:, None] <= capacity
            b = np.where(ok, loads[rows], np.inf).argmin(axis=1)
            fit = ok[np.arange(len(b)), b]
            rows, ids, b = rows[fit], ids[fit], b[fit]
            used[rows, b] += sz[ids]
        loads[rows, b] += c[ids]
        out[ids] = b
    return out
