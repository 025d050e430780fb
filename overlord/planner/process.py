"""The Planner role: reads buffer metadata from Redis, publishes one plan per step.

Only the holder of the job's lease (lease.py) plans. Each term of leading composes the
controllers, each in a file of its own, and turns them in order once per loop:

    leadership  take over from the newest checkpoint; stop when the lease lapses
    promotion   a Shadow Loader takes over a loader whose heartbeat lapsed
    placing     units follow the nodes' membership and load (several nodes)
    publishing  within plan_ahead of the job's marks, a plan and its checkpoint, once
    feedback    the trainers' metrics reach a dynamic mixing schedule
    scaling     each plan feeds the autoscaler; workers follow demand
    intake      the loaders' metadata in; a stall told from back-pressure

It plans in turns: while ahead it blocks on `progressed` until the trainers (and the
constructors) leave room for `turn_steps(plan_ahead)` steps, then plans those steps and
publishes them together. Per turn that is O(1) Redis operations: one XREAD over every
loader's metadata stream where a step lacks samples, the XREADs of `progressed` it
blocks on while ahead (whose entries carry the marks: no read of the `progress` hash
per step), and one fenced script for the turn's plans and checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import redis

from overlord import heap
from overlord.autoscale.apply import repartitioner as repartitioner_of
from overlord.plan.checkpoint import Checkpoints
from overlord.plan.core import PlannerCore, resolve_strategy
from overlord.plan.schedule import from_config, mixing_unit
from overlord.plan.tree import ClientPlaceTree
from overlord.planner.feedback import feed
from overlord.planner.handoff import Handoffs
from overlord.planner.intake import Intake
from overlord.planner.leadership import Leadership, wait_done
from overlord.planner.placing import Placer
from overlord.planner.promotion import CHECK_S as PROMOTE_CHECK_S
from overlord.planner.promotion import Promoter
from overlord.planner.publishing import Pace, Publisher
from overlord.planner.reshard import Reshards
from overlord.planner.scaling import Scaling, live_partitions
from overlord.runtime.lease import RUN_ENV, Lease, Superseded
from overlord.runtime.placement import homes
from overlord.store.lane import Lane

log = logging.getLogger("overlord.planner")

TURN_MAX = 16  # steps planned and published together at most (the first fill of a long look-ahead)
AHEAD_WAIT_MS = int(PROMOTE_CHECK_S * 1000)  # longest block on `progressed` while ahead (the loop's
# other checks run between: the lease, shadows' promotion, placement)


def run_planner(ctx) -> None:
    """Lead (or wait to lead) the job's planning until its last step is planned."""
    heap.tune_planner()  # per-step arrays reuse the heap instead of fresh pages (overlord/heap.py)
    run = os.environ.get(RUN_ENV)  # its sidecar's run of the job: it leads no other (lease.py)
    lease = Lease(ctx.r, ctx.keys, node=ctx.job.node, run=run.encode() if run else None)
    threading.Thread(target=lease.renew_forever, args=(ctx.stop,), daemon=True, name="lease").start()
    if ctx.job.multi_node:
        # every node runs a Planner; those that do not lead wait silently, and leave when
        # the job's last step is planned
        args = (ctx.r, ctx.keys, ctx.stop, lambda: ctx.silent)
        threading.Thread(target=wait_done, args=args, daemon=True, name="done").start()
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
    lane = Lane(ctx.r)  # the loop's blocking reads and publishing round trips (overlord.store.lane)
    try:
        _plan(ctx, lease, token, lane)
    finally:
        lane.close()


def _plan(ctx, lease: Lease, token: int, lane: Lane) -> None:
    job, r, keys, layout = ctx.job, ctx.r, ctx.keys, ctx.layout
    core, ckpts = _core(job, layout), Checkpoints(keys)
    leadership = Leadership(r, keys, lease, token)
    generation = leadership.take_over(core, ckpts)
    if generation is None:
        return
    first = core.step
    layout = layout.grown(core.reshards)  # the streams of the reshards made before `first`
    handoffs = Handoffs(r, keys, lease, layout)
    handoffs.recover(first)
    publisher = Publisher(r, keys, lease, ckpts, first=first, dp=job.mesh.dp, durable_s=job.redis_outage_s, lane=lane)
    intake = Intake(r, keys, layout, lease, generation, timeout_s=job.timeout_s, run_dir=ctx.run_dir, lane=lane)
    promoter = Promoter(r, keys, lease, layout.shadowed, placed=job.multi_node)
    online = job.autoscale is not None and job.autoscale.online
    scaling = Scaling(r, keys, job, layout) if online else None
    placer = Placer(r, keys, lease, homes(job, layout), job.node_ids) if job.multi_node else None
    reshards = Reshards(r, keys, lease, job)
    repartitioner = repartitioner_of(job, r.get(keys.autoscale), core.schedule) if online else None
    least, pace = turn_steps(job.plan_ahead), Pace()
    while not ctx.stop.is_set():
        ctx.beat()
        leadership.check()
        promoter.check()
        if placer is not None and placer.due():
            budget = placer.check(scaling.loader_demand(handoffs.serving) if scaling is not None else None)
            if scaling is not None and budget is not None:
                scaling.set_budget(budget)
        bound = publisher.bound()
        pace.saw(bound)
        room = bound.room(core.step, job.plan_ahead)
        if room < least:
            intake.progressed()  # waiting on trainers is not a stall
            ctx.stop.wait(pace.settle_s(least - room))  # let the marks of the steps the turn lacks land
            publisher.wait(AHEAD_WAIT_MS)
            continue
        handoffs.look(core.step, first)
        reshards.look()
        turn = []
        for _ in range(min(room, TURN_MAX)):
            feed(r, keys, core.schedule, core.step)
            plan = core.plan_step()
            if plan is None:  # the plan needs samples not yet reported
                break
            plan = handoffs.stamp(plan, len(core.reshards))  # served where the streams are up to it
            if repartitioner is not None and not plan.last:  # the schedule's partitions, decided at this step
                repartition = repartitioner.look(core.step, live_partitions(job, layout))
                if repartition is not None:
                    reshards.request(repartition[0], repartition[1], core.step, repartition[2])
            if reshards.pending and not plan.last:  # between this step and the next (overlord.planner.reshard)
                grown = reshards.make(core, layout, handoffs.serving)
                if grown is not layout:  # this plan is the retired streams' last: it says so
                    layout, plan = grown, dataclasses.replace(plan, generation=len(core.reshards))
                    handoffs.grow(layout)
                    intake.grow(layout)
                    if scaling is not None:
                        scaling.grow(layout)
            turn.append((plan, core.delta()))
            intake.planned(core.took)
            if scaling is not None and plan.step > first + job.plan_ahead:
                # the steps that fill the look-ahead are planned as soon as loaders report
                # samples, not at the pace the job consumes them: timed, they read as a
                # burst, and the scaler took it for demand (several times the real one)
                scaling.observe(plan, core.schedule)
                move = scaling.handoff(plan.step, handoffs.serving, handoffs.allowed)
                if move is not None:
                    handoffs.move(core.step, *move)
            if plan.last or ckpts.snapshot_at(core.step):  # a snapshot holds the core's state: a turn's last
                break
        if not turn:
            for stream, chunk in intake.read(core.wanted):
                core.add(stream, chunk)
            intake.check_stalled(core.step, core.streams, handoffs.serving)
            continue
        publisher.publish_turn(turn, core.state, bound)
        handoffs.published()
        reshards.published()
        intake.progressed()
        plan = turn[-1][0]
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


def turn_steps(plan_ahead: int) -> int:
    """The fewest steps a turn plans once the job runs: the Planner waits until the
    trainers leave room for half its look-ahead, then plans and publishes those steps
    together (one script, one durability wait), so the plans in front of the trainers
    never fall below plan_ahead - turn + 1 steps."""
    return max(1, plan_ahead // 2)
