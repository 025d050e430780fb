"""Online mixture-driven scaling (paper, Section 5.2): transform workers follow demand.

The Planner knows, step by step, how many samples it takes from each source. The
`Scaler` keeps an exponential moving average of each source's share of them; a
source's demand is that share times its profiled cost per sample. Every `interval`
steps it sets each source's transform workers (threads per loader partition, see
`SourceLoader.set_workers`) in proportion to its demand, the most demanded source at
`max_workers`, the others down to 1. A new count is applied only after it has been the
target for `patience` consecutive intervals, so a brief swing of the mixture does not
make workers flap.

Workers change who transforms a sample, never which sample comes next or its bytes:
scaling keeps exactly-once delivery and the deterministic order. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Scaler:
    costs_ms: dict[str, float]  # profiled cost per sample, per source
    current: dict[str, int]  # workers per partition now, per source
    max_workers: int = 4
    interval: int = 8
    patience: int = 3
    alpha: float = 0.3
    average: dict[str, float] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)
    _pending: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (target, intervals seen)

    def observe(self, step: int, counts: dict[str, int]) -> dict[str, int]:
        """Record the samples step `step` took per source; returns the sources whose
        worker count changes now (empty most steps)."""
        for name, n in counts.items():
            self._counts[name] = self._counts.get(name, 0) + n
        if (step + 1) % self.interval:
            return {}
        total = sum(self._counts.values()) or 1
        for name in self.current:
            share = self._counts.get(name, 0) / total
            prev = self.average.get(name)
            self.average[name] = share if prev is None else self.alpha * share + (1 - self.alpha) * prev
        self._counts = {}
        demand = {n: self.average[n] * max(self.costs_ms.get(n, 0.0), 1e-6) for n in self.current}
        top = max(demand.values(), default=0.0) or 1.0
        changed = {}
        for name, d in demand.items():
            target = max(1, min(self.max_workers, round(self.max_workers * d / top)))
            if target == self.current[name]:
                self._pending.pop(name, None)
                continue
            seen = self._pending.get(name, (target, 0))
            seen = (target, seen[1] + 1) if seen[0] == target else (target, 1)
            if seen[1] >= self.patience:
                self.current[name] = target
                changed[name] = target
                self._pending.pop(name, None)
            else:
                self._pending[name] = seen
        return changed
