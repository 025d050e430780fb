"""Where each role of a job on several nodes runs: the Planner's placement.

The units placed are the Source Loader processes (`loader<k>`: a source partition's
file state exists once per job, in the one process hosting it) and the Data
Constructor hosts (`constructor<h>`, one per node, building the DP groups whose ranks
live there). Every unit has a home:

- a Data Constructor host lives on the node of its DP groups, so micro-batches reach
  their trainers through the node's shared-memory rings;
- Source Loader processes are dealt round robin over the nodes, so the job's reading
  and transform CPU is spread and no source is read twice.

The Planner keeps the placement in Redis (`placement` hash) and changes it when the
membership changes: the units of a node whose sidecar died (it registered, and its
heartbeat lapsed) go to the live node with the fewest units per CPU, and come home
when its sidecar is back. Sidecars start and stop units to follow the hash; data
crosses nodes over Arrow Flight wherever a loader and a constructor, or a constructor
and its trainers, end up apart. Pure functions: tested without Redis.
"""

from __future__ import annotations

from overlord.config import Job
from overlord.sidecar.layout import Layout


def homes(job: Job, layout: Layout) -> dict[str, str]:
    """Every unit's home node."""
    nodes = job.node_ids
    home = {f"loader{k}": nodes[k % len(nodes)] for k in range(layout.loaders)}
    home.update({f"constructor{h}": nodes[h] for h in range(layout.constructor_hosts)})
    return home


def place(home: dict[str, str], current: dict[str, str], live: set[str], registered: set[str],
          cpus: dict[str, float] | None = None) -> dict[str, str]:
    """The placement for this membership.

    A unit runs at home unless its home node registered and is no longer live; then it
    stays where it was fostered if that node lives, else it goes to the live node with
    the fewest units per CPU (ties: the node's order in `home`). A node that never
    registered keeps its units (it is still starting). With no live node at all
    nothing moves.
    """
    cpus = cpus or {}
    if not live:
        return dict(current or home)
    placed: dict[str, str] = {}
    orphans = []
    for unit, node in home.items():
        if node in live or node not in registered:
            placed[unit] = node
        elif current.get(unit) in live:
            placed[unit] = current[unit]
        else:
            orphans.append(unit)
    order = list(dict.fromkeys(home.values()))
    order += sorted(live - set(order))
    for unit in orphans:
        load = {n: sum(1 for v in placed.values() if v == n) for n in live}
        placed[unit] = min(sorted(live, key=order.index), key=lambda n: (load[n] + 1) / max(cpus.get(n, 1.0), 0.5))
    return placed
