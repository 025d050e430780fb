"""Scaling against a real redis-server: plans that take a costly source fast lead to
more transform workers for it (`workers` hash, `scaling` stream), the pressure over the
loaders' budget is published, and each loader process's demand is what placing weighs."""

from __future__ import annotations

import json
import time

from planner_helpers import chunk, small_core

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.planner.scaling import Scaling
from overlord.runtime.layout import Layout
from overlord.store import Keys

KEYS = Keys("j")


def job() -> Job:
    sources = tuple(Source(name=n, paths=(f"/data/{n}.parquet",)) for n in ("costly", "cheap"))
    return Job(
        name="j",
        sources=sources,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=8, micro_batches=2),
        autoscale={"cpus": 2, "scale_interval": 2, "max_threads": 4},
    )


def test_a_costly_source_consumed_fast_gets_more_workers(r):
    j = job()
    layout = Layout.plan(j)
    r.set(KEYS.autoscale, json.dumps({"costs_ms": {"costly": 200.0, "cheap": 0.001}}))  # start-up profile
    scaling = Scaling(r, KEYS, j, layout)
    core = small_core()  # streams costly.0 and cheap.0 in the layout's order, equal weights
    for i in range(2):
        core.add(i, chunk(range(100)))
    changed = {}
    for _ in range(4):
        plan = core.plan_step()
        time.sleep(0.01)  # ~4 costly samples per 10 ms at 200 ms each: far more than a worker
        changed.update(scaling.observe(plan, core.schedule))
    assert changed == {"costly": 4}  # up at once, to max_threads; the cheap source stays at 1
    assert r.hgetall(KEYS.workers) == {b"costly.0": b"4"}
    (entry,) = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(KEYS.scaling)]
    assert entry["source"] == "costly" and entry["workers"] == "4" and float(entry["demand"]) > 4
    assert float(r.hget(KEYS.planner, "pressure")) > 1  # more than the loaders' CPUs
    assert int(r.hget(KEYS.counters, "over_budget_intervals")) >= 1
    demand = scaling.loader_demand()  # one loader process hosts both streams
    assert list(demand) == ["loader0"] and demand["loader0"] == scaling.scaler.demand("costly") + scaling.scaler.demand(
        "cheap"
    )


def test_the_budget_placing_measures_is_what_pressure_is_over(r):
    scaling = Scaling(r, KEYS, job(), Layout.plan(job()))
    before = scaling.scaler.cpus
    scaling.set_budget(0)  # no live node registered a budget: keep the node's own
    assert scaling.scaler.cpus == before
    scaling.set_budget(12.0)
    assert scaling.scaler.cpus == 12.0


def test_workers_set_before_a_restart_are_where_scaling_resumes(r):
    r.hset(KEYS.workers, mapping={"costly.0": 3})
    assert Scaling(r, KEYS, job(), Layout.plan(job())).scaler.current == {"costly": 3, "cheap": 1}
