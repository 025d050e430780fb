"""The Planner role: reads buffer metadata from Redis, publishes one plan per step.

Per step it does O(1) Redis operations: one XREAD over every loader's metadata
stream, one HGETALL of constructor progress, and one MULTI that writes the plan
(`plan:<step>`, expiring), notifies (`plans` stream, entry id `<step+1>-0` so a
reader waiting for step t asks for ids after `t-0` and cannot miss it) and saves the
planner state (step, cursors, RNG) — so the state in Redis never refers to a plan
that was not written.
"""

from __future__ import annotations

import json
import logging
import time

from overlord.errors import PlanError
from overlord.planner import meta
from overlord.planner.core import PlannerCore, resolve_strategy
from overlord.planner.schedule import Dynamic, from_config, mixing_unit
from overlord.planner.tree import ClientPlaceTree
from overlord.sidecar.flow import alive_within, resume_point

log = logging.getLogger("overlord.planner")

PLAN_TTL_S = 3600
CKPT_KEEP = 1024  # planner checkpoints kept (steps a trainer may resume at, behind the newest)
WAIT_MS = 20
AHEAD_POLL_S = 0.002


def run_planner(ctx) -> None:
    """Plan steps until the job's last epoch ends (or forever); see module doc."""
    job, r, keys, layout = ctx.job, ctx.r, ctx.keys, ctx.layout
    core = PlannerCore(
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
    resume = resume_point(r, keys)
    if resume is not None:
        core.restore(resume[1])
        log.info("resuming at step %d from the planner checkpoint", core.step)
    else:
        r.hset(keys.ckpt, 0, json.dumps(core.state()))
    first = core.step  # 0, or the step a resume starts at
    asked: dict[int, int] = {}  # what the loaders were last asked to hold, per stream
    index = {keys.meta(name).encode(): i for i, name in enumerate(layout.streams)}
    last_ids = {keys.meta(name): "0-0" for name in layout.streams}
    waiting_since = time.monotonic()
    while not ctx.stop.is_set():
        ctx.beat()
        progress = r.hgetall(keys.progress)
        slowest = min((int(progress.get(f"c{d}".encode(), first - 1)) for d in range(job.mesh.dp)), default=first - 1)
        ahead = core.step - slowest > job.plan_ahead
        if ahead:
            waiting_since = time.monotonic()  # waiting on trainers is not a stall
        if not ahead and isinstance(core.schedule, Dynamic) and core.schedule.due(core.step):
            core.schedule.observe(core.step, _reported_metrics(r, keys))
        plan = None if ahead else core.plan_step()
        if plan is not None:
            pipe = r.pipeline(transaction=True)
            pipe.set(keys.plan(plan.step), plan.to_json(), ex=PLAN_TTL_S)
            pipe.xadd(keys.plans, {"step": plan.step, "last": int(plan.last)}, id=f"{plan.step + 1}-0", maxlen=1000, approximate=True)
            pipe.hset(keys.planner, mapping={"step": plan.step, "updated": time.time()})
            pipe.hset(keys.ckpt, core.step, json.dumps(core.state()))  # where a resume at step core.step starts
            pipe.hdel(keys.ckpt, core.step - CKPT_KEEP)
            pipe.execute()
            waiting_since = time.monotonic()
            if plan.last:
                log.info("planned the last step %d; planner done", plan.step)
                return
            continue
        if ahead:
            # trainers are behind: poll the small progress hash, not the metadata streams
            ctx.stop.wait(AHEAD_POLL_S)
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
                    core.add(index[stream_key], meta.decode(fields))
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


def _reported_metrics(r, keys) -> dict[str, float]:
    """The mean over ranks of each metric the trainers last reported."""
    sums: dict[str, list[float]] = {}
    for raw in r.hvals(keys.metrics):
        for name, value in json.loads(raw)["metrics"].items():
            sums.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sums.items()}

