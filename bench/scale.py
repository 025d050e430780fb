"""Scale simulation: the control path of a 4,096-GPU job with 300 sources, on one machine.

Usage::

    python bench/scale.py --json

prints ONE JSON line: ``planner_ms_per_step`` (median), ``redis_ops_per_step``,
``plan_bytes_per_step``, and details.

The Planner core is the real one (the job's default `balanced` strategy, a mesh of DP
256 x TP 8 x CP 2 = 4,096 ranks, `--global-batch` samples per step from 300 sources of
varying lengths); the roles around it are simulated against a real redis-server, each
doing per step exactly the Redis operations the real role does:

- `--loaders` Source Loader processes (300 streams spread over them): one pipelined
  XADD of a metadata chunk per stream they refill, one GET of the plan, one HGETALL
  each of progress, the planner hash field, the active hash and the workers hash (the
  loop-turn pipeline);
- 256 Data Constructors (one per DP group): a GET of the plan and an HSET of progress;
- the Planner: an XREAD of metadata, an HGETALL of progress, and its fenced MULTI
  (WATCH, GET lease, SET plan, XADD plans, HSET planner, HSET checkpoint delta);
- heartbeats of every role, once a second (counted per second of steps, as a step
  of about a second).

``redis_ops_per_step`` is Redis's own count (`INFO stats` total_commands_processed)
over the measured steps, divided by the steps. ``planner_ms_per_step`` is the wall time
of `plan_step` + encoding + the fenced write. ``plan_bytes_per_step`` is the plan's
JSON. The point is that they stay far inside a one-second step; the per-trainer
baseline (every rank opening every source itself) has no control path to measure, its
cost is the memory `bench/memory.py` measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=300)
    parser.add_argument("--dp", type=int, default=256)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--loaders", type=int, default=64, help="Source Loader processes, simulated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from overlord.config import Mesh
    from overlord.planner import meta
    from overlord.planner.checkpoint import Checkpoints
    from overlord.planner.core import PlannerCore, resolve_strategy
    from overlord.planner.lease import Lease
    from overlord.planner.meta import MetaChunk
    from overlord.planner.tree import ClientPlaceTree
    from overlord.store import EmbeddedRedis, Keys, connect

    mesh = Mesh(dp=args.dp, tp=args.tp, cp=args.cp)
    n = args.sources
    streams = [f"s{i}.0" for i in range(n)]
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.0, n)
    core = PlannerCore(streams=streams, stream_source=list(range(n)), tree=ClientPlaceTree(mesh),
                       weights=list(weights), seed=0, global_batch=args.global_batch,
                       micro_batches=args.micro_batches, finite=False, context_length=8192,
                       strategy=resolve_strategy("overlord.planner.strategies:balanced"))
    mean_len = rng.integers(200, 6000, n)  # sources differ in document length
    fed = np.zeros(n, dtype=np.int64)
    chunk = max(16, args.global_batch // n * 4)

    def chunk_of(i: int) -> MetaChunk:
        seq = np.arange(fed[i], fed[i] + chunk)
        fed[i] += chunk
        tokens = np.maximum(16, rng.exponential(mean_len[i], chunk)).astype(np.int64)
        return MetaChunk(0, seq, tokens, np.zeros(chunk, np.int32), tokens * 4)

    with tempfile.TemporaryDirectory(prefix="ovl-scale-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "run").start()
        try:
            r = connect(server.url)
            keys = Keys("scale")
            lease = Lease(r, keys, node="n0")
            lease.acquire(threading.Event())
            ckpts = Checkpoints(keys)
            pipe = r.pipeline()
            ckpts.write(pipe, 0, None, core.state)
            pipe.execute()
            owner = [i % args.loaders for i in range(n)]
            roles = 1 + args.loaders + args.dp
            for i in range(n):  # the loaders' first reports
                core.add(i, chunk_of(i))
            last_ids = {keys.meta(s): "0-0" for s in streams}
            index = {keys.meta(s).encode(): i for i, s in enumerate(streams)}
            reported = fed.copy()
            times, sizes, ops = [], [], []
            for step in range(args.steps + 2):
                before = int(r.info("stats")["total_commands_processed"])
                # Source Loaders: refill the streams the last plan drew from, then their loop turn
                low = [i for i, s in enumerate(core.streams) if s.count < chunk]
                for k in range(args.loaders):
                    p = r.pipeline(transaction=False)
                    for i in (i for i in low if owner[i] == k):
                        c = chunk_of(i)
                        p.xadd(keys.meta(streams[i]), meta.encode(c))
                        reported[i] = fed[i]
                    p.get(keys.plan(step))
                    p.hgetall(keys.progress)
                    p.hget(keys.planner, "token")
                    p.hget(keys.active, k)
                    p.hgetall(keys.workers)
                    p.execute()
                # the Planner: read metadata, plan (asking for more where a step needs it, as
                # the `demand` hash does), publish under its lease
                plan, t0 = None, 0.0
                for _ in range(8):
                    reply = r.xread(last_ids, count=chunk)
                    for stream_key, entries in reply or []:
                        i = index[stream_key]
                        for entry_id, fields in entries:
                            core.add(i, meta.decode(fields))
                            last_ids[stream_key.decode()] = entry_id
                    r.hgetall(keys.progress)
                    t0 = time.perf_counter()
                    plan = core.plan_step()
                    if plan is not None:
                        break
                    p = r.pipeline(transaction=False)
                    for i, want in core.wanted.items():
                        while core.streams[i].count + (fed[i] - reported[i]) < want:
                            c = chunk_of(i)
                            p.xadd(keys.meta(streams[i]), meta.encode(c))
                        reported[i] = fed[i]
                    p.execute()
                if plan is None:
                    raise RuntimeError("the simulated loaders fell behind the plan")
                encoded = plan.to_json()
                delta = core.delta()

                def publish(p, plan=plan, encoded=encoded, delta=delta) -> None:
                    p.set(keys.plan(plan.step), encoded, ex=3600)
                    p.xadd(keys.plans, {"step": plan.step, "last": 0}, id=f"{plan.step + 1}-0")
                    p.hset(keys.planner, mapping={"step": plan.step, "updated": time.time()})
                    ckpts.write(p, core.step, delta, core.state)

                lease.fenced(publish)
                elapsed = time.perf_counter() - t0
                # Data Constructors: fetch the plan, report progress
                p = r.pipeline(transaction=False)
                for d in range(args.dp):
                    p.get(keys.plan(plan.step))
                    p.hset(keys.progress, f"c{d}", plan.step)
                p.execute()
                # heartbeats: every role once a second, a step being about a second
                p = r.pipeline(transaction=False)
                for role in range(roles):
                    p.set(keys.heartbeat("sim", str(role)), json.dumps({"pid": role, "time": time.time()}), ex=5)
                p.execute()
                after = int(r.info("stats")["total_commands_processed"])
                if step >= 2:  # the first steps warm caches
                    times.append(elapsed * 1000)
                    sizes.append(len(encoded))
                    ops.append(after - before - 2)  # minus the two INFO calls
        finally:
            server.stop()
    line = {
        "planner_ms_per_step": round(statistics.median(times), 1),
        "planner_ms_p90": round(float(np.percentile(times, 90)), 1),
        "redis_ops_per_step": int(statistics.median(ops)),
        "plan_bytes_per_step": int(statistics.median(sizes)),
        "gpus": mesh.world_size, "dp": args.dp, "tp": args.tp, "cp": args.cp, "sources": n,
        "global_batch": args.global_batch, "micro_batches": args.micro_batches, "loader_processes": args.loaders,
        "steps": args.steps,
    }
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
