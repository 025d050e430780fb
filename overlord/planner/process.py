"""The Planner role: reads buffer metadata from Redis, publishes one plan per step.

Per step it does O(1) Redis operations: one XREAD over every loader's metadata
stream, one HGETALL of progress, and one fenced MULTI (see lease.py)
that writes the plan (`plan:<step>`, expiring), notifies (`plans` stream, entry id
`<step+1>-0` so a reader waiting for step t asks for ids after `t-0` and cannot miss
it) and saves the differential checkpoint of the state before the next step (see
checkpoint.py) — so the state in Redis never refers to a plan that was not written.

It plans step s only while s <= (the trainers' consumed step) + plan_ahead and
s <= (the slowest Data Constructor's last step) + plan_ahead: the trainers' step is
the least `progress` t<dp> - 1 (see overlord.constructor.marks), or the job's first
step (0, or the resume step) while a group has consumed nothing, so the first
plan_ahead + 1 steps are planned before any trainer consumes and a metric reported
at step t shapes the plan of step t + plan_ahead + 1 at the latest. While ahead it
blocks on the `progressed` stream (an entry per rise of a c<dp> or t<dp>) instead
of polling.

Only the holder of the job's lease plans. A Planner that takes the lease continues
from the newest checkpoint; publishing its token in the `planner` hash tells every
Source Loader to report its read buffer again (the new Planner knows only cursors;
it drops what it already has). It also promotes a Shadow Loader whose active loader's
heartbeat lapsed.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import redis

from overlord.errors import PlanError
from overlord.planner import meta
from overlord.planner.checkpoint import Checkpoints
from overlord.planner.core import PlannerCore, resolve_strategy
from overlord.planner.lease import Lease, Superseded, WriteUncertain
from overlord.planner.schedule import Dynamic, from_config, mixing_unit
from overlord.planner.tree import ClientPlaceTree
from overlord.sidecar.flow import HEARTBEAT_S, alive_within
from overlord.store.keys import built_field, consumed_field

log = logging.getLogger("overlord.planner")

PLAN_TTL_S = 3600  # a backstop: plans are deleted once far behind the slowest constructor
PLAN_KEEP_STEPS = 1024  # plans kept behind the slowest Data Constructor: a restarted loader or
# constructor, or a shadow, reads from its step on (as far back as a trainer may resume)
PRUNE_MAX = 64  # old plans deleted per published step, at most
WAIT_MS = 20
AHEAD_WAIT_MS = 50  # longest block on `progressed` while ahead (the loop's other checks run between)
PROMOTE_CHECK_S = 0.01
UNSEEN_GRACE_S = 10 * HEARTBEAT_S  # how long a loader may take to beat first before its shadow takes over


def run_planner(ctx) -> None:
    """Lead (or wait to lead) the job's planning until its last step is planned."""
    lease = Lease(ctx.r, ctx.keys, node=ctx.job.node)
    threading.Thread(target=lease.renew_forever, args=(ctx.stop,), daemon=True, name="lease").start()
    if ctx.job.multi_node:
        # every node runs a Planner; those that do not lead wait silently, and leave when
        # the job's last step is planned
        threading.Thread(target=_until_done, args=(ctx,), daemon=True, name="done").start()
    try:
        while not ctx.stop.is_set():
            ctx.silent = True
            try:
                token = lease.acquire(ctx.stop, ctx.beat)
            except Superseded:
                return
            ctx.silent = False
            ctx.publish_heartbeat()
            try:
                _lead(ctx, lease, token)
                return
            except Superseded as exc:
                log.warning("%s; waiting to lead again", exc)
            except redis.ConnectionError as exc:
                log.warning("Redis unreachable while planning (%s); retrying from the newest checkpoint", exc)
                ctx.stop.wait(0.5)
    finally:
        try:
            lease.release()
        except redis.RedisError:
            pass


def _until_done(ctx) -> None:
    """Stop a standby Planner once the leader planned the last step."""
    while not ctx.stop.wait(0.5):
        try:
            if ctx.silent and ctx.r.hget(ctx.keys.planner, "done"):
                ctx.stop.set()
        except redis.RedisError:
            pass


def _core(job, layout) -> PlannerCore:
    return PlannerCore(
        streams=layout.streams,
        stream_source=layout.stream_source,
        tree=ClientPlaceTree(job.mesh),
        schedule=from_config(job.mixing, [s.name for s in job.sources], [s.weight for s in job.sources]),
        strategy=resolve_strategy(job.strategy),
        seed=job.seed,
        global_batch=job.batch.global_batch,
        micro_batches=job.batch.micro_batches,
        context_length=job.batch.context_length,
        finite=job.epochs is not None,
        drop_last=job.batch.drop_last,
        mixing_unit=mixing_unit(job.mixing),
    )


def _lead(ctx, lease: Lease, token: int) -> None:
    """Plan from the newest checkpoint while holding the lease; returns after the last step."""
    job, r, keys, layout = ctx.job, ctx.r, ctx.keys, ctx.layout
    if r.hget(keys.planner, "done"):
        return  # took the lease after the last step was planned
    core = _core(job, layout)
    ckpts = Checkpoints(keys)
    newest = ckpts.newest(r)
    if newest is not None:
        core.restore(ckpts.load(r, newest))
        if core.done:  # the checkpoint is after the job's last step: nothing to plan, never wait
            r.hset(keys.planner, "done", 1)
            log.info("the newest checkpoint (step %d) is after the job's last step; planner done", core.step)
            return

    # every (re)start of planning, even under the same lease (a Redis blip), gets a new
    # generation: loaders report their read buffers again, tagged with it (see meta.py)
    generation = int(r.incr(keys.fence))

    def take_over(pipe) -> None:
        pipe.hset(keys.planner, mapping={"token": generation, "lease": token, "leader_since": time.time()})
        if newest is None:
            ckpts.write(pipe, 0, None, core.state)

    while True:
        try:
            lease.fenced(take_over)  # idempotent: retried if cut short
            break
        except WriteUncertain:
            continue
    log.info(
        "leading with lease token %d (generation %d) from step %d%s",
        token,
        generation,
        core.step,
        " (from the newest checkpoint)" if newest is not None else "",
    )
    first = core.step
    # the job's first step: where trainers that consumed nothing yet stand
    start = int(r.hget(keys.resume, "step") or 0)
    progressed = "0-0"  # the last `progressed` entry seen
    pruned = max(0, first - PLAN_KEEP_STEPS - PRUNE_MAX)  # plans below were deleted (older ones expire)
    asked: dict[int, int] = {}  # what the loaders were last asked to hold, per stream
    index = {keys.meta(name).encode(): i for i, name in enumerate(layout.streams)}
    last_ids = {keys.meta(name): "0-0" for name in layout.streams}
    waiting_since = time.monotonic()
    promoter = _Promoter(ctx, lease)
    scaling = _Scaling(ctx) if job.autoscale is not None and job.autoscale.get("online", True) else None
    placer = _Placer(ctx, lease, scaling) if job.multi_node else None
    while not ctx.stop.is_set():
        ctx.beat()
        if lease.lost.is_set():
            raise Superseded(f"the Planner lease (token {token}) lapsed")
        promoter.check()
        if placer is not None:
            placer.check()
        progress = r.hgetall(keys.progress)
        slowest = min(
            (int(progress.get(built_field(d).encode(), first - 1)) for d in range(job.mesh.dp)), default=first - 1
        )
        consumed = max(
            start,
            min(
                (int(progress.get(consumed_field(d).encode(), start + 1)) - 1 for d in range(job.mesh.dp)),
                default=start,
            ),
        )
        ahead = core.step - slowest > job.plan_ahead or core.step - consumed > job.plan_ahead
        if ahead:
            waiting_since = time.monotonic()  # waiting on trainers is not a stall
        if not ahead and isinstance(core.schedule, Dynamic) and core.schedule.due(core.step):
            core.schedule.observe(core.step, _reported_metrics(r, keys))
        plan = None if ahead else core.plan_step()
        if plan is not None:
            delta = core.delta()
            old = range(pruned, min(pruned + PRUNE_MAX, slowest - PLAN_KEEP_STEPS + 1))

            def publish(pipe, plan=plan, delta=delta, old=old) -> None:
                if old:  # Redis holds a bounded window of plans, not every step of the job
                    pipe.delete(*[keys.plan(s) for s in old])
                pipe.set(keys.plan(plan.step), plan.to_json(), ex=PLAN_TTL_S)
                pipe.xadd(
                    keys.plans,
                    {"step": plan.step, "last": int(plan.last)},
                    id=f"{plan.step + 1}-0",
                    maxlen=1000,
                    approximate=True,
                )
                pipe.hset(
                    keys.planner,
                    mapping={"step": plan.step, "updated": time.time(), **({"done": 1} if plan.last else {})},
                )
                if plan.dropped:
                    pipe.hset(keys.counters, "dropped_last", plan.dropped)
                ckpts.write(pipe, core.step, delta, core.state)  # where a resume at step core.step starts

            _publish_once(r, keys, lease, publish, plan.step)
            pruned = max(pruned, old.stop)
            if scaling is not None and plan.step > first + job.plan_ahead:
                # the steps that fill the look-ahead are planned as soon as loaders report
                # samples, not at the pace the job consumes them: timed, they read as a
                # burst, and the scaler took it for demand (several times the real one)
                scaling.observe(plan, core)
            waiting_since = time.monotonic()
            if plan.last:
                log.info(
                    "planned the last step %d; planner done%s",
                    plan.step,
                    f" ({plan.dropped} sample(s) left over, fewer than a step delivers with drop_last="
                    f"{job.batch.drop_last}: dropped, counter dropped_last)"
                    if plan.dropped
                    else "",
                )
                return
            continue
        if ahead:
            # trainers are behind: wait for a constructor or a trainer to move (the entry
            # may have come since the read above: then XREAD returns at once)
            block = PROMOTE_CHECK_S * 1000 if promoter.shadowed else AHEAD_WAIT_MS
            reply = r.xread({keys.progressed: progressed}, block=int(block), count=1000)
            if reply:
                progressed = reply[0][1][-1][0]
            continue
        # the plan needs samples not yet reported: tell loaders how many it needs (a full
        # read buffer may be smaller than what one step takes from a stream), then wait
        demand = {layout.streams[i]: n for i, n in core.wanted.items() if n > asked.get(i, 0)}
        if demand:
            r.hset(keys.demand, mapping=demand)
            asked.update({i: n for i, n in core.wanted.items()})
        reply = r.xread(last_ids, block=WAIT_MS, count=64)
        if reply:
            trim = r.pipeline(transaction=False)
            for stream_key, entries in reply:
                for entry_id, fields in entries:
                    chunk = meta.decode(fields)
                    if chunk.token == generation:  # older ones are reported again with this one
                        core.add(index[stream_key], chunk)
                    last_ids[stream_key.decode()] = entry_id
                # what the Planner has read lives in its memory (and its checkpoint): drop it
                trim.xtrim(stream_key, minid=entries[-1][0], approximate=False)
            trim.execute()
            waiting_since = time.monotonic()
        if time.monotonic() - waiting_since > job.timeout_s:
            starving = [i for i, s in enumerate(core.streams) if s.count == 0 and not s.final]
            owners = sorted({layout.loader_of[i] for i in starving})
            if all(alive_within(r, keys, "loader", k, job.timeout_s) for k in owners):
                waiting_since = time.monotonic()  # the loaders turn their loops: back-pressure, not a hang
                continue
            starving = [core.streams[i].name for i in starving]
            raise PlanError(
                f"step {core.step}: no Source Loader reported new samples for {job.timeout_s:g}s and loader "
                f"process(es) {owners} have not turned their loops for as long (hung or dead); streams with none "
                f"buffered: {starving}. Check the loader logs in {ctx.run_dir}, "
                "or raise Job.timeout_s for slow transforms"
            )


class _Scaling:
    """Feeds each plan's per-source sample counts to the Scaler; publishes its decisions."""

    COSTS_EVERY = 64  # steps between two reads of the profile journal

    def __init__(self, ctx) -> None:
        from overlord.autoscale.scaler import Scaler

        self.ctx = ctx
        job, layout = ctx.job, ctx.layout
        self.names = [job.sources[i].name for i in layout.stream_source]  # stream -> source
        current = {s.name: 1 for s in job.sources}
        for stream, n in ctx.r.hgetall(ctx.keys.workers).items():
            current[stream.decode().rsplit(".", 1)[0]] = int(n)
        from overlord.autoscale.apply import budget_of

        partitions = {s.name: s.partitions for s in job.sources}
        self.scaler = Scaler(
            costs_ms={},
            current=current,
            partitions=partitions,
            cpus=budget_of(job).loader_cpus,
            max_workers=int(job.autoscale.get("max_threads", 4)),
            interval=int(job.autoscale.get("scale_interval", 8)),
        )
        self.warned = False
        # far enough ahead that workers are up before the read buffers of the old mix drain
        self.lookahead = 2 * self.scaler.interval + job.plan_ahead
        self._costs()

    def _costs(self) -> None:
        from overlord.autoscale.profile import costs_from, journaled

        if not self.scaler.costs_ms:  # what the start-up partitioning measured, until loaders journal
            stored = self.ctx.r.get(self.ctx.keys.autoscale)
            self.scaler.costs_ms.update(json.loads(stored).get("costs_ms", {}) if stored else {})
        costs = costs_from(journaled(self.ctx.r, self.ctx.keys), self.ctx.job)
        self.scaler.costs_ms.update({name: c.transform_ms for name, c in costs.items()})

    def observe(self, plan, core) -> None:
        if plan.step % self.COSTS_EVERY == 0:
            self._costs()
        ahead = None
        if hasattr(core.schedule, "weights"):  # the mix of the steps about to be planned
            w = np.asarray(core.schedule.weights(plan.step + self.lookahead), dtype=np.float64)
            if w.sum() > 0:
                share = w / w.sum() * core.global_batch
                ahead = {s.name: float(share[i]) for i, s in enumerate(self.ctx.job.sources)}
        counts: dict[str, int] = {}
        for bucket in plan.buckets:
            for mb in bucket:
                for stream, _, _ in mb:
                    counts[self.names[stream]] = counts.get(self.names[stream], 0) + 1
        changed = self.scaler.observe(plan.step, counts, time.monotonic(), ahead)
        if (plan.step + 1) % self.scaler.interval == 0:
            pressure = round(self.scaler.pressure, 3)
            pipe = self.ctx.r.pipeline(transaction=False)
            pipe.hset(self.ctx.keys.planner, "pressure", pressure)
            if pressure > 1:
                pipe.hincrby(self.ctx.keys.counters, "over_budget_intervals", 1)
                if not self.warned:
                    log.warning(
                        "step %d: the sources demand %.1fx the loaders' CPU budget (%.1f CPUs); trainers "
                        "will wait on loading: raise Job.autoscale cpus or lower the costly sources' weights",
                        plan.step,
                        pressure,
                        self.scaler.cpus,
                    )
                    self.warned = True
            pipe.execute()
        if not changed:
            return
        r, keys, layout = self.ctx.r, self.ctx.keys, self.ctx.layout
        pipe = r.pipeline(transaction=True)
        pipe.hset(
            keys.workers,
            mapping={
                stream: changed[self.names[i]] for i, stream in enumerate(layout.streams) if self.names[i] in changed
            },
        )
        for name, workers in changed.items():
            pipe.xadd(
                keys.scaling,
                {
                    "step": plan.step,
                    "source": name,
                    "workers": workers,
                    "rate": round(self.scaler.rate.get(name, 0.0), 2),
                    "demand": round(self.scaler.demand(name), 3),
                    "cost_ms": round(self.scaler.costs_ms.get(name, 0.0), 4),
                    "time": time.time(),
                },
                maxlen=10000,
                approximate=True,
            )
        pipe.execute()
        log.info(
            "step %d: transform workers per partition now %s (busy workers demanded %s)",
            plan.step,
            changed,
            {n: round(self.scaler.demand(n), 2) for n in self.scaler.current},
        )


def _publish_once(r, keys, lease: Lease, publish, step: int, tries: int = 5) -> None:
    """Write a step under the lease exactly once, though a try may be cut short."""
    for _ in range(tries):
        try:
            lease.fenced(publish)
            return
        except WriteUncertain:
            if int(r.hget(keys.planner, "step") or -1) >= step:
                return  # it landed before the cut
    raise Superseded(f"could not publish step {step} under the lease in {tries} tries")


class _Promoter:
    """Promotes a Shadow Loader when its active loader's heartbeat is gone."""

    def __init__(self, ctx, lease: Lease) -> None:
        self.ctx, self.lease = ctx, lease
        self.shadowed = list(ctx.layout.shadowed)
        self.next_check = 0.0
        self.promoted: dict[int, tuple[int, float]] = {}  # loader -> (pid promoted, when), until it beats as loader
        # a loader this Planner never saw beat is starting, not lapsed (its shadow, forked
        # after it, may beat first on a loaded machine): promote it only after a grace
        self.beaten: set[int] = set()
        self.watching_since = time.monotonic()

    def check(self) -> None:
        if not self.shadowed or time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + PROMOTE_CHECK_S
        r, keys = self.ctx.r, self.ctx.keys
        pipe = r.pipeline(transaction=False)
        for k in self.shadowed:
            pipe.get(keys.heartbeat("loader", str(k)))
            pipe.get(keys.heartbeat("shadow", str(k)))
        pipe.hgetall(keys.active)
        *beats, active = pipe.execute()
        for n, k in enumerate(self.shadowed):
            loader_hb, shadow_hb = beats[2 * n], beats[2 * n + 1]
            if loader_hb is not None:
                self.beaten.add(k)
                if k in self.promoted and json.loads(loader_hb)["pid"] == self.promoted[k][0]:
                    del self.promoted[k]  # the promoted one leads: a later lapse is a new failure
                continue
            if shadow_hb is None:
                continue
            if k not in self.beaten and time.monotonic() - self.watching_since < UNSEEN_GRACE_S:
                continue
            if k in self.promoted and time.monotonic() - self.promoted[k][1] < 3 * HEARTBEAT_S:
                continue  # the promoted one has not beaten as a loader yet (and a new shadow may be up)
            shadow = json.loads(shadow_hb)
            previous = active.get(str(k).encode())
            if previous is not None and int(previous) == shadow["pid"]:
                continue

            def promote(pipe, k=k, shadow=shadow, previous=previous) -> None:
                pipe.hset(keys.active, k, shadow["pid"])
                pipe.xadd(
                    keys.promotions,
                    {
                        "loader": k,
                        "pid": shadow["pid"],
                        "node": shadow["node"],
                        "previous": previous or b"",
                        "time": time.time(),
                        "reason": "active heartbeat lapsed",
                    },
                    maxlen=1000,
                    approximate=True,
                )

            try:
                self.lease.fenced(promote)
            except WriteUncertain:
                self.next_check = 0.0  # look again at once; promoting twice writes the same
                continue
            self.promoted[k] = (shadow["pid"], time.monotonic())
            log.warning("loader process %d: active heartbeat lapsed; promoted its shadow (pid %d)", k, shadow["pid"])


class _Placer:
    """Places the job's units on its nodes as the membership and the nodes' load change
    (see placement.py)."""

    CHECK_S = 0.1
    CAPACITY_S = 1.0  # between two looks at the nodes' load (role heartbeats beat once a second)
    PATIENCE = 3  # looks a node must be over budget before a loader moves off it

    def __init__(self, ctx, lease: Lease, scaling: _Scaling | None = None) -> None:
        from overlord.planner.placement import homes

        self.ctx, self.lease, self.scaling = ctx, lease, scaling
        self.home = homes(ctx.job, ctx.layout)
        self.next_check = 0.0
        self.next_capacity = time.monotonic() + self.CAPACITY_S
        self.over_for: dict[str, int] = {}  # node -> consecutive looks over its budget
        self.use: dict = {}  # unit -> Use, at the last look
        self.budget: dict = {}  # node -> Use (its budget)

    def check(self) -> None:
        from overlord.planner.placement import place, relieve

        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + self.CHECK_S
        r, keys, nodes = self.ctx.r, self.ctx.keys, self.ctx.job.node_ids
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(keys.nodes)
        pipe.hgetall(keys.placement)
        for n in nodes:
            pipe.exists(keys.heartbeat("sidecar", n))
        members, current, *beats = pipe.execute()
        registered = {k.decode() for k in members}
        live = {n for n, alive in zip(nodes, beats) if alive}
        members = {k.decode(): json.loads(v) for k, v in members.items()}
        cpus = {n: float(m.get("cpus") or 1) for n, m in members.items()}
        current = {k.decode(): v.decode() for k, v in current.items()}
        placed = place(self.home, current, live, registered, cpus)
        why: dict[str, str] = {}
        if self.scaling is not None:  # between two looks at the load, the last look's figures hold
            over: set[str] = set()
            if time.monotonic() >= self.next_capacity:
                self.next_capacity = time.monotonic() + self.CAPACITY_S
                over = self._measure(current or placed, live, members)
            placed, why = relieve(placed, current, self.home, live, self.use, self.budget, over)
        moved = {u: n for u, n in placed.items() if current.get(u) != n}
        if not moved:
            return

        def write(pipe) -> None:
            pipe.hset(keys.placement, mapping=moved)
            for unit, node in moved.items():
                before = current.get(unit, "")
                reason = why.get(unit) or ("home" if node == self.home[unit] else f"node {before} down")
                pipe.xadd(
                    keys.placements,
                    {"unit": unit, "from": before, "to": node, "reason": reason, "time": time.time()},
                    maxlen=1000,
                    approximate=True,
                )

        try:
            self.lease.fenced(write)
        except WriteUncertain:
            self.next_check = self.next_capacity = 0.0
            return
        for node in {current.get(u) for u in why}:
            self.over_for.pop(node, None)  # patience again before its next loader moves
        log.warning(
            "placement: %s (live nodes %s)%s",
            {u: f"{current.get(u)} -> {n}" for u, n in moved.items()},
            sorted(live),
            f"; for capacity: {why}" if why else "",
        )

    def _measure(self, current: dict[str, str], live: set[str], members: dict[str, dict]) -> set[str]:
        """Look at the nodes' load: what each loader process demands (the scaler's busy
        workers) and every unit's RSS, against each node's registered budget. Returns
        the nodes over budget for `PATIENCE` looks in a row."""
        from overlord.planner.placement import Use, pressure

        r, keys, layout, scaler = self.ctx.r, self.ctx.keys, self.ctx.layout, self.scaling.scaler
        units = layout.units()
        pipe = r.pipeline(transaction=False)
        for unit in units:
            role, index = ("loader", unit[6:]) if unit.startswith("loader") else ("constructor", unit[11:])
            pipe.get(keys.heartbeat(role, index))
        rss = {u: float(json.loads(raw).get("rss_mb", 0.0)) if raw else 0.0 for u, raw in zip(units, pipe.execute())}
        demand: dict[str, float] = {}
        for i, k in enumerate(layout.loader_of):
            name = self.scaling.names[i]
            demand[f"loader{k}"] = demand.get(f"loader{k}", 0.0) + scaler.demand(name) / max(
                1, scaler.partitions.get(name, 1)
            )
        self.use = {u: Use(cpus=demand.get(u, 0.0), mb=rss[u]) for u in units}
        self.budget = {
            n: Use(cpus=float(m.get("loader_cpus") or m.get("cpus") or 0), mb=float(m.get("memory_mb") or 0))
            for n, m in members.items()
        }
        # the job's pressure (and its warning) is over the loader CPUs of all live nodes
        scaler.cpus = sum(self.budget[n].cpus for n in live if n in self.budget) or scaler.cpus
        now = {n: pressure(n, current, self.use, self.budget) for n in live}
        self.over_for = {n: self.over_for.get(n, 0) + 1 if p > 1 else 0 for n, p in now.items()}
        r.hset(keys.planner, "node_pressure", json.dumps({n: round(p, 3) for n, p in sorted(now.items())}))
        return {n for n, count in self.over_for.items() if count >= self.PATIENCE}


def _reported_metrics(r, keys) -> dict[str, float]:
    """The mean over ranks of each metric the trainers last reported."""
    sums: dict[str, list[float]] = {}
    for raw in r.hvals(keys.metrics):
        for name, value in json.loads(raw)["metrics"].items():
            sums.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sums.items()}
