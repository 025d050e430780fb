"""A node's membership in a job on several nodes: joining, and clearing a dead node.

Every sidecar registers its node in `nodes` (host, ranks, Flight address, CPU and
memory budget) and keeps `hb:sidecar:<node>` alive; the leading Planner places units
from that (overlord.planner.placement). A node's liveness is judged on the node
itself where possible: a process on the same machine can tell that a pid is dead at
once, while a heartbeat only lapses at its TTL. So whoever on a node sees its sidecar
dead (the trainer whose ring's creator died, or the sidecar started next) clears the
heartbeats of the dead processes of that node and drops a lease a dead Planner there
held (`clear_dead`): the Planner moves the node's units within one placement check.
"""

from __future__ import annotations

import json
import logging

from overlord.planner.lease import release_dead
from overlord.shm import pid_alive
from overlord.store import Keys

log = logging.getLogger("overlord.membership")

BOOT_LOCK_MS = 30_000


def clear_dead(r, keys: Keys, node: str) -> list[str]:
    """Delete the heartbeats of dead processes of `node` (this machine's pids) and
    release the Planner lease if one of them held it; the keys deleted."""
    cleared = []
    for key in r.scan_iter(match=keys.heartbeat_pattern, count=1000):
        raw = r.get(key)
        if raw is None:
            continue
        beat = json.loads(raw)
        if beat.get("node") == node and not pid_alive(int(beat.get("pid", 0))):
            r.delete(key)
            cleared.append(key.decode())
    raw = r.get(keys.leader)
    if raw is not None:
        lease = json.loads(raw)
        if lease.get("node") == node and not pid_alive(int(lease.get("pid", 0))):
            release_dead(r, keys, lease["pid"], node)
            cleared.append(keys.leader)
    if cleared:
        log.warning("node %r: cleared what its dead processes left: %s", node, cleared)
    return cleared


def live_nodes(r, keys: Keys, nodes) -> set[str]:
    """The nodes whose sidecar heartbeat is alive."""
    pipe = r.pipeline(transaction=False)
    for n in nodes:
        pipe.exists(keys.heartbeat("sidecar", n))
    return {n for n, alive in zip(nodes, pipe.execute()) if alive}
