"""Online mixture-driven scaling (paper, Section 5.2): transform workers follow demand.

The Planner knows, step by step, how many samples it takes from each source and how
fast. The `Scaler` keeps an exponential moving average of each source's consumption
rate (samples per second); its demand is that rate times its profiled cost per sample
(seconds), i.e. how many workers it keeps busy. Every `interval` steps it sets each
source's transform workers (threads per loader partition, see
`SourceLoader.set_workers`) to cover the demand with `headroom`, between 1 and
`max_workers`. A source its workers cannot keep up with is consumed at what they
supply, so its demand reads as their full capacity: past `SATURATED` of it, its
workers double. Scaling up applies at once; scaling down only after the lower count
has been the target for `patience` consecutive intervals, so a brief swing of the
mixture does not take workers away that are needed again right after.

Against the node's budget (`cpus` for the loaders) it reports `pressure`: the busy
workers demanded over the CPUs there are. Above 1 the node cannot keep up with the
mixture however workers are dealt; the read buffers, bounded, then hold the trainers
back (back-pressure). The Planner publishes the pressure for an operator; on several
nodes it also weighs each node's loader processes against that node's budget and moves
loaders off a node over it (overlord.runtime.placement.relieve).

Workers change who transforms a sample, never which sample comes next or its bytes:
scaling keeps exactly-once delivery and the deterministic order. Pure: no I/O (time
comes in as an argument).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SATURATED = 0.8  # busy fraction of its workers at which a source counts as starved


@dataclass
class Scaler:
    costs_ms: dict[str, float]  # profiled cost per sample, per source
    current: dict[str, int]  # workers per partition now, per source
    partitions: dict[str, int] = field(default_factory=dict)  # loader partitions per source (default 1)
    max_workers: int = 4
    interval: int = 8
    patience: int = 3  # intervals a lower count must hold before workers are reclaimed (up: 1)
    alpha: float = 0.5
    headroom: float = 1.5
    cpus: float = 0.0  # the loaders' CPU budget (0: unbounded)
    pressure: float = 0.0  # busy workers demanded over the budget, last interval (> 1: over)
    rate: dict[str, float] = field(default_factory=dict)  # moving average, samples/s
    best_pace: float = 0.0  # steps/s the job reached lately (decaying maximum)
    pace_decay: float = 0.95  # per interval
    _counts: dict[str, int] = field(default_factory=dict)
    _since: float | None = None
    _steps: int = 0  # steps counted since `_since`
    _pending: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (target, intervals seen)

    def demand(self, name: str) -> float:
        """Workers (busy transform threads, over all partitions) the source keeps busy."""
        return self.rate.get(name, 0.0) * self.costs_ms.get(name, 0.0) / 1000

    def observe(
        self, step: int, counts: dict[str, int], now: float, ahead: dict[str, float] | None = None
    ) -> dict[str, int]:
        """Record the samples step `step` took per source at time `now` (seconds); returns
        the sources whose worker count changes now (empty most steps).

        `ahead`: samples per step each source is scheduled to give in the steps about to
        be planned (from the mixing schedule). With it, demand is projected: the pace
        the job reached lately times those counts, so workers are in place when the
        mixture shifts, instead of after a starved source shows its need.
        """
        if self._since is None:  # the first step starts the clock: the time it took is not known
            self._since = now
            return {}
        for name, n in counts.items():
            self._counts[name] = self._counts.get(name, 0) + n
        self._steps += 1
        if (step + 1) % self.interval or now <= self._since:
            return {}
        elapsed, self._since = now - self._since, now
        self.best_pace = max(self.best_pace * self.pace_decay, self._steps / elapsed)
        self._steps = 0
        for name in self.current:
            rate = self._counts.get(name, 0) / elapsed
            prev = self.rate.get(name)
            self.rate[name] = rate if prev is None else self.alpha * rate + (1 - self.alpha) * prev
            if ahead is not None:  # projected: what the schedule will ask at the pace the job can go
                self.rate[name] = max(self.rate[name], self.best_pace * ahead.get(name, 0.0))
        self._counts = {}
        total = sum(self.demand(n) for n in self.current)
        self.pressure = total / self.cpus if self.cpus > 0 else 0.0
        changed = {}
        for name, now_workers in self.current.items():
            per_partition = self.demand(name) / max(1, self.partitions.get(name, 1))
            target = math.ceil(per_partition * self.headroom)
            if per_partition >= SATURATED * now_workers:
                target = max(target, 2 * now_workers)  # starved: it can only show what it got; double
            target = max(1, min(self.max_workers, target))
            if target == now_workers:
                self._pending.pop(name, None)
                continue
            seen = self._pending.get(name, (target, 0))
            seen = (target, seen[1] + 1) if seen[0] == target else (target, 1)
            if seen[1] >= (1 if target > now_workers else self.patience):  # up at once, down with patience
                self.current[name] = target
                changed[name] = target
                self._pending.pop(name, None)
            else:
                self._pending[name] = seen
        return changed
