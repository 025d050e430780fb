"""Where each role of a job on several nodes runs: the Planner's placement.

The units placed are the Source Loader processes (`loader<k>`: a source partition's
file state exists once per job, in the one process hosting it) and the Data
Constructor hosts (`constructor<h>`, one per node, building the DP groups whose ranks
live there). Every unit has a home:

- a Data Constructor host lives on the node of its DP groups, so micro-batches reach
  their trainers through the node's shared-memory rings;
- Source Loader processes are dealt round robin over the nodes, so the job's reading
  and transform CPU is spread and no source is read twice;
- the Shadow Loader of a loader process whose source has `shadow: true` (`shadow<k>`)
  lives on a node other than its loader's (the next node in the job's order), so the
  death or the cut of one node never takes both.

The Planner keeps the placement in Redis (`placement` hash) and changes it when the
membership changes: the units of a node whose sidecar died (it registered, and its
heartbeat lapsed) go to the live node with the fewest units per CPU, and come home
when its sidecar is back. A loader with a shadow is the exception: where its node dies
while its shadow beats on a live node, the Planner's promotion (overlord.planner.promotion)
moves it to its shadow's node, hot, instead of a restart from the cursors; it stays
there (a trip home would restart it cold), and its new shadow goes to another live node
(none while no other node lives).

It also moves loader processes for capacity (`relieve`, the paper's remote fallback:
use remote resources only when the sidecar's run out). Each node registers a budget
(loader CPUs, memory); the autoscaler measures what each loader process demands (busy
transform workers) and every role reports its RSS. A node over its budget for a
while hands its loader processes, one at a time, to live nodes that stay within
theirs with it. Where no node can hold a loader within its budget, it still goes to the
node that holds it best if that at least halves the worse of the two nodes' pressures
(`GAIN`): a loader demanding 4 CPUs runs far better on a node offering 3 than on one
offering 0.05. A loader goes home once its node has room for it again, with a margin
(`ROOM`) so a unit does not swing between two nodes on a noisy reading. A Data
Constructor never moves for capacity: it belongs next to its trainers.

Sidecars start and stop units to follow the hash; data crosses nodes over Arrow
Flight wherever a loader and a constructor, or a constructor and its trainers, end up
apart. Pure functions: tested without Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlord.config import Job
from overlord.runtime.layout import Layout


def homes(job: Job, layout: Layout) -> dict[str, str]:
    """Every unit's home node (a shadow's: the node after its loader's)."""
    nodes = job.node_ids
    home = {f"loader{k}": nodes[k % len(nodes)] for k in range(layout.loaders)}
    home.update({f"constructor{h}": nodes[h] for h in range(layout.constructor_hosts)})
    if len(nodes) > 1:
        home.update({shadow_unit(k): nodes[(k + 1) % len(nodes)] for k in layout.shadowed})
    return home


def shadow_unit(loader: int) -> str:
    """The placed unit of loader process `loader`'s Shadow Loader."""
    return f"shadow{loader}"


def unit_role(unit: str) -> tuple[str, int]:
    """(role, index) of a placed unit: `loader3` -> ("loader", 3)."""
    role = unit.rstrip("0123456789")
    return role, int(unit[len(role) :])


def _shadowed(home: dict[str, str]) -> dict[str, str]:
    """Loader unit -> its shadow's unit, for the loaders with a shadow."""
    return {f"loader{unit_role(u)[1]}": u for u in home if u.startswith("shadow")}


def place(
    home: dict[str, str],
    current: dict[str, str],
    live: set[str],
    registered: set[str],
    cpus: dict[str, float] | None = None,
    standby: set[str] | frozenset[str] = frozenset(),
) -> dict[str, str]:
    """The placement for this membership.

    A unit runs at home unless its home node registered and is no longer live; then it
    stays where it was fostered if that node lives, else it goes to the live node with
    the fewest units per CPU (ties: the node's order in `home`). A node that never
    registered keeps its units (it is still starting). With no live node at all
    nothing moves.

    A loader with a shadow (`shadow<k>` in `home`) stays wherever it runs while that
    node lives or has not registered yet; where that node is down and its shadow beats
    (in `standby`), it stays put too: the promotion moves it to its shadow's node, hot.
    Only a loader whose shadow is gone as well is restarted elsewhere. Each shadow then
    goes where `place_shadows` says.
    """
    cpus = cpus or {}
    if not live:
        return dict(current or home)
    paired = _shadowed(home)
    placed: dict[str, str] = {}
    orphans = []
    for unit, node in home.items():
        if unit.startswith("shadow"):
            continue
        at = current.get(unit)
        if unit in paired and at is not None and (at in live or at not in registered or paired[unit] in standby):
            placed[unit] = at
        elif node in live or node not in registered:
            placed[unit] = node
        elif at in live:
            placed[unit] = at
        else:
            orphans.append(unit)
    order = _order(home, live)
    for unit in orphans:
        placed[unit] = _emptiest(live, placed, order, cpus)
    return place_shadows(placed, current, home, live, registered, cpus)


def place_shadows(
    placed: dict[str, str],
    current: dict[str, str],
    home: dict[str, str],
    live: set[str],
    registered: set[str],
    cpus: dict[str, float] | None = None,
) -> dict[str, str]:
    """`placed` with every shadow on a node other than its loader's: where it runs if
    that node lives (or has not registered yet), else at home, else on the live node
    with the fewest units per CPU; left out (not run) while no other node lives."""
    placed = {u: n for u, n in placed.items() if not u.startswith("shadow")}
    order = _order(home, live)
    for loader, shadow in _shadowed(home).items():
        at = placed.get(loader)
        for node in (current.get(shadow), home[shadow]):
            if node is not None and node != at and (node in live or node not in registered):
                placed[shadow] = node
                break
        else:
            others = live - {at}
            if others:
                placed[shadow] = _emptiest(others, placed, order, cpus or {})
    return placed


def _order(home: dict[str, str], live: set[str]) -> list[str]:
    order = list(dict.fromkeys(home.values()))
    return order + sorted(live - set(order))


def _emptiest(nodes: set[str], placed: dict[str, str], order: list[str], cpus: dict[str, float]) -> str:
    """Of `nodes`, the one with the fewest units per CPU (ties: `order`)."""
    load = {n: sum(1 for v in placed.values() if v == n) for n in nodes}
    return min(sorted(nodes, key=order.index), key=lambda n: (load[n] + 1) / max(cpus.get(n, 1.0), 0.5))


ROOM = 0.75  # a node takes its loader back once its pressure with it stays at or below this
SPARE = 1.0  # a node takes a loader for capacity if its pressure with it stays within this, ...
GAIN = 0.5  # ... or if the move takes the worse of the two nodes' pressures to this share of it or less


@dataclass(frozen=True, slots=True)
class Use:
    """What a unit takes, or a node offers: CPUs (busy transform workers) and MiB."""

    cpus: float = 0.0
    mb: float = 0.0


def pressure(node: str, placed: dict[str, str], use: dict[str, Use], budget: dict[str, Use]) -> float:
    """The larger of a node's CPU and memory use over its budget (over 1: over budget)."""
    units = [use.get(u, Use()) for u, n in placed.items() if n == node]
    offer = budget.get(node, Use())
    cpu = sum(x.cpus for x in units) / offer.cpus if offer.cpus > 0 else 0.0
    mem = sum(x.mb for x in units) / offer.mb if offer.mb > 0 else 0.0
    return max(cpu, mem)


def relieve(
    placed: dict[str, str],
    current: dict[str, str],
    home: dict[str, str],
    live: set[str],
    use: dict[str, Use],
    budget: dict[str, Use],
    over: set[str],
) -> tuple[dict[str, str], dict[str, str]]:
    """The membership placement `placed` adjusted for capacity; returns it and why each
    loader moved for capacity (unit -> reason).

    - A loader that runs away from its live home (moved for capacity, or fostered while
      its node was down) stays where it is, unless its home's pressure with it would be
      at most `ROOM`: then it goes home.
    - Each node in `over` (over budget for as long as the caller asks) that is still over
      hands one loader process to the live node whose pressure with it is lowest, if that
      stays within `SPARE`; of its loaders, the one that brings it lowest while fitting.
      If none fits anywhere, the move that leaves the worse of the two nodes lowest, if
      that is at most `GAIN` times the node's pressure now (a strict gain: a loader too
      big for every node does not bounce between them).
      One move per node per call, so the next measurement sees its effect.
    """
    placed = dict(placed)
    why: dict[str, str] = {}
    paired = _shadowed(home)
    away = sorted(
        u
        for u, n in home.items()
        if u.startswith("loader")
        and u not in paired  # no trip home for a loader with a shadow: it would restart cold
        and placed[u] == n
        and current.get(u) not in (None, n)
        and current[u] in live
    )
    placed.update({u: current[u] for u in away})
    for unit in away:  # home, one at a time, while there is room there
        trial = {**placed, unit: home[unit]}
        if pressure(home[unit], trial, use, budget) <= ROOM:
            placed = trial
    for node in sorted(over & live, key=lambda n: -pressure(n, placed, use, budget)):
        now = pressure(node, placed, use, budget)
        if now <= 1:
            continue
        best = None
        for unit in sorted(u for u, n in placed.items() if n == node and u.startswith("loader")):
            if use.get(unit, Use()) == Use():
                continue
            for target in sorted(live - {node}):
                trial = {**placed, unit: target}
                after = pressure(target, trial, use, budget)
                worse = max(pressure(node, trial, use, budget), after)
                if after > SPARE and worse > GAIN * now:
                    continue
                score = (after > SPARE, worse, after, unit, target)  # a node that holds it first
                if best is None or score < best[0]:
                    best = (score, unit, target)
        if best is not None:
            _, unit, target = best
            placed[unit] = target
            why[unit] = f"{node} over budget ({pressure(node, {**placed, unit: node}, use, budget):.2f})"
    if paired and why:  # a loader moved onto its shadow's node: the shadow moves on
        placed = place_shadows(placed, current, home, live, set(home.values()) | live)
    return placed, why
