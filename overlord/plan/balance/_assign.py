"""`assign`: the two levels of the paper's `balance` (buckets = DP ranks, then bins =
micro-batches in each bucket), composed from the balancers and `swap_refine`."""

from __future__ import annotations

from functools import partial

import numpy as np
from numpy.typing import ArrayLike, NDArray

from overlord.errors import ConfigError, PlanError
from overlord.plan.balance._greedy import greedy, greedy_groups
from overlord.plan.balance._kernels import NATIVE
from overlord.plan.balance._kk import karmarkar_karp
from overlord.plan.balance._limits import Bins, Costs, check, cost_order, positive_int, restrict
from overlord.plan.balance._refine import TOL, swap_refine
from overlord.plan.balance._registry import Balancer, get_balancer

MODES = ("two_level", "interleaved", "keep_order")

# Classic (not equal-count) KK does n-1 merges of O(k) numpy work, ~9 us each on 2
# cores: 37 ms for 4096 items over 64 buckets, 1.1 s for 65536 over 1024. Past this
# n*k, `assign` (with refine) uses LPT for that level instead: LPT + swap_refine lands
# within refine's tol (1e-4) of KK's balance at a twentieth of the time.
_CLASSIC_KK_MAX_WORK = 1 << 16


def assign(
    costs: ArrayLike,
    buckets: int,
    bins: int,
    *,
    inter: str | Balancer = "karmarkar_karp",
    intra: str | Balancer = "greedy",
    sizes: ArrayLike | None = None,
    bin_capacity: float | None = None,
    equal_count: bool = True,
    refine: bool = True,
    mode: str = "two_level",
    keep_order: bool = False,
) -> tuple[Bins, Bins]:
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
    buckets, bins = positive_int("buckets", buckets), positive_int("bins", bins)
    if mode == "two_level" and sizes is None and bin_capacity is None and equal_count and refine:
        shipped = _shipped_two_level(costs, buckets, bins, inter, intra)
        if shipped is not None:
            return shipped
    c, s, _ = check(costs, buckets, sizes, bin_capacity, None)
    if mode == "keep_order":
        return _keep_order(len(c), s, buckets, bins, bin_capacity)
    bucket = np.full(len(c), -1, dtype=np.int64)
    mbin = bucket.copy()
    # check() refuses a bin_capacity without sizes
    idx = np.arange(len(c)) if bin_capacity is None or s is None else np.flatnonzero(s <= bin_capacity)
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
    lpt = cost_order(ci, descending=True)  # the LPT order, for both levels' shipped balancers
    bk = _level(inter, ci, buckets, si, room, equal_count, refine, lpt)
    keep = bk >= 0
    idx, bk = idx[keep], bk[keep]
    ci, si = c[idx], None if s is None else s[idx]
    fn = get_balancer(intra) if isinstance(intra, str) else intra
    if fn is greedy:  # the batched form: one numpy round per item rank, not per item
        mb = greedy_groups(ci, si, bk, buckets, bins, bin_capacity, restrict(lpt, keep))
    else:
        mb = np.full(len(idx), -1, dtype=np.int64)
        o = np.argsort(bk, kind="stable")
        for part in np.split(o, np.searchsorted(bk[o], np.arange(1, buckets))):
            if len(part):
                mb[part] = _call(fn, ci[part], bins, None if si is None else si[part], bin_capacity, False)
    ok = mb >= 0
    bucket[idx[ok]], mbin[idx[ok]] = bk[ok], mb[ok]
    return bucket, mbin


def _shipped_two_level(
    costs: ArrayLike, buckets: int, bins: int, inter: str | Balancer, intra: str | Balancer
) -> tuple[Bins, Bins] | None:
    """The default two levels (Karmarkar-Karp and refinement over buckets, greedy over
    bins) in one call of the compiled kernel, the same bins as the composed path below
    (tests/plan/test_balance_native.py); None where that path must run: other
    balancers, no kernel built, or costs it must refuse by name. One call in place of
    some thirty numpy calls and checks: ~0.13 ms of the demo's ~0.7 ms Planner step."""
    kernel = getattr(NATIVE, "two_level", None)  # None also from an extension built before it existed
    if kernel is None or _balancer(inter) is not karmarkar_karp or _balancer(intra) is not greedy:
        return None
    c = np.ascontiguousarray(costs, dtype=np.float64)
    if c.ndim != 1 or not len(c):
        return None
    bucket, mbin = np.empty(len(c), dtype=np.int64), np.empty(len(c), dtype=np.int64)
    try:
        kernel(c, buckets, bins, TOL, bucket, mbin)
    except ValueError:  # a cost NaN, infinite or negative: `check` names it
        return None
    return bucket, mbin


def _balancer(spec: str | Balancer) -> Balancer:
    return get_balancer(spec) if isinstance(spec, str) else spec


def _keep_order(n: int, s: Costs | None, buckets: int, bins: int, capacity: float | None) -> tuple[Bins, Bins]:
    """Round robin in arrival order; each bin keeps the prefix of its items that fits."""
    i = np.arange(n, dtype=np.int64)
    bucket, mbin = i % buckets, (i // buckets) % bins
    if capacity is not None and s is not None:  # check() refuses a capacity without sizes
        flat = bucket * bins + mbin
        o = np.argsort(flat, kind="stable")  # each bin's items, in arrival order
        cum = np.cumsum(s[o])
        start = np.searchsorted(flat[o], flat[o])
        before = np.where(start > 0, cum[start - 1], 0.0)
        # Sizes are >= 0, so the running sum within a bin only grows: what fits is a prefix.
        late = o[cum - before > capacity]
        bucket[late] = mbin[late] = -1
    return bucket, mbin


def _level(
    name: str | Balancer,
    c: Costs,
    k: int,
    s: Costs | None,
    capacity: float | None,
    equal_count: bool,
    refine: bool,
    lpt: NDArray[np.intp] | None = None,
) -> Bins:
    """One balancing level: the named balancer (or its fast stand-in), then refinement.
    `lpt` (the LPT order of `c`) is handed to the shipped balancers, which need it."""
    fn = get_balancer(name) if isinstance(name, str) else name
    if fn is karmarkar_karp and refine and not equal_count and len(c) * k > _CLASSIC_KK_MAX_WORK:
        fn = greedy
    if lpt is not None and (fn is karmarkar_karp or fn is greedy):
        out = _call(partial(fn, order=lpt), c, k, s, capacity, equal_count)
    else:
        out = _call(fn, c, k, s, capacity, equal_count)
    return swap_refine(c, out, k, sizes=s, capacity=capacity) if refine else out


def _call(fn: Balancer, c: Costs, k: int, s: Costs | None, capacity: float | None, equal_count: bool) -> Bins:
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
