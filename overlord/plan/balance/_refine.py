"""Refinement of a balancer's placement: swaps between the heaviest bin and light ones
that lower the maximum load, keeping every bin's count (so every limit still holds).

Without a capacity the swaps are found for many bins at once (`_refine_pairs`): each
round pairs the i-th heaviest bin with the i-th lightest, every pair above the target
finds its best swap in one batch of numpy calls, and all of them are made together
(the pairs are disjoint). A round costs about what one swap of the one-pair search
costs, and a handful of rounds brings 512 bins within the tolerance.
With a capacity, a swap must also keep both bins' sizes within it: the one-pair
search below does that.
"""

from __future__ import annotations

from typing import cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from overlord.plan.balance._kernels import NATIVE
from overlord.plan.balance._limits import Bins, Costs, check, group_order, slots

TOL = 1e-4  # swap_refine stops once the heaviest bin is within this of the mean


def swap_refine(
    costs: ArrayLike,
    bins: ArrayLike,
    k: int,
    *,
    sizes: ArrayLike | None = None,
    capacity: float | None = None,
    tol: float = TOL,
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
    if capacity is None:
        return _refine_pairs(c, out, placed, k, tol, 4 * k if max_iter is None else max_iter)
    # Members of each bin as a padded table, so a swap is two writes.
    o = placed[group_order(out[placed], k)]
    b_of = out[o]
    cnt = np.bincount(b_of, minlength=k)
    table = np.full((k, int(cnt.max())), -1, dtype=np.int64)
    table[b_of, slots(b_of, k)] = o
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


_SEARCH_BAND = 4.0  # each pair's row of normalised costs (in [0, 1]) sits in a band of its own


def _refine_pairs(c: Costs, out: Bins, placed: NDArray[np.int64], k: int, tol: float, max_swaps: int) -> Bins:
    """`swap_refine` without a capacity, pairs of bins at a time (see the module docstring).

    Round by round: bins sorted by load, the i-th heaviest above mean * (1 + tol) meets
    the i-th lightest (shifted by one more each round the heaviest finds no partner, up
    to 8, as the one-pair search tries the next lightest bins). For each such pair, the
    item x of the heavy bin and y of the light one whose cost difference d is nearest
    half their gap (0 < d < gap, so the heavier of the two ends below the old load of
    the heavy one); every pair that has one swaps. Stops within the tolerance, when no
    pair finds a swap at any shift, or after `max_swaps` swaps in all.
    """
    if NATIVE is not None:  # the same table, loads and rounds in C, pair by pair
        m = int(np.bincount(out[placed], minlength=k).max())
        table = np.empty((k, m), dtype=np.int64)
        loads = np.empty(k)
        c = np.ascontiguousarray(c, dtype=np.float64)
        NATIVE.bin_table(out, c, k, m, table, loads)
        scale = float(c[placed].max()) or 1.0
        cn = np.empty(len(c) + 1)
        np.divide(c, scale, out=cn[:-1])
        cn[-1] = 1.0
        cz = np.append(c, 0.0)
        stop = loads.mean() * (1 + tol)
        NATIVE.refine_pairs(cn, cz, table, k, m, loads, float(stop), scale, max_swaps, out)
        return out
    o = placed[group_order(out[placed], k)]
    b_of = out[o]
    cnt = np.bincount(b_of, minlength=k)
    m = int(cnt.max())
    table = np.full((k, m), -1, dtype=np.int64)  # the members of each bin; -1 pads
    table[b_of, slots(b_of, k)] = o
    loads = cast(Costs, np.bincount(b_of, weights=c[o], minlength=k))
    scale = float(c[o].max()) or 1.0
    cn = np.append(c / scale, 1.0)  # costs in [0, 1] for the batched search; a pad (-1) reads 1.0
    cz = np.append(c, 0.0)  # a pad costs nothing
    stop = loads.mean() * (1 + tol)
    # A light bin's members by cost, ties by their slot, is the order of the unique keys
    # (rank of the cost among the distinct costs) * m + slot: an int sort, not a stable
    # sort of floats, each round.
    by_cost = np.argsort(cn)  # the ties' order does not matter: only the values rank
    distinct = np.zeros(len(cn), dtype=np.int64)
    np.cumsum(cn[by_cost][1:] != cn[by_cost][:-1], out=distinct[1:])
    rank = np.empty(len(cn), dtype=np.int64)
    rank[by_cost] = distinct
    slot = np.arange(m, dtype=np.int64)
    half, shift, swaps = k // 2, 0, 0
    while swaps < max_swaps:
        order = np.argsort(loads, kind="stable")
        heavy = order[::-1][:half]
        hot = int((loads[heavy] > stop).sum())
        if hot == 0:
            break
        a_bins = heavy[:hot]
        b_bins = order[:half][(np.arange(hot) + shift) % half]  # the lightest, shifted by `shift`
        la, lb = loads[a_bins], loads[b_bins]
        gap = la - lb
        pair = np.arange(hot)[:, None]
        rows_a, rows_b = table[a_bins], table[b_bins]
        sorted_b = rows_b[pair, np.argsort(rank[rows_b] * m + slot, axis=1)]  # by cost, ties by slot
        # one searchsorted for every pair: row r's sorted costs shifted into band r
        band = _SEARCH_BAND * pair
        target = np.clip(cn[rows_a] - (gap / (2 * scale))[:, None], -0.5, 1.0) + band
        pos = np.searchsorted((cn[sorted_b] + band).ravel(), target.ravel()).reshape(hot, m) - m * pair
        # each x's two candidates, the y just below its ideal partner (columns 0..m-1)
        # and the one at it (m..2m-1): the first minimum of the new max load wins, so
        # on a tie the lower x and the first candidate do
        y = sorted_b[pair, np.concatenate([np.maximum(pos - 1, 0), np.minimum(pos, m - 1)], axis=1)]
        d = np.tile(cz[rows_a], 2) - cz[y]
        new = np.maximum(la[:, None] - d, lb[:, None] + d)
        ok = np.tile(rows_a >= 0, 2) & (y >= 0) & (d > 0) & (new < la[:, None])
        col = np.where(ok, new, np.inf).argmin(axis=1)
        found = ok[pair[:, 0], col]
        best_i = np.where(found, col % m, -1)
        best_y = y[pair[:, 0], col]
        go = np.flatnonzero(best_i >= 0)
        if best_i[0] < 0:  # the heaviest found no partner: try it with the next lighter ones
            shift += 1
            if shift >= min(8, half) and not len(go):
                break
        else:
            shift = 0
        if not len(go):
            continue
        go = go[: max_swaps - swaps]
        a, b, i, y = a_bins[go], b_bins[go], best_i[go], best_y[go]
        x = table[a, i]
        j = np.argmax(table[b] == y[:, None], axis=1)  # y's slot in its bin
        table[a, i], table[b, j] = y, x
        out[x], out[y] = b, a
        d = c[x] - c[y]
        loads[a] -= d
        loads[b] += d
        swaps += len(go)
    return out
