"""Scaling: each plan's per-source sample counts feed the Scaler (overlord.autoscale),
and its decisions reach the loaders.

The Scaler (pure) turns the samples each step took per source, and when, into a
worker count per source partition. This controller feeds it the plans, the sources'
per-sample costs (what the start-up partitioning measured, then what loaders journal)
and the mix of the steps about to be planned, and publishes:

    workers    hash    stream -> transform workers per partition (loaders follow it)
    scaling    stream  one entry per changed source: step, workers, rate, demand, cost
    planner    hash    `pressure`: busy workers demanded over the loaders' CPU budget

and, when one loader process's demand stays above the others', a stream to hand to
another process (`handoff`, made by overlord.planner.handoff at the next step).

On several nodes the placement weighs each loader process's demand (`loader_demand`)
against its node's budget, and hands back the live nodes' loader CPUs (`set_budget`).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import redis

from overlord.autoscale.apply import budget_of
from overlord.autoscale.profile import costs_from, journaled
from overlord.autoscale.rebalance import Rebalancer
from overlord.autoscale.scaler import Scaler
from overlord.config import Autoscale, Job
from overlord.plan.step_plan import Plan
from overlord.runtime.layout import Layout
from overlord.runtime.reshard import RETIRED
from overlord.store import Keys
from overlord.store.schema import COUNTER_OVER_BUDGET, PLANNER_PRESSURE, scaling_entry

log = logging.getLogger("overlord.planner")

COSTS_EVERY = 64  # steps between two reads of the profile journal


class Scaling:
    """Feeds each plan's per-source sample counts to the Scaler; publishes its decisions."""

    def __init__(self, r: redis.Redis, keys: Keys, job: Job, layout: Layout) -> None:
        self.r, self.keys, self.job, self.layout = r, keys, job, layout
        self.names = [job.sources[i].name for i in layout.stream_source]  # stream -> source
        current = {s.name: 1 for s in job.sources}
        for stream, n in r.hgetall(keys.workers).items():
            current[stream.decode().rsplit(".", 1)[0]] = int(n)
        autoscale = job.autoscale or Autoscale()
        self.scaler = Scaler(
            costs_ms={},
            current=current,
            partitions=live_partitions(job, layout),
            cpus=budget_of(job).loader_cpus,
            max_workers=autoscale.max_threads,
            interval=autoscale.scale_interval,
        )
        self.warned = False
        on = autoscale.handoffs and layout.loaders > 1
        self.rebalancer = Rebalancer(layout.loaders) if on else None
        # far enough ahead that workers are up before the read buffers of the old mix drain
        self.lookahead = 2 * self.scaler.interval + job.plan_ahead
        self._costs()

    def _costs(self) -> None:
        if not self.scaler.costs_ms:  # what the start-up partitioning measured, until loaders journal
            stored = self.r.get(self.keys.autoscale)
            self.scaler.costs_ms.update(json.loads(stored).get("costs_ms", {}) if stored else {})
        costs = costs_from(journaled(self.r, self.keys), self.job)
        self.scaler.costs_ms.update({name: c.transform_ms for name, c in costs.items()})

    def grow(self, layout: Layout) -> None:
        """Scale `layout`'s streams (a reshard): a source's demand is split over the
        streams that read it now."""
        self.layout = layout
        self.names = [self.job.sources[i].name for i in layout.stream_source]
        self.scaler.partitions = live_partitions(self.job, layout)
        live = layout.live
        # the new streams start with their source's workers per partition, as the others run
        workers = {
            layout.streams[i]: self.scaler.current[self.names[i]]
            for i in live
            if self.scaler.current.get(self.names[i], 1) != 1
        }
        if workers:
            self.r.hset(self.keys.workers, mapping=workers)

    def stream_demand(self) -> list[float]:
        """Per stream, the transform workers it keeps busy (its source's demand over its
        partitions; none for a stream a reshard retired)."""
        scaler, home = self.scaler, self.layout.loader_of
        return [
            0.0 if home[i] == RETIRED else scaler.demand(name) / max(1, scaler.partitions.get(name, 1))
            for i, name in enumerate(self.names)
        ]

    def loader_demand(self, serving: list[int] | None = None) -> dict[str, float]:
        """What each loader process (`loader<k>`) demands: busy transform workers
        (`serving`: the process of each stream, the layout's by default)."""
        demand: dict[str, float] = {}
        for k, d in zip(self.layout.loader_of if serving is None else serving, self.stream_demand()):
            if k != RETIRED:
                demand[f"loader{k}"] = demand.get(f"loader{k}", 0.0) + d
        return demand

    def handoff(self, step: int, serving: list[int], allowed) -> tuple[int, int, str] | None:
        """At a scaling decision: a stream to hand to another loader process, with why
        (rebalance.py), or None."""
        if self.rebalancer is None or (step + 1) % self.scaler.interval:
            return None
        demand = self.stream_demand()
        move = self.rebalancer.look(demand, serving, allowed)
        if move is None:
            return None
        load = self.loader_demand(serving)
        why = "loader process demand " + ", ".join(f"{u} {d:.2f}" for u, d in sorted(load.items())) + " workers"
        return move[0], move[1], why

    def set_budget(self, cpus: float) -> None:
        """The loaders' CPU budget the pressure is over (on several nodes: all live nodes')."""
        if cpus:
            self.scaler.cpus = cpus

    def observe(self, plan: Plan, schedule) -> dict[str, int]:
        """Count what `plan` took per source; publish the pressure every interval and
        the worker counts that change.

        Args:
            plan: the step just published.
            schedule: the mixing schedule (its `weights(step)`, where it has them, gives
                the mix of the steps about to be planned).

        Returns:
            source -> workers per partition, for the sources that change now.
        """
        scaler, r, keys = self.scaler, self.r, self.keys
        if plan.step % COSTS_EVERY == 0:
            self._costs()
        ahead = None
        if hasattr(schedule, "weights"):  # the mix of the steps about to be planned
            w = np.asarray(schedule.weights(plan.step + self.lookahead), dtype=np.float64)
            if w.sum() > 0:
                share = w / w.sum() * self.job.batch.global_batch
                ahead = {s.name: float(share[i]) for i, s in enumerate(self.job.sources)}
        per_stream: list[int] = np.bincount(plan.items[:, 0], minlength=len(self.names)).tolist()
        counts: dict[str, int] = {}
        for stream, n in enumerate(per_stream):
            if n:
                counts[self.names[stream]] = counts.get(self.names[stream], 0) + n
        changed = scaler.observe(plan.step, counts, time.monotonic(), ahead)
        if (plan.step + 1) % scaler.interval == 0:
            pressure = round(scaler.pressure, 3)
            pipe = r.pipeline(transaction=False)
            pipe.hset(keys.planner, PLANNER_PRESSURE, pressure)
            if pressure > 1:
                pipe.hincrby(keys.counters, COUNTER_OVER_BUDGET, 1)
                if not self.warned:
                    log.warning(
                        "step %d: the sources demand %.1fx the loaders' CPU budget (%.1f CPUs); trainers "
                        "will wait on loading: raise Job.autoscale cpus or lower the costly sources' weights",
                        plan.step,
                        pressure,
                        scaler.cpus,
                    )
                    self.warned = True
            pipe.execute()
        if not changed:
            return changed
        pipe = r.pipeline(transaction=True)
        pipe.hset(
            keys.workers,
            mapping={
                stream: changed[self.names[i]]
                for i, stream in enumerate(self.layout.streams)
                if self.names[i] in changed and self.layout.loader_of[i] != RETIRED
            },
        )
        for name, workers in changed.items():
            pipe.xadd(
                keys.scaling,
                scaling_entry(
                    plan.step,
                    name,
                    workers,
                    rate=round(scaler.rate.get(name, 0.0), 2),
                    demand=round(scaler.demand(name), 3),
                    cost_ms=round(scaler.costs_ms.get(name, 0.0), 4),
                ),
                maxlen=10000,
                approximate=True,
            )
        pipe.execute()
        log.info(
            "step %d: transform workers per partition now %s (busy workers demanded %s)",
            plan.step,
            changed,
            {n: round(scaler.demand(n), 2) for n in scaler.current},
        )
        return changed


def live_partitions(job: Job, layout: Layout) -> dict[str, int]:
    """The streams each source is read by in `layout` (after its reshards)."""
    sources = [layout.stream_source[i] for i in layout.live]
    return {s.name: sources.count(i) for i, s in enumerate(job.sources)}
