"""A node's membership in a job on several nodes: joining, following the placement,
and clearing a dead node.

Every sidecar registers its node in `nodes` (host, ranks, Flight address, CPU and
memory budget) and keeps `hb:sidecar:<node>` alive; the leading Planner places units
from that (overlord.runtime.placement). A node's liveness is judged on the node
itself where possible: a process on the same machine can tell that a pid is dead at
once, while a heartbeat only lapses at its TTL. So whoever on a node sees its sidecar
dead (the trainer whose ring's creator died, or the sidecar started next) clears the
heartbeats of the dead processes of that node and drops a lease a dead Planner there
held (`clear_dead`): the Planner moves the node's units within one placement check.

`Membership` is the sidecar's side of it: registering the node, starting or joining
the job under the `boot` lock, and starting the units the Planner placed here and
stopping those it placed elsewhere (through the sidecar's overlord.sidecar.supervision
`Roles`). A unit starts only once no live process of it beats anywhere, so a role
never runs twice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from overlord.autoscale.apply import budget_of
from overlord.config import Job
from overlord.errors import OverlordError
from overlord.remote.endpoint import job_token
from overlord.runtime.layout import Layout, client_ring
from overlord.runtime.lease import release_dead
from overlord.runtime.placement import homes
from overlord.shm import Ring, pid_alive, unlink_segment
from overlord.sidecar import rewind
from overlord.sidecar.role import was_superseded
from overlord.store import Keys
from overlord.store.schema import REWIND_PUBLISHED, encode_record, planner_step, rewind_published

if TYPE_CHECKING:  # typing only: trainers import this module (clear_dead), not the role processes
    from overlord.sidecar.supervision import Roles

log = logging.getLogger("overlord.membership")

BOOT_LOCK_MS = 30_000
PLACEMENT_S = 0.1  # how often a sidecar reads the placement
# A unit placed elsewhere gets SIGTERM and this long to exit; then its threads' stacks go
# to its log (SIGUSR1, overlord.sidecar.role) and it is killed. Alive, it keeps what it
# holds on this node, e.g. the consumer side of its loaders' rings, which the Flight
# endpoint then cannot serve to the unit's successor on another node: the successor
# would wait for those samples for ever.
STOP_GRACE_S = 5.0
DUMP_S = 0.5  # for its signal handler to write the stacks


class Republished(Exception):
    """The job was published again without this node (its `run` token changed): a rewind
    decided while the node was cut off from Redis, or another node that found none live
    started the job anew. This node's run is over; its sidecar joins the job again."""


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


class Membership:
    """This node's part in a job on several nodes, for its sidecar.

    It reads only what neither autoscaling nor joining changes of `job` (its node, the
    nodes, the mesh, the budget, ring sizes, Flight), and starts and stops units
    through `roles`.
    """

    def __init__(self, job: Job, keys: Keys, roles: Roles) -> None:
        self.job, self.keys, self.roles = job, keys, roles
        self.layout: Layout | None = None  # the job's, once booted
        self.leaving: dict[str, float] = {}  # units placed elsewhere now, stopping here -> when told to
        self.superseded: set[str] = set()  # units whose process here exited SUPERSEDED, not started since
        self._dumped: set[str] = set()  # of those, the ones past STOP_GRACE_S (stacks asked for)
        self.fostered: dict[str, list[Ring]] = {}  # constructor<h> of another node run here -> its client rings
        self.made: list[Ring] = []  # every ring it created, for the sidecar to close on its way out
        self._placed_at = 0.0
        self._errors_at = 0.0

    def offer(self) -> dict:
        """What this node offers the job (`nodes` hash): ranks, Flight address, budget."""
        budget = budget_of(self.job)
        host = os.environ.get("OVERLORD_FLIGHT_HOST") or socket.gethostname()  # the address other nodes dial
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ranks": self.job.ranks_of_node(self.job.node),
            "flight": (
                f"grpc{'+tls' if self.job.flight_cert else ''}://{host}:{self.job.flight_port}"
                if self.job.flight_port
                else None
            ),
            "cpus": budget.cpus,
            "loader_cpus": round(budget.loader_cpus, 3),  # what capacity placement weighs loaders against
            "memory_mb": round(budget.memory_mb),
            "started": time.time(),
        }

    def boot(
        self,
        r,
        lay_out: Callable[[], Layout],
        publish: Callable[[Layout, Job | None], None],
        beat: Callable[[], None],
        *,
        rewinding: bool = False,
    ) -> tuple[Job | None, Layout, dict[str, str]]:
        """Start the job (the first sidecar up: `lay_out` sizes and lays it out,
        `publish` writes it) or join it. One sidecar at a time decides, under the `boot`
        lock; a joiner takes the job's sources (partitions may have been sized by
        autoscale) and layout from Redis. In a rewind (`rewinding`: this sidecar passed
        its barrier, overlord.sidecar.rewind) the first one publishes the job again as
        it was laid out (`publish(layout, job)`; None: the job `lay_out` sized), and the
        others join that. `beat` marks the node live before
        the lock goes. Returns the job joined (None: this node laid it out), its layout
        and the placement."""
        deadline = time.monotonic() + self.job.timeout_s
        while not r.set(self.keys.boot, self.job.node, nx=True, px=BOOT_LOCK_MS):
            if time.monotonic() > deadline:
                raise OverlordError(
                    f"node {self.job.node!r}: another sidecar of job {self.job.name!r} held the "
                    f"boot lock ({self.keys.boot}) for {self.job.timeout_s:g}s"
                )
            time.sleep(0.05)
        joined = None
        try:
            clear_dead(r, self.keys, self.job.node)  # what this node's previous sidecar left
            others = live_nodes(r, self.keys, [n for n in self.job.node_ids if n != self.job.node])
            stored, raw_layout = r.get(self.keys.job_config), r.get(self.keys.layout)
            state = r.hgetall(self.keys.rewind) if rewinding else {}
            action = rewind.boot_action(
                rewinding=rewinding,
                under_way=bool(state),
                published=rewind_published(state),
                others_live=bool(others),
                stored=stored is not None and raw_layout is not None,
            )
            if action == rewind.START:
                layout = lay_out()
                publish(layout, None)  # the job as `lay_out` sized it (autoscale), not this node's config
                job_token(self.job, create=True, r=r)  # before anyone can see the placement
                log.info("node %r starts job %r on nodes %s", self.job.node, self.job.name, list(self.job.node_ids))
            else:
                self.job = joined = self._stored(json.loads(stored), sorted(others))
                layout = Layout.from_json(raw_layout)
                if action == rewind.JOIN:
                    self.roles.run = r.get(self.keys.run)  # the run this node joins (its roles start for it)
                    r.hset(self.keys.nodes, self.job.node, encode_record(self.offer()))
                    log.info("node %r joins job %r (live nodes: %s)", self.job.node, self.job.name, sorted(others))
                else:  # the first sidecar back from a rewind: the job again, as it was laid out
                    publish(layout, self.job)
                    r.hset(self.keys.rewind, REWIND_PUBLISHED, self.job.node)
                    log.info("node %r publishes job %r again for its rewind", self.job.node, self.job.name)
            if action != rewind.JOIN:
                r.delete(self.keys.placement)
                r.hset(self.keys.placement, mapping=homes(self.job, layout))
            beat()  # live before the lock goes: the next sidecar joins
            placement = {k.decode(): v.decode() for k, v in r.hgetall(self.keys.placement).items()}
        finally:
            r.delete(self.keys.boot)
        self.layout = layout
        return joined, layout, placement

    def _stored(self, stored: dict, others: list[str]) -> Job:
        """This node's job with the sources (as autoscale sized them) of the job stored
        in Redis; raises OverlordError when the configs disagree."""
        job = Job.from_dict(stored)
        if job.node_ids != self.job.node_ids or [s.name for s in job.sources] != [s.name for s in self.job.sources]:
            raise OverlordError(
                f"node {self.job.node!r} runs job {self.job.name!r} with nodes {list(self.job.node_ids)} and "
                f"sources {[s.name for s in self.job.sources]}, but the running job (nodes {others}) has "
                f"nodes {list(job.node_ids)} and sources {[s.name for s in job.sources]}; give every node the same config"
            )
        return dataclasses.replace(self.job, sources=job.sources, loader_processes=job.loader_processes)

    def follow(self, r, placement: dict[str, str] | None = None) -> None:
        """Start the units the Planner placed here, stop those it placed elsewhere
        (`placement`: as read at boot; else read now, at most every PLACEMENT_S).

        Raises:
            Republished: the placement read belongs to a run published without this
                node; nothing was started or stopped from it.
        """
        if placement is None:
            if time.monotonic() - self._placed_at < PLACEMENT_S:
                return
            # one snapshot: a promotion moves a loader's unit and names its process at once;
            # the run token with it, so a placement of a run this node is not part of is
            # never followed (its units would start beside this run's rings and roles)
            pipe = r.pipeline(transaction=True)
            pipe.hgetall(self.keys.placement)
            pipe.hgetall(self.keys.active)
            pipe.get(self.keys.run)
            raw, active, run = pipe.execute()
            if run != self.roles.run:
                if run is None:
                    return  # being published right now (or the job's state is lost: the watch loop says so)
                raise Republished(
                    f"job {self.job.name!r} was published again while node {self.job.node!r} was out of its "
                    "Redis's reach (a rewind decided without it, or a start on the other nodes)"
                )
            placement = {k.decode(): v.decode() for k, v in raw.items()}
            self.roles.adopt(active)  # a shadow of this node promoted: the loader unit placed here is it
        self._placed_at = time.monotonic()
        mine = {unit for unit, node in placement.items() if node == self.job.node}
        for name, proc in list(self.roles.children.items()):
            if name == "planner0" or name in mine or name in self.leaving:
                continue
            if proc.poll() is None:
                log.warning(
                    "%s (pid %d) is placed on node %r now; stopping it here", name, proc.pid, placement.get(name)
                )
                proc.terminate()
                self.leaving[name] = time.monotonic()
            elif proc.returncode == 0:
                self.roles.forget(name)  # it stopped by itself: it may be placed here again
        for unit in sorted(mine):
            if unit.startswith("loader") and int(unit[6:]) in self.roles.awaiting:
                continue  # killed here: its shadow on another node is being promoted
            if unit not in self.roles.children and self._may_start(r, unit):
                if unit in self.superseded and rewind.under_way(r, self.keys):
                    continue  # the job goes back: every node's sidecar starts its roles anew
                self.superseded.discard(unit)
                self._start_unit(r, unit)

    def _may_start(self, r, unit: str) -> bool:
        """Whether `unit` is free to start here: no live process of it beats anywhere."""
        role, index = unit.rstrip("0123456789"), unit[len(unit.rstrip("0123456789")) :]
        raw = r.get(self.keys.heartbeat(role, index))
        if raw is None:
            return True
        beat = json.loads(raw)
        if beat.get("node") == self.job.node and not pid_alive(int(beat["pid"])):
            r.delete(self.keys.heartbeat(role, index))  # this node's previous sidecar ran it
            return True
        return False

    def _start_unit(self, r, unit: str) -> None:
        role, index = unit.rstrip("0123456789"), int(unit[len(unit.rstrip("0123456789")) :])
        running = planner_step(r, self.keys) is not None  # the job began: recover from Redis
        if role == "constructor" and self.job.node_ids[index] != self.job.node:
            if self.layout is None:
                raise OverlordError(f"node {self.job.node!r}: {unit} placed here before the job was booted")
            # another node's DP groups: their trainers read these rings over Flight
            rings = []
            for dp in [d for d, h in enumerate(self.layout.constructor_of) if h == index]:
                for rank in self.job.mesh.ranks_of_dp(dp):
                    name = client_ring(self.job, rank)
                    unlink_segment(name)
                    rings.append(Ring.create(name, self.job.batch.ring_bytes))
            for ring in self.fostered.pop(unit, []):
                ring.close()
            self.fostered[unit] = rings
            self.made.extend(rings)
            log.warning("running %s for node %r (its sidecar is down)", unit, self.job.node_ids[index])
        self.roles.spawn(role, index, attempt=max(self.roles.attempts.get(unit, 0), int(running)))

    def fostered_rings(self) -> list[Ring]:
        """The client rings of other nodes' Data Constructors run here."""
        return [ring for rings in self.fostered.values() for ring in rings]

    def forget_superseded(self, codes: dict[str, int | None]) -> None:
        """Units that exited SUPERSEDED (another process took them over while this node
        was out of Redis's reach) are no failure: forgotten, and dropped from `codes`,
        so one placed here again starts anew (`follow`) instead of standing stopped.
        A process notes it under the name it was started as (`proc.name`): a shadow
        promoted here is watched as `loader<k>` but wrote `shadow<k>`'s note."""
        for name, code in list(codes.items()):
            proc = self.roles.children[name]
            if name not in self.leaving and was_superseded(self.roles.run_dir, proc.name, proc.pid, code):
                log.warning("%s stopped: another process runs its unit now; it starts again while placed here", name)
                self.roles.forget(name)
                self.superseded.add(name)
                del codes[name]

    def retire(self, codes: dict[str, int | None]) -> None:
        """Forget units that stopped because they were placed elsewhere; one that has
        not stopped within STOP_GRACE_S of its SIGTERM dumps its stacks, then is killed."""
        now = time.monotonic()
        for name, since in list(self.leaving.items()):
            if codes.get(name) is not None:
                log.info("%s stopped %.1fs after its SIGTERM (exit %s)", name, now - since, codes[name])
                del self.leaving[name]
                self._dumped.discard(name)
                codes.pop(name)
                self.roles.forget(name)
                continue
            proc = self.roles.children.get(name)
            if proc is None or now - since <= STOP_GRACE_S:
                continue
            if name not in self._dumped:
                log.warning(
                    "%s (pid %d) did not stop within %gs of SIGTERM; its threads' stacks go to its log; killing it",
                    name,
                    proc.pid,
                    STOP_GRACE_S,
                )
                proc.dump_stacks()
                self._dumped.add(name)
            elif now - since > STOP_GRACE_S + DUMP_S:
                proc.kill()

    def remote_failure(self, r) -> str | None:
        """Several nodes: a role on another node failed with an error (every trainer
        must hear it, not only those of that node)."""
        if time.monotonic() - self._errors_at < 0.5:
            return None
        self._errors_at = time.monotonic()
        raw = r.lindex(self.keys.errors, 0)
        return json.loads(raw)["message"] if raw else None
