"""Placing: the controller that keeps the `placement` hash true to the job's nodes.

The decisions are pure (placement.py: `place` for the membership, `relieve` for
capacity); this controller looks at Redis for their inputs and writes their outcome:

    nodes        hash    node -> its registration (cpus, loader_cpus, memory_mb)
    heartbeat    keys    a sidecar's, per node (a node is live while it beats)
    heartbeat    keys    a Shadow Loader's (one that beats is promoted, not replaced)
    placement    hash    unit -> node (sidecars start and stop units to follow it)
    placements   stream  one entry per move: unit, from, to, reason

It looks at the membership every CHECK_S. Given the loaders' demand (from the
autoscaler: see scaling.py), it also looks at the nodes' load every CAPACITY_S: each
unit's RSS (its heartbeat) and CPU demand against each node's registered budget; a
node over budget for PATIENCE looks in a row hands a loader process off. The look
publishes the nodes' pressures (`planner` hash, `node_pressure`) and returns the live
nodes' loader CPUs, the budget the job's pressure is over. Moves are fenced under the
Planner's lease.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from overlord.runtime.lease import Lease, WriteUncertain
from overlord.runtime.placement import Use, place, pressure, relieve, unit_role
from overlord.store import Keys
from overlord.store.schema import PLANNER_NODE_PRESSURE, encode_node_pressure, json_records, move_entry

log = logging.getLogger("overlord.planner")

CHECK_S = 0.1  # between two looks at the membership
CAPACITY_S = 1.0  # between two looks at the nodes' load (role heartbeats beat once a second)
PATIENCE = 3  # looks a node must be over budget before a loader moves off it


class Placer:
    """Places the job's units on its nodes as the membership and the nodes' load change."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        lease: Lease,
        home: dict[str, str],
        nodes: tuple[str, ...] | list[str],
        *,
        check_s: float = CHECK_S,
        capacity_s: float = CAPACITY_S,
    ) -> None:
        """Args:
        home: every unit's home node (placement.homes).
        nodes: the job's node ids.
        check_s, capacity_s: between two looks at the membership, and at the load.
        """
        self.r, self.keys, self.lease, self.home, self.nodes = r, keys, lease, home, list(nodes)
        self.shadows = sorted(u for u in home if u.startswith("shadow"))  # Shadow Loader units
        self.check_s, self.capacity_s = check_s, capacity_s
        self.next_check = 0.0
        self.next_capacity = time.monotonic() + capacity_s
        self.over_for: dict[str, int] = {}  # node -> consecutive looks over its budget
        self.use: dict[str, Use] = {}  # unit -> Use, at the last look
        self.budget: dict[str, Use] = {}  # node -> Use (its budget)

    def due(self) -> bool:
        """Whether `check` would look now (callers compute its inputs only then)."""
        return time.monotonic() >= self.next_check

    def check(self, demand: dict[str, float] | None = None) -> float | None:
        """Look at the membership (and, with `demand`, the load) and move units.

        Args:
            demand: unit -> CPUs it demands, when the job scales online; None places
                for the membership alone.

        Returns:
            The live nodes' loader CPUs when this call looked at the load, else None.
        """
        if not self.due():
            return None
        self.next_check = time.monotonic() + self.check_s
        r, keys = self.r, self.keys
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(keys.nodes)
        pipe.hgetall(keys.placement)
        for n in self.nodes:
            pipe.exists(keys.heartbeat("sidecar", n))
        for unit in self.shadows:
            pipe.exists(keys.heartbeat(*map(str, unit_role(unit))))
        raw_members, raw_current, *beats = pipe.execute()
        registered = {k.decode() for k in raw_members}
        live = {n for n, alive in zip(self.nodes, beats) if alive}
        standby = {u for u, alive in zip(self.shadows, beats[len(self.nodes) :]) if alive}
        members = json_records(raw_members)
        cpus = {n: float(m.get("cpus") or 1) for n, m in members.items()}
        current = {k.decode(): v.decode() for k, v in raw_current.items()}
        placed = place(self.home, current, live, registered, cpus, standby)
        why: dict[str, str] = {}
        budget = None
        if demand is not None:  # between two looks at the load, the last look's figures hold
            over: set[str] = set()
            if time.monotonic() >= self.next_capacity:
                self.next_capacity = time.monotonic() + self.capacity_s
                over = self._measure(current or placed, live, members, demand)
                budget = sum(self.budget[n].cpus for n in live if n in self.budget)
            placed, why = relieve(placed, current, self.home, live, self.use, self.budget, over)
        moved = {u: n for u, n in placed.items() if current.get(u) != n}
        gone = sorted(u for u in current if u in self.home and u not in placed)  # a shadow with no node to go to
        if moved or gone:
            self._move(moved, gone, current, why, live)
        return budget

    def _move(
        self, moved: dict[str, str], gone: list[str], current: dict[str, str], why: dict[str, str], live: set[str]
    ) -> None:
        keys = self.keys

        def write(pipe) -> None:
            if moved:
                pipe.hset(keys.placement, mapping=moved)
            if gone:
                pipe.hdel(keys.placement, *gone)
            for unit, node in moved.items():
                before = current.get(unit, "")
                reason = why.get(unit) or ("home" if node == self.home[unit] else f"node {before} down")
                pipe.xadd(keys.placements, move_entry(unit, before, node, reason), maxlen=1000, approximate=True)
            for unit in gone:
                reason = "no live node other than its loader's"
                pipe.xadd(keys.placements, move_entry(unit, current[unit], "", reason), maxlen=1000, approximate=True)

        try:
            self.lease.fenced(write)
        except WriteUncertain:
            self.next_check = self.next_capacity = 0.0
            return
        for node in {current[u] for u in why if u in current}:
            self.over_for.pop(node, None)  # patience again before its next loader moves
        log.warning(
            "placement: %s (live nodes %s)%s",
            {**{u: f"{current.get(u)} -> {n}" for u, n in moved.items()}, **{u: f"{current[u]} -> -" for u in gone}},
            sorted(live),
            f"; for capacity: {why}" if why else "",
        )

    def _measure(
        self, current: dict[str, str], live: set[str], members: dict[str, dict], demand: dict[str, float]
    ) -> set[str]:
        """Look at the nodes' load: what each unit demands and its RSS, against each
        node's registered budget. Returns the nodes over budget for PATIENCE looks in a row."""
        r, keys = self.r, self.keys
        units = list(self.home)
        pipe = r.pipeline(transaction=False)
        for unit in units:
            role, index = unit_role(unit)
            pipe.get(keys.heartbeat(role, str(index)))
        rss = {u: float(json.loads(raw).get("rss_mb", 0.0)) if raw else 0.0 for u, raw in zip(units, pipe.execute())}
        self.use = {u: Use(cpus=demand.get(u, 0.0), mb=rss[u]) for u in units}
        self.budget = {
            n: Use(cpus=float(m.get("loader_cpus") or m.get("cpus") or 0), mb=float(m.get("memory_mb") or 0))
            for n, m in members.items()
        }
        now = {n: pressure(n, current, self.use, self.budget) for n in live}
        self.over_for = {n: self.over_for.get(n, 0) + 1 if p > 1 else 0 for n, p in now.items()}
        r.hset(keys.planner, PLANNER_NODE_PRESSURE, encode_node_pressure(now))
        return {n for n, count in self.over_for.items() if count >= PATIENCE}
