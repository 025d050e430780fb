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
micro-batches in each bucket); see its docstring for the modes. `swap_refine` polishes
a placement without changing any bin's count.

The modules behind this one, one idea each: `_limits` (argument checks, LPT order, the
repair to the limits every balancer shares), `_greedy`, `_kk`, `_refine`, `_registry`
(names -> balancers) and `_assign`.
"""

from overlord.plan.balance._assign import MODES, assign
from overlord.plan.balance._greedy import greedy
from overlord.plan.balance._kk import karmarkar_karp
from overlord.plan.balance._refine import swap_refine
from overlord.plan.balance._registry import BALANCERS, Balancer, get_balancer, register_balancer

__all__ = [
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
