"""Balancing sample costs over bins: the Planner's `balance` primitive (paper §4.2).

Pure functions over numpy arrays, no I/O. A *balancer* maps n item costs to one of k
bins per item (int64, -1 = the item fits no bin and is deferred by the caller):

    fn(costs, k, *, sizes=None, capacity=None, max_count=None, equal_count=False)

Limits every balancer honours: the sum of `sizes` in a bin <= `capacity`; at most
`max_count` items per bin; with `equal_count`, bin counts differ by at most 1. An item
is -1 only when placing it in any bin would break one of these limits (an item larger
than `capacity` is always -1; with a count limit the smallest-cost items are the ones
left out). Same inputs give the same output, bit for bit: every tie is broken by item
index, then bin index.

Shipped balancers (`BALANCERS`, extend with `register_balancer`):
  - "greedy": LPT, largest cost first into the least-loaded bin that can take it.
  - "karmarkar_karp": k-way largest differencing. Without `equal_count` it starts from
    one partition per item (classic; O(n k log k), slow for large n*k); with
    `equal_count` it starts from the items sorted and cut into chunks of k, one item
    per subset (the equal-size variant used by verl and Megatron), which needs only
    n/k - 1 merges. Limits KK cannot express (capacity, max_count) are repaired
    afterwards: items are evicted from violating bins and placed again, largest first.

`assign` runs the two levels of the paper's `balance` (buckets = DP ranks, then bins =
micro-batches in each bucket); see its docstring for the modes.
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol

import numpy as np

from overlord.errors import ConfigError, PlanError


class Balancer(Protocol):
    """The signature of a balancer (see the module docstring for the contract)."""

    def __call__(
        self,
        costs: np.ndarray,
        k: int,
        *,
        sizes: np.ndarray | None = None,
        capacity: float | None = None,
        max_count: int | None = None,
        equal_count: bool = False,
    ) -> np.ndarray: ...


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}={value!r}; give an integer >= 1")
    return int(value)


def _check(costs, k, sizes, capacity, max_count) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Validate a balancer's arguments; return float64 costs and sizes and int k."""
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1:
        raise PlanError(f"costs must be a 1-D array, got shape {c.shape}")
    for name, arr in (("cost", c), ("size", None if sizes is None else np.asarray(sizes, np.float64))):
        if arr is None:
            continue
        if arr.shape != c.shape:
            raise PlanError(f"sizes has shape {arr.shape}, costs {c.shape}; give one size per item")
        bad = ~np.isfinite(arr) | (arr < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise PlanError(
                f"{name} of item {i} is {arr[i]!r}; {name}s must be finite and >= 0 "
                f"(check the cost model / sample metadata)"
            )
    k = _positive_int("k", k)
    if capacity is not None:
        if sizes is None:
            raise ConfigError(f"capacity={capacity!r} needs sizes (one size per item)")
        if not np.isfinite(capacity) or capacity <= 0:
            raise ConfigError(f"capacity={capacity!r}; give a finite number > 0")
    if max_count is not None:
        _positive_int("max_count", max_count)
    s = None if sizes is None else np.asarray(sizes, dtype=np.float64)
    return c, s, k


def _lpt_order(c: np.ndarray, s: np.ndarray | None, capacity: float | None) -> np.ndarray:
    """Items that fit a bin on their own, largest cost first, ties by index."""
    order = np.argsort(-c, kind="stable")
    return order if capacity is None or s is None else order[s[order] <= capacity]


def greedy(costs, k, *, sizes=None, capacity=None, max_count=None, equal_count=False) -> np.ndarray:
    """LPT: largest cost first, each into the least-loaded bin that can take it.

    Args:
        costs: [n] non-negative item costs.
        k: number of bins.
        sizes: [n] item sizes, needed with `capacity`.
        capacity: maximum sum of sizes per bin.
        max_count: maximum items per bin.
        equal_count: bin counts differ by at most 1 (each bin gets floor or ceil of
            placed/k); the ceil slots go to the bins that reach them first.

    Returns:
        int64 [n]: the bin of each item, -1 where no bin can take it.

    Raises:
        PlanError: costs or sizes are not finite and >= 0.
        ConfigError: k, capacity or max_count is invalid.
    """
    c, s, k = _check(costs, k, sizes, capacity, max_count)
    out = np.full(len(c), -1, dtype=np.int64)
    order = _lpt_order(c, s, capacity)
    n_eff = len(order) if max_count is None else min(len(order), k * max_count)
    q, r = divmod(n_eff, k)
    limit = max_count if max_count is not None else len(c) + 1
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
            if sl is not None and used[b] + size > capacity:
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
        out = _repair(c, s, k, out, capacity, max_count, equal_count)
    return out


def _greedy_groups(c, s, group, n_groups, k, capacity) -> np.ndarray:
    """`greedy` (no count limits) run in every group at once, one numpy round per rank.

    Round r places the r-th largest item of every group; identical, item for item, to
    calling `greedy` on each group, but the Python loop runs max(group size) times
    instead of n times.
    """
    out = np.full(len(c), -1, dtype=np.int64)
    idx = _lpt_order(c, s, capacity)
    if not len(idx):
        return out
    o = idx[np.lexsort((idx, -c[idx], group[idx]))]  # by group, then LPT order
    g = group[o]
    rank = np.arange(len(o)) - np.searchsorted(g, g)  # position within its group
    table = np.full((n_groups, int(rank.max()) + 1), -1, dtype=np.int64)
    table[g, rank] = o
    loads = np.zeros((n_groups, k))
    used = np.zeros((n_groups, k))  # read only with a capacity
    sz = s if s is not None else np.zeros(len(c))
    rows_all = np.arange(n_groups)
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


def _kk(vals: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    """Largest differencing over `vals` (sorted descending); returns the bin of each."""
    m = len(vals)
    if k == 1 or m < 2:
        return np.zeros(m, dtype=np.int64)
    # A partition is (k subset sums sorted descending, the item naming each subset or
    # -1 if empty); union-find `parent` records which subsets were merged into which.
    parent = np.arange(m)
    if equal_count:
        # Chunks of k consecutive sorted items, one item per subset (padded with empty
        # subsets): all subsets of a partition hold as many items, and merging keeps it so.
        pad = -m % k
        sums = np.concatenate([vals, np.zeros(pad)]).reshape(-1, k)
        ids = np.concatenate([np.arange(m), np.full(pad, -1)]).reshape(-1, k)
        heap: list[tuple[float, int, np.ndarray | None, Any]] = [
            (-(s_[0] - s_[-1]), j, s_, i_) for j, (s_, i_) in enumerate(zip(sums, ids))
        ]
    else:
        heap = [(-v, j, None, j) for j, v in enumerate(vals.tolist())]  # singletons
    heapq.heapify(heap)  # largest spread first; ties by creation order (unique seq)

    def pop():
        _, _, s_, i_ = heapq.heappop(heap)
        if s_ is None:  # singleton (v, 0, ..., 0), built only now: memory stays O(heap)
            j, s_, i_ = i_, np.zeros(k), np.full(k, -1)
            s_[0], i_[0] = vals[j], j
        return s_, i_

    seq = len(heap)
    while len(heap) > 1:
        (sa, ia), (sb, ib) = pop(), pop()
        sb, ib = sb[::-1], ib[::-1]  # largest subset of one meets the smallest of the other
        both = (ia >= 0) & (ib >= 0)
        parent[ib[both]] = ia[both]
        new_s, new_i = sa + sb, np.where(ia >= 0, ia, ib)
        o = np.argsort(-new_s, kind="stable")
        heapq.heappush(heap, (-(new_s[o[0]] - new_s[o[-1]]), seq, new_s[o], new_i[o]))
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


def karmarkar_karp(costs, k, *, sizes=None, capacity=None, max_count=None, equal_count=False) -> np.ndarray:
    """k-way Karmarkar-Karp (largest differencing), repaired to honour the limits.

    Args:
        costs: [n] non-negative item costs.
        k: number of bins.
        sizes: [n] item sizes, needed with `capacity`.
        capacity: maximum sum of sizes per bin (repaired after differencing).
        max_count: maximum items per bin; only the k*max_count largest items take part.
        equal_count: use the equal-size variant: bin counts differ by at most 1.

    Returns:
        int64 [n]: the bin of each item, -1 where no bin can take it. Bins are
        numbered by decreasing load before any repair.

    Raises:
        PlanError: costs or sizes are not finite and >= 0.
        ConfigError: k, capacity or max_count is invalid.
    """
    c, s, k = _check(costs, k, sizes, capacity, max_count)
    out = np.full(len(c), -1, dtype=np.int64)
    order = _lpt_order(c, s, capacity)
    if max_count is not None:
        order = order[: k * max_count]  # the rest could never all be placed: defer the smallest
    out[order] = _kk(c[order], k, equal_count)
    if capacity is not None or (max_count is not None and not equal_count):
        out = _repair(c, s, k, out, capacity, max_count, equal_count)
    return out


def _repair(c, s, k, out, capacity, max_count, equal_count) -> np.ndarray:
    """Make `out` honour the limits, then place every item some bin can still take.

    1. Evict from bins over max_count (smallest cost first) or over capacity (the
       smallest item that removes the excess alone, else the largest).
    2. With equal_count, trim bins above min+1 items (smallest cost first).
    3. Place unplaced items, largest cost first, into the least-loaded bin that can
       take them (with equal_count: only bins at the minimum count), until a full pass
       places nothing. Afterwards no -1 item fits any bin.
    """
    cap = np.inf if capacity is None else capacity
    lim = np.inf if max_count is None else max_count
    sz = s if s is not None else np.zeros_like(c)
    on = out >= 0
    counts = np.bincount(out[on], minlength=k)
    used = np.bincount(out[on], weights=sz[on], minlength=k)
    if (
        (counts <= lim).all()
        and (used <= cap).all()
        and (sz[~on] > cap).all()
        and not (equal_count and np.ptp(counts) > 1)
    ):
        return out  # the common case: nothing to evict, nothing left that fits
    out = out.copy()
    members: list[list[int]] = [[] for _ in range(k)]
    for i in np.flatnonzero(out >= 0).tolist():
        members[out[i]].append(i)
    counts = np.array([len(m) for m in members])
    used = np.bincount(out[out >= 0], weights=sz[out >= 0], minlength=k)
    loads = np.bincount(out[out >= 0], weights=c[out >= 0], minlength=k)

    def evict(b, i):
        members[b].remove(i)
        out[i] = -1
        counts[b] -= 1
        used[b] -= sz[i]
        loads[b] -= c[i]

    def smallest_cost(b):
        return min(members[b], key=lambda i: (c[i], -i))

    for b in range(k):
        while counts[b] > lim:
            evict(b, smallest_cost(b))
        while used[b] > cap:
            excess = used[b] - cap
            enough = [i for i in members[b] if sz[i] >= excess]
            if enough:
                evict(b, min(enough, key=lambda i: (sz[i], c[i], -i)))
            else:
                evict(b, max(members[b], key=lambda i: (sz[i], -c[i], -i)))
    if equal_count:
        top = counts.min() + 1
        for b in range(k):
            while counts[b] > top:
                evict(b, smallest_cost(b))
    pending = [i for i in _lpt_order(c, s, capacity).tolist() if out[i] < 0]
    while pending:
        left = []
        for i in pending:
            ok = (counts < lim) & (used + sz[i] <= cap)
            if equal_count:
                ok &= counts == counts.min()
            if not ok.any():
                left.append(i)
                continue
            b = int(np.where(ok, loads, np.inf).argmin())
            out[i] = b
            members[b].append(i)
            counts[b] += 1
            used[b] += sz[i]
            loads[b] += c[i]
        if len(left) == len(pending):
            break
        pending = left
    return out


def swap_refine(costs, bins, k, *, sizes=None, capacity=None, tol=1e-4, max_iter=None) -> np.ndarray:
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
    c, s, k = _check(costs, k, sizes, capacity, None)
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
    loads = np.bincount(b_of, weights=c[o], minlength=k)
    sz = s if s is not None else np.zeros_like(c)  # read only with a capacity
    used = None if capacity is None else np.bincount(b_of, weights=sz[o], minlength=k)
    stop = loads.mean() * (1 + tol)
    for _ in range(4 * k if max_iter is None else max_iter):
        a = int(loads.argmax())
        if loads[a] <= stop:
            break
        ra = table[a, : cnt[a]]
        ua = None if used is None else used[a]
        swap = _best_swap(c, s, ra, loads[a], ua, table, cnt, loads, used, capacity, int(loads.argmin()))
        if swap is None:  # rare: only then pay for sorting all bins
            for b in np.argsort(loads, kind="stable")[1:8].tolist():
                swap = _best_swap(c, s, ra, loads[a], ua, table, cnt, loads, used, capacity, b)
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


def _best_swap(c, s, ra, la, ua, table, cnt, loads, used, capacity, b):
    """(b, i, j): swapping ra[i] with table[b, j] lowers max(la, load b) the most, or None."""
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
        if capacity is not None:
            ds = s[ra] - s[rb[ob[p]]]
            ok &= (used[b] + ds <= capacity) & (ua - ds <= capacity)
        if ok.any():
            i = int(np.where(ok, new, np.inf).argmin())
            best, best_max = (b, i, int(ob[p[i]])), new[i]
    return best


BALANCERS: dict[str, Balancer] = {"greedy": greedy, "karmarkar_karp": karmarkar_karp}


def register_balancer(name: str, fn: Balancer, *, replace: bool = False) -> None:
    """Add a user-defined balancer (e.g. zig-zag) under `name`.

    Raises:
        ConfigError: `name` is taken (pass replace=True to override) or fn is not callable.
    """
    if not callable(fn):
        raise ConfigError(f"balancer {name!r} must be callable, got {type(fn).__name__}")
    if name in BALANCERS and not replace:
        raise ConfigError(f"balancer {name!r} is already registered; pass replace=True to override")
    BALANCERS[name] = fn


def get_balancer(name: str) -> Balancer:
    """The balancer registered as `name`.

    Raises:
        ConfigError: no balancer has that name; the message lists the known ones.
    """
    try:
        return BALANCERS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown balancer {name!r}; known: {', '.join(sorted(BALANCERS))} (add one with register_balancer)"
        ) from None


MODES = ("two_level", "interleaved", "keep_order")

# Classic (not equal-count) KK does n-1 merges of O(k) numpy work, ~9 us each on 2
# cores: 37 ms for 4096 items over 64 buckets, 1.1 s for 65536 over 1024. Past this
# n*k, `assign` (with refine) uses LPT for that level instead: LPT + swap_refine lands
# within refine's tol (1e-4) of KK's balance at a twentieth of the time.
_CLASSIC_KK_MAX_WORK = 1 << 16


def assign(
    costs,
    buckets,
    bins,
    *,
    inter="karmarkar_karp",
    intra="greedy",
    sizes=None,
    bin_capacity=None,
    equal_count=True,
    refine=True,
    mode="two_level",
    keep_order=False,
):
    """Place items into `buckets` (DP ranks) x `bins` (micro-batches per bucket).

    Modes:
      - "two_level" (default): `inter` spreads items over buckets by cost (with
        `equal_count`, every bucket gets floor or ceil of n/buckets items; with a
        bin_capacity, no bucket takes more than bins*bin_capacity of sizes); then
        `intra` spreads each bucket's items over its bins (no count limit) under
        bin_capacity. Items that fit none of their bucket's bins are deferred, so with
        a bin_capacity bucket counts may then differ by more than 1.
      - "interleaved": `inter` spreads items over all buckets*bins bins at once (with
        `equal_count`, bin counts differ by at most 1), then equal-count
        Karmarkar-Karp deals the bins to buckets by load: each bucket gets exactly
        `bins` bins, numbered in flat order. `intra` is not used.
      - "keep_order" (or keep_order=True): no balancing, the arrival order is the
        batch: item i goes to bucket i % buckets, bin (i // buckets) % bins, as a
        round-robin DataLoader would. Only bin_capacity is enforced: each bin keeps the
        longest prefix (in arrival order) of its items that fits; the rest are deferred.

    Args:
        costs: [n] non-negative item costs (e.g. `cost.transformer_cost(tokens)`).
        buckets: number of buckets (DP ranks).
        bins: micro-batches per bucket.
        inter: balancer name or callable for the bucket level.
        intra: balancer name or callable for the micro-batch level.
        sizes: [n] item sizes (e.g. tokens), needed with bin_capacity.
        bin_capacity: maximum sum of sizes per micro-batch; larger items are deferred.
        equal_count: equal item counts per bucket (two_level) or per bin (interleaved).
        refine: polish the bucket level (interleaved: the flat bins and the deal) with
            `swap_refine`; the micro-batch level is left as `intra` made it.
        mode: one of MODES.
        keep_order: shorthand for mode="keep_order".

    Returns:
        (bucket, bin): int64 [n] each; (-1, -1) for items deferred to a later step.

    Raises:
        ConfigError: unknown mode or balancer, invalid counts or capacity.
        PlanError: costs or sizes are not finite and >= 0, or a balancer's answer is
            not one bin in [-1, k) per item.
    """
    if keep_order:
        if mode not in ("two_level", "keep_order"):
            raise ConfigError(f"keep_order=True contradicts mode={mode!r}; give one of them")
        mode = "keep_order"
    if mode not in MODES:
        raise ConfigError(f"assign(mode={mode!r}); known: {', '.join(MODES)}")
    buckets, bins = _positive_int("buckets", buckets), _positive_int("bins", bins)
    c, s, _ = _check(costs, buckets, sizes, bin_capacity, None)
    if mode == "keep_order":
        return _keep_order(len(c), s, buckets, bins, bin_capacity)
    bucket = np.full(len(c), -1, dtype=np.int64)
    mbin = bucket.copy()
    idx = np.arange(len(c)) if bin_capacity is None else np.flatnonzero(s <= bin_capacity)
    ci, si = c[idx], None if s is None else s[idx]
    if mode == "interleaved":
        k = buckets * bins
        flat = _level(inter, ci, k, si, bin_capacity, equal_count, refine)
        on = flat >= 0
        loads = np.bincount(flat[on], weights=ci[on], minlength=k)
        owner = karmarkar_karp(loads, buckets, equal_count=True)
        if refine:
            owner = swap_refine(loads, owner, buckets)
        local = np.empty(k, dtype=np.int64)
        local[np.lexsort((np.arange(k), owner))] = np.arange(k) % bins
        bucket[idx[on]], mbin[idx[on]] = owner[flat[on]], local[flat[on]]
        return bucket, mbin
    room = None if bin_capacity is None else bins * bin_capacity
    bk = _level(inter, ci, buckets, si, room, equal_count, refine)
    idx, bk = idx[bk >= 0], bk[bk >= 0]
    ci, si = c[idx], None if s is None else s[idx]
    fn = get_balancer(intra) if isinstance(intra, str) else intra
    if fn is greedy:  # the batched form: one numpy round per item rank, not per item
        mb = _greedy_groups(ci, si, bk, buckets, bins, bin_capacity)
    else:
        mb = np.full(len(idx), -1, dtype=np.int64)
        o = np.argsort(bk, kind="stable")
        for part in np.split(o, np.searchsorted(bk[o], np.arange(1, buckets))):
            if len(part):
                mb[part] = _call(fn, ci[part], bins, None if si is None else si[part], bin_capacity, False)
    ok = mb >= 0
    bucket[idx[ok]], mbin[idx[ok]] = bk[ok], mb[ok]
    return bucket, mbin


def _keep_order(n, s, buckets, bins, capacity):
    """Round robin in arrival order; each bin keeps the prefix of its items that fits."""
    i = np.arange(n)
    bucket, mbin = i % buckets, (i // buckets) % bins
    if capacity is not None:
        flat = bucket * bins + mbin
        o = np.argsort(flat, kind="stable")  # each bin's items, in arrival order
        cum = np.cumsum(s[o])
        start = np.searchsorted(flat[o], flat[o])
        before = np.where(start > 0, cum[start - 1], 0.0)
        # Sizes are >= 0, so the running sum within a bin only grows: what fits is a prefix.
        late = o[cum - before > capacity]
        bucket[late] = mbin[late] = -1
    return bucket, mbin


def _level(name, c, k, s, capacity, equal_count, refine):
    """One balancing level: the named balancer (or its fast stand-in), then refinement."""
    fn = get_balancer(name) if isinstance(name, str) else name
    if fn is karmarkar_karp and refine and not equal_count and len(c) * k > _CLASSIC_KK_MAX_WORK:
        fn = greedy
    out = _call(fn, c, k, s, capacity, equal_count)
    return swap_refine(c, out, k, sizes=s, capacity=capacity) if refine else out


def _call(fn, c, k, s, capacity, equal_count):
    """Run a balancer and check its answer, so a user-defined one fails clearly."""
    out = np.asarray(fn(c, k, sizes=s, capacity=capacity, equal_count=equal_count))
    if (
        out.shape != c.shape
        or not np.issubdtype(out.dtype, np.integer)
        or (out.size and (out.min() < -1 or out.max() >= k))
    ):
        raise PlanError(
            f"balancer {getattr(fn, '__name__', fn)!r} returned {out.dtype} {out.shape}; "
            f"need one int in [-1, {k}) per item ({c.shape})"
        )
    return out.astype(np.int64, copy=False)


__all__ = sorted(
    [
        "BALANCERS",
        "Balancer",
        "MODES",
        "assign",
        "get_balancer",
        "greedy",
        "karmarkar_karp",
        "register_balancer",
        "swap_refine",
    ]
)
