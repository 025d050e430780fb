"""Applying the auto-partitioning to a job at start (the sidecar calls `autoscale`).

Costs come from the profile journal in Redis where a source was profiled before, and
from a short in-process profile (`profile_samples` samples) where not. The result sets
each source's partitions and the loader process of each partition, and is stored:

    overlord:{job}:autoscale   JSON {"partitions": {source: n}, "loaders": [[[source, partition], ...], ...],
                                     "costs_ms": {source: ms per sample},
                                     "costs": [SourceCost fields, ...], "budget": {Budget fields}}

The costs and the budget are what online repartitioning (repartition.py) sizes the
sources with while the job runs, the same in any Planner of the job.

A resume reuses the stored result: planner cursors are per partition, so the partitions
of a resumed job cannot change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from overlord.autoscale.partition import Budget, Partitioning, SourceCost, SourcePlan, partition
from overlord.autoscale.profile import costs_from, journaled, measure
from overlord.autoscale.repartition import Repartitioner
from overlord.config import Job
from overlord.errors import ConfigError
from overlord.plan.schedule import Dynamic, from_config

log = logging.getLogger("overlord.autoscale")

PROFILE_SAMPLES = 32


def partition_job(job: Job, costs) -> Partitioning:
    """`partition` of the job's sources at `costs`, under this node's budget and the
    job's batch, plan horizon, per-source read-buffer caps and mixing schedule (a
    source gets the partitions its peak in the schedule needs)."""
    names = [s.name for s in job.sources]
    schedule = from_config(job.mixing, names, [s.weight for s in job.sources])
    return partition(
        costs,
        budget_of(job),
        global_batch=job.batch.global_batch,
        plan_ahead=job.plan_ahead,
        buffer_caps={s.name: s.buffer_bytes for s in job.sources if s.buffer_bytes is not None},
        mixtures=[dict(zip(names, map(float, mix))) for mix in schedule.mixtures()],
    )


def budget_of(job: Job) -> Budget:
    """The node's budget: its `autoscale` fields over defaults from this machine.

    `$OVERLORD_CPUS` and `$OVERLORD_MEMORY_MB` (a sidecar's `--cpus`, `--memory-mb`)
    give this node's share where nodes differ, over the config's fields.
    """
    cfg: dict[str, Any] = job.autoscale.budget_fields() if job.autoscale is not None else {}
    for name, var in (("cpus", "OVERLORD_CPUS"), ("memory_mb", "OVERLORD_MEMORY_MB")):
        if os.environ.get(var):
            try:
                cfg[name] = float(os.environ[var])
            except ValueError:
                raise ConfigError(
                    f"${var}={os.environ[var]!r} is not a number; set it to this node's "
                    f"{'CPUs' if name == 'cpus' else 'MiB'} for the sidecar"
                ) from None
    cpus = float(cfg.get("cpus", len(os.sched_getaffinity(0))))
    defaults: dict[str, Any] = {
        "cpus": cpus,
        # the Data Constructors and the Planner take a slice that grows with the node, so
        # a small machine still has a loader worker left
        "constructor_cpus": max(0.25, min(1.0, cpus / 8)),
        "planner_cpus": max(0.1, min(0.5, cpus / 16)),
        "memory_mb": _available_mb() / 2,
        "buffer_bytes": job.buffer_bytes,
        "buffer_samples": job.buffer_samples,
        "max_workers_per_loader": 1,  # a loader process runs one transform at a time today
    }
    return Budget(**{**defaults, **cfg})


def _available_mb() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 4096.0


def autoscale(job: Job, r, keys, *, resume: bool = False) -> tuple[Job, Partitioning]:
    """The job with auto-partitioned sources, and the partitioning (logged, and stored)."""
    stored = r.get(keys.autoscale) if resume else None
    if stored is not None:
        data = json.loads(stored)
        part, costs_ms = _from_stored(data), data.get("costs_ms", {})
        data = {k: data[k] for k in ("costs", "budget") if k in data}
        how = "as stored by the run being resumed"
    else:
        profiled = costs_from(journaled(r, keys), job)
        missing = [s for s in job.sources if s.name not in profiled]
        configured = job.autoscale.profile_samples if job.autoscale is not None else None
        samples = int(configured or PROFILE_SAMPLES)
        measured = measure(dataclasses.replace(job, sources=tuple(missing)), samples) if missing else {}
        costs = [profiled.get(s.name) or measured[s.name] for s in job.sources]
        part = partition_job(job, costs)
        costs_ms = {c.name: c.transform_ms for c in costs}
        data = {"costs": [dataclasses.asdict(c) for c in costs], "budget": dataclasses.asdict(budget_of(job))}
        how = f"{len(profiled)} source(s) from the profile journal, {len(measured)} profiled now"
    log.info("auto-partitioned the sources (%s):\n%s", how, part.render())
    r.set(
        keys.autoscale,
        json.dumps(
            {
                "partitions": {s.name: s.partitions for s in part.sources},
                "loaders": [[list(x) for x in hosted] for hosted in part.loaders],
                "costs_ms": costs_ms,
                **data,
            }
        ),
    )
    sources = tuple(dataclasses.replace(s, partitions=part.of(s.name).partitions) for s in job.sources)
    return dataclasses.replace(job, sources=sources), part


def repartitioner(job: Job, stored: bytes | None, schedule) -> Repartitioner | None:
    """The job's online repartitioning (repartition.py) from what `autoscale` stored, or
    None: not asked for (`Autoscale.reshards`), a schedule without weights known ahead,
    or a store written before the costs were kept in it."""
    if job.autoscale is None or not (job.autoscale.online and job.autoscale.reshards) or stored is None:
        return None
    if isinstance(schedule, Dynamic):
        log.warning("autoscale.reshards: the mixing weights come from trainer metrics, not known ahead; no reshards")
        return None
    data = json.loads(stored)
    if "costs" not in data or "budget" not in data:
        log.warning(
            "autoscale.reshards: the stored partitioning has no costs (written by an older Overlord); no reshards"
        )
        return None
    return Repartitioner(
        [SourceCost(**c) for c in data["costs"]],
        Budget(**data["budget"]),
        schedule.weights,
        {n: int(p) for n, p in data["partitions"].items()},
        interval=job.autoscale.scale_interval,
        horizon=2 * job.autoscale.scale_interval + job.plan_ahead,
        global_batch=job.batch.global_batch,
        plan_ahead=job.plan_ahead,
        buffer_caps={s.name: s.buffer_bytes for s in job.sources if s.buffer_bytes is not None},
    )


def _from_stored(data: dict) -> Partitioning:
    sources = [SourcePlan(n, 0, 0.0, 0.0, p, 0.0) for n, p in data["partitions"].items()]
    loaders = [[(n, int(p)) for n, p in hosted] for hosted in data["loaders"]]
    return Partitioning(sources=sources, loaders=loaders, loader_workers=[0.0] * len(loaders), memory_mb=0.0)
