"""Online repartitioning (paper, Section 5.2: "reshard data partitions live"): a source's
partition count follows the mixing schedule while the job runs.

The start-up partitioning (partition.py) cuts each source for its peak share in the
whole schedule, so a source the schedule turns away from keeps its partitions, their
read buffers and file state, for the rest of the job, and one it turns to has only what
its peak needed at the weights of the start. With `Autoscale.reshards`, every
`interval` steps the `Repartitioner` sizes each source for the mixtures of the steps
about to be planned (the schedule's weights from this step to `horizon` steps ahead),
with the same costs and budget as the start, and asks for one reshard
(overlord.runtime.reshard) where that target:

- has held for `patience` looks in a row and was another one the look before (a change
  of the schedule, settled), and
- differs from the partitions the source is read by now (an operator's reshard is kept
  until the schedule changes the target again).

Of several such sources, the one whose partitions change by the largest factor goes
first (ties: the job's source order); the others follow at the next looks.

Pure and stateless: the decision at a step is a function of the schedule, the costs,
the budget and the step, never of when or how fast steps ran. So a run given the same
profile reshards at the same steps, and a Planner that takes over decides as the one
before it would have: a reshard it finds in the checkpoint is the one it would make.
A schedule without weights known ahead (`Dynamic`, from trainer metrics) is not
followed: no reshard.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

from overlord.autoscale.partition import Budget, PartitionError, SourceCost, partition

Target = dict[str, int]  # source -> partitions


class Repartitioner:
    """Decides the schedule's reshards (see the module docstring).

    Args:
        costs: each source's profiled cost (the start-up partitioning's).
        budget: the node's budget the start-up partitioning used.
        weights: the schedule's weights at a step (its `weights`).
        start: each source's partitions at start (the target before the first look).
        interval: steps between two looks.
        horizon: steps ahead whose mixtures a look sizes for.
        patience: looks a new target must hold before it is made.
        sizing: `partition`'s keyword arguments (global_batch, plan_ahead, buffer_caps).
    """

    def __init__(
        self,
        costs: Sequence[SourceCost],
        budget: Budget,
        weights: Callable[[int], Sequence[float]],
        start: Target,
        *,
        interval: int,
        horizon: int,
        patience: int = 2,
        **sizing,
    ) -> None:
        self.costs, self.budget, self.weights, self.start = list(costs), budget, weights, dict(start)
        self.interval, self.horizon, self.patience = max(1, interval), max(0, horizon), max(1, patience)
        self.sizing = sizing
        # look step -> target (None: the budget cannot hold it), in the order they were made
        self._targets: collections.OrderedDict[int, Target | None] = collections.OrderedDict()

    def target(self, step: int) -> Target | None:
        """Partitions per source for the mixtures of steps `step` to `step + horizon`
        (the start's, for the whole schedule, at step 0 and before: the first look's
        "before"); None where the budget cannot hold them."""
        if step <= 0:
            return self.start
        if step not in self._targets:
            ahead = sorted({step, *range(step, step + self.horizon + 1, self.interval), step + self.horizon})
            mixes = [dict(zip((c.name for c in self.costs), map(float, self.weights(t)))) for t in ahead]
            now = [dataclasses.replace(c, weight=mixes[0][c.name]) for c in self.costs]
            try:
                sized = partition(now, self.budget, mixtures=mixes, **self.sizing)
                self._targets[step] = {s.name: s.partitions for s in sized.sources}
            except PartitionError:
                self._targets[step] = None
            while len(self._targets) > 4 * self.patience + 4:  # the looks a decision reads back, and some
                self._targets.popitem(last=False)  # the oldest made, never the one just added
        return self._targets[step]

    def look(self, step: int, live: Target) -> tuple[str, int, str] | None:
        """At a step boundary: (source, partitions, why) to reshard before `step`, or None.

        `live`: the partitions each source is read by now.
        """
        if step <= 0 or step % self.interval:
            return None
        held = [self.target(step - k * self.interval) for k in range(self.patience)]
        before = self.target(step - self.patience * self.interval)
        now = held[0]
        if now is None or before is None or any(t is None for t in held):
            return None
        moves = [
            (name, parts)
            for name, parts in now.items()
            if all(t is not None and t[name] == parts for t in held)
            and before[name] != parts
            and live.get(name, parts) != parts
        ]
        if not moves:
            return None
        order = list(now)
        name, parts = max(moves, key=lambda m: (abs(math.log(m[1] / max(1, live[m[0]]))), -order.index(m[0])))
        why = (
            f"autoscaler: the mixing schedule of steps {step} to {step + self.horizon} sizes it for {parts} "
            f"partition(s) (it has {live[name]}; {before[name]} before the schedule changed)"
        )
        return name, parts, why
