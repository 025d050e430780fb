"""Rebalancing loader processes live: which stream to hand to which process.

The Scaler (scaler.py) gives each source a demand: the transform workers it keeps busy
at the rate the mixture takes it. A loader process's demand is the sum of its streams'
(a source's demand is split evenly over its partitions: the Planner draws a source's
samples from its streams alike). When the mixture shifts, a process whose sources
gained weight can demand more than one process can give while another idles; the
`Rebalancer` then picks the one handoff (stream -> process) that lowers the busiest
process's demand most, and the Planner makes it at the next step boundary
(overlord.planner.handoff). A source split into partitions is thereby read by more
processes when it needs them, and by fewer when it does not.

Decisions are slow on purpose: the busiest process must stay above `tolerance` x the
mean for `patience` looks in a row, a handoff must lower the maximum by at least
`min_gain` workers, and a stream handed off is not moved again for `rest` looks (a
handoff costs the receiving process a cold start of the stream's file state).
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def best_handoff(
    demand: list[float], serving: list[int], loaders: int, allowed: Callable[[int, int], bool], min_gain: float
) -> tuple[int, int] | None:
    """The (stream, process) whose handoff lowers the busiest process's demand the most,
    by at least `min_gain`; None if no single handoff does.

    Args:
        demand: per stream, the workers it keeps busy.
        serving: per stream, the loader process serving it now.
        loaders: how many loader processes there are.
        allowed: whether stream s may go to process k.
    """
    load = [0.0] * loaders
    for s, k in enumerate(serving):
        load[k] += demand[s]
    top = max(range(loaders), key=load.__getitem__)
    best: tuple[float, int, int] | None = None
    for s, k in enumerate(serving):
        if k != top or demand[s] <= 0:
            continue
        for to in range(loaders):
            if to == top or not allowed(s, to):
                continue
            after = list(load)
            after[top] -= demand[s]
            after[to] += demand[s]
            peak = max(after)
            if load[top] - peak >= min_gain and (best is None or peak < best[0]):
                best = (peak, s, to)
    return None if best is None else (best[1], best[2])


@dataclass
class Rebalancer:
    loaders: int
    tolerance: float = 1.25  # busiest process over the mean that counts as imbalance
    min_gain: float = 0.25  # workers a handoff must take off the busiest process
    patience: int = 2  # looks in a row the imbalance must last
    rest: int = 4  # looks a stream handed off stays where it went
    _seen: int = 0
    _rested: dict[int, int] = field(default_factory=dict)  # stream -> looks left before it may move

    def look(
        self, demand: list[float], serving: list[int], allowed: Callable[[int, int], bool]
    ) -> tuple[int, int] | None:
        """One look (once per scaling interval): the handoff to make now, or None."""
        self._rested = {s: n - 1 for s, n in self._rested.items() if n > 1}
        load = [0.0] * self.loaders
        for s, k in enumerate(serving):
            load[k] += demand[s]
        mean = sum(load) / self.loaders if self.loaders else 0.0
        if self.loaders < 2 or mean <= 0 or max(load) <= self.tolerance * mean:
            self._seen = 0
            return None
        self._seen += 1
        if self._seen < self.patience:
            return None
        move = best_handoff(
            demand, serving, self.loaders, lambda s, to: s not in self._rested and allowed(s, to), self.min_gain
        )
        if move is not None:
            self._seen = 0
            self._rested[move[0]] = self.rest
        return move
