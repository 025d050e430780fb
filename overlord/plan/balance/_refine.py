"""Refinement of a balancer's placement: swaps between the heaviest bin and light ones
that lower the maximum load, keeping every bin's count (so every limit still holds)."""

from __future__ import annotations

from typing import cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from overlord.plan.balance._limits import Bins, Costs, check


def swap_refine(
    costs: ArrayLike,
    bins: ArrayLike,
    k: int,
    *,
    sizes: ArrayLike | None = None,
    capacity: float | None = None,
    tol: float = 1e-4,
    max_iter: int | None = None,
) -> Bins:
    """Swap local search that lowers the heaviest bin's load, keeping every count.

    Each round swaps one item of the heaviest bin with a lighter item of the lightest
    bin (or, failing that, of the next lightest ones) choosing the pair whose cost
    difference is nearest half the load gap, so the heavier of the two bins ends
    lower than the old maximum. Stops when no such swap exists, when the maximum is
    within `tol` of the mean, or after `max_iter` rounds (default 4k). Counts per bin
    are unchanged (so equal_count and max_count still hold) and capacity is respected.
    Equal-size Karmarkar-Karp leaves 1-10% imbalance on heavy-tailed costs (its last
    merges have nothing small left to even out with); a few hundred swaps remove it.

    Args:
        costs: [n] non-negative item costs.
        bins: [n] bin of each item from a balancer (-1 items are left alone).
        k: number of bins.
        sizes: [n] item sizes, needed with `capacity`.
        capacity: maximum sum of sizes per bin; no swap breaks it.
        tol: stop once max load <= mean load * (1 + tol).
        max_iter: maximum number of swaps.

    Returns:
        int64 [n]: the new bin of each item.
    """
    c, s, k = check(costs, k, sizes, capacity, None)
    out = np.array(bins, dtype=np.int64)
    placed = np.flatnonzero(out >= 0)
    if len(placed) < 2 or k < 2:
        return out
    # Members of each bin as a padded table, so a swap is two writes.
    o = placed[np.argsort(out[placed], kind="stable")]
    b_of = out[o]
    cnt = np.bincount(b_of, minlength=k)
    table = np.full((k, int(cnt.max())), -1, dtype=np.int64)
    table[b_of, np.arange(len(o)) - np.searchsorted(b_of, b_of)] = o
    # cast: numpy's stubs type bincount as intp even when float weights make it float64
    loads = cast(Costs, np.bincount(b_of, weights=c[o], minlength=k))
    sz = s if s is not None else np.zeros_like(c)  # read only with a capacity
    used = None if capacity is None else cast(Costs, np.bincount(b_of, weights=sz[o], minlength=k))
    stop = loads.mean() * (1 + tol)
    for _ in range(4 * k if max_iter is None else max_iter):
        a = int(loads.argmax())
        if loads[a] <= stop:
            break
        ra = table[a, : cnt[a]]
        ua = 0.0 if used is None else used[a]  # read only with a capacity
        swap = _best_swap(c, sz, ra, loads[a], ua, table, cnt, loads, used, capacity, int(loads.argmin()))
        if swap is None:  # rare: only then pay for sorting all bins
            for b in np.argsort(loads, kind="stable")[1:8].tolist():
                swap = _best_swap(c, sz, ra, loads[a], ua, table, cnt, loads, used, capacity, b)
                if swap is not None:
                    break
            else:
                break
        b, i, j = swap
        x, y = ra[i], table[b, j]
        table[a, i], table[b, j] = y, x
        out[x], out[y] = b, a
        loads[a] -= c[x] - c[y]
        loads[b] += c[x] - c[y]
        if used is not None:
            used[a] -= sz[x] - sz[y]
            used[b] += sz[x] - sz[y]
    return out


def _best_swap(
    c: Costs,
    sz: Costs,
    ra: NDArray[np.int64],
    la: float,
    ua: float,
    table: NDArray[np.int64],
    cnt: NDArray[np.intp],
    loads: Costs,
    used: Costs | None,
    capacity: float | None,
    b: int,
) -> tuple[int, int, int] | None:
    """(b, i, j): swapping ra[i] with table[b, j] lowers max(la, load b) the most, or None.

    `la` and `ua` are the load and used size of ra's bin; `used` and `capacity` are
    None together (no capacity to respect), `sz` is read only with them.
    """
    rb = table[b, : cnt[b]]
    gap = la - loads[b]
    if gap <= 0 or not len(rb) or not len(ra):
        return None
    ob = np.argsort(c[rb], kind="stable")
    cb = c[rb[ob]]
    ca = c[ra]
    pos = np.searchsorted(cb, ca - gap / 2)  # the ideal partner of each ra costs gap/2 less
    best, best_max = None, la
    for p in (np.maximum(pos - 1, 0), np.minimum(pos, len(cb) - 1)):
        d = ca - cb[p]
        new = np.maximum(la - d, loads[b] + d)
        ok = (d > 0) & (new < best_max)
        if capacity is not None and used is not None:
            ds = sz[ra] - sz[rb[ob[p]]]
            ok &= (used[b] + ds <= capacity) & (ua - ds <= capacity)
        if ok.any():
            i = int(np.where(ok, new, np.inf).argmin())
            best, best_max = (b, i, int(ob[p[i]])), new[i]
    return best
