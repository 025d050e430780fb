"""Scale simulation: the control path of a 4,096-GPU job with 300 sources, on one machine,
against the baseline where every trainer rank loads for itself.

Usage::

    python bench/scale.py --json

prints ONE JSON line: ``planner_ms_per_step`` (median), ``redis_ops_per_step``,
``plan_bytes_per_step``, the same figures for the baseline (``baseline_*``), and details.

The Planner core is the real one (the job's default `balanced` strategy, a mesh of DP
256 x TP 8 x CP 2 = 4,096 ranks, `--global-batch` samples per step from 300 sources of
varying lengths); the roles around it are simulated against a real redis-server, each
doing per step exactly the Redis operations the real role does:

- `--loaders` Source Loader processes (300 streams spread over them): one pipelined
  XADD of a metadata chunk per stream they refill, one GET of the plan, one HGETALL
  each of progress, the planner hash field, the active hash and the workers hash (the
  loop-turn pipeline);
- 256 Data Constructors (one per DP group): a GET of the plan and an HSET of progress;
- the Planner: an XREAD of metadata, an HGETALL of progress, its one fenced script
  (`overlord/planner/step_write.py`: the lease checked, SET plan, XADD plans, HSET
  planner, HSET checkpoint delta; the real one's durability wait is left out), and
  the renewals of its lease (EVALSHA, every `RENEW_S`);
- heartbeats of every role, once a second (counted per second of steps, as a step
  of about a second).

The baseline is the paper's Appendix B one: Source Loaders send data straight to the
trainers, no Data Constructor. The same run, on the same redis-server and the same
Planner, goes on for as many steps again with the 256 Data Constructors replaced by
the 4,096 ranks: each rank GETs the plan, HSETs its progress and heartbeats; the
loaders and the Planner do what they did. Overlord's steps run first, then the
baseline's (two warm-up steps each, not counted), so each phase's progress hash holds
only its own readers.

Per step, for each phase:

- ``redis_ops_per_step``: Redis's own count (`INFO stats` total_commands_processed)
  over the measured steps, divided by the steps; ``redis_ops_ratio`` is baseline /
  Overlord.
- ``fetch_ms_p50``/``p99``: the wall time from the first plan reader's GET to the
  last reader's whole reply, all readers asking at once, each on its own connection to
  the redis-server (raw RESP over the unix socket, one process multiplexing them with
  epoll, so the figure is the server's and the socket's, not 4,096 Python threads').
  The readers only receive the bytes; decoding the plan is not in it. One such round
  is the readers' GETs of the counted step; ``--fetch-rounds`` more follow each step,
  outside the count. Where the fd limit (soft raised to hard) allows fewer
  connections than readers, the GETs are pipelined over as many as it allows
  (``baseline_reader_connections``). A unix socket has no TCP handshake or per-host
  network: this is a floor for the baseline's cost, not its 4k-GPU collapse. The
  client side (one process reading every reply) is in the wall time;
  ``fetch_server_cpu_ms`` is the redis-server's own CPU time (`INFO cpu`) per round of
  the extra rounds, which does not depend on where the readers run.
- ``plan_bytes_fetched_per_step``: the plan bytes all plan readers received (readers x
  plan bytes; RESP framing not counted).

From every measured plan (the data path is not simulated, the plan decides it):

- ``connections``: distinct (loader process, DP group) pairs, the loader owning the
  stream a sample of the group came from (one data stream per loader and Data
  Constructor); ``baseline_connections``: distinct (loader process, rank) pairs,
  every rank of the group needing its samples (TP ranks the same ones, CP ranks a
  slice of the same ones). ``*_over_run`` are the unions over the measured steps,
  what long-lived connections add up to.
- ``sample_sends_per_step``: a sample goes once to its group's Data Constructor;
  ``baseline_sample_sends_per_step``: to every rank of the group (TP x CP).

``planner_ms_per_step`` is the wall time of `plan_step` + encoding + the fenced write
(Overlord's phase), in a process whose allocator is set up as the Planner's
(`overlord.heap.tune_planner`). ``plan_bytes_per_step`` is the plan's binary encoding (`Plan.encode`).
The simulated Planner reads the Data Constructors' marks from the `progressed` entries
they add (as the real one does), not the `progress` hash. ``--no-baseline`` measures
Overlord's phase alone (16,384 ranks are more connections than a redis-server takes). The point is that they
stay far inside a one-second step; the per-trainer baseline's memory is what
`bench/memory.py` measures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from overlord.plan.step_plan import Plan
    from overlord.plan.tree import ClientPlaceTree

SPARE_FDS = 256  # file descriptors left for redis-py and the rest of this process


class PlanReaders:
    """`n` plan readers, each a connection to the redis-server that GETs the plan when told.

    Opens min(n, what the fd limit allows after raising the soft limit to the hard one)
    connections; with fewer than `n`, the GETs are spread over them and pipelined.

    Args:
        path: the redis-server's unix socket.
        n: readers.

    Raises:
        RuntimeError: the server refused a connection (e.g. maxclients).
    """

    def __init__(self, path: str, n: int) -> None:
        used = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < used + n + SPARE_FDS:
            soft = hard if hard == resource.RLIM_INFINITY else min(hard, used + n + SPARE_FDS)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        conns = n if soft == resource.RLIM_INFINITY else max(1, min(n, soft - used - SPARE_FDS))
        self.n, self.socks = n, []
        self.requests = [n // conns + (i < n % conns) for i in range(conns)]
        self.sel = selectors.DefaultSelector()
        for i in range(conns):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            if s.recv(64) != b"+PONG\r\n":
                raise RuntimeError(f"redis-server refused plan reader {i} of {conns}; raise its maxclients")
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, i)
            self.socks.append(s)
        self.buf = memoryview(bytearray(1 << 20))

    def fetch(self, key: str, value: bytes, timeout_s: float = 30.0) -> tuple[float, int]:
        """Every reader GETs `key` at once; returns (seconds until the last has its whole
        reply, plan bytes received). The first connection's replies are checked to be
        `value`'s."""
        request = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key.encode())
        reply = b"$%d\r\n%s\r\n" % (len(value), value)
        left = {i: k * len(reply) for i, k in enumerate(self.requests)}
        first = bytearray()
        deadline = time.perf_counter() + timeout_s
        t0 = time.perf_counter()
        for s, k in zip(self.socks, self.requests):
            if s.send(request * k) != len(request) * k:  # a few hundred bytes into an idle socket
                raise RuntimeError("a plan reader's request did not fit its socket buffer")
        while left:
            for sk, _ in self.sel.select(timeout=1.0):
                i = sk.data
                got = sk.fileobj.recv_into(self.buf)
                if got == 0 or got > left.get(i, 0):
                    raise RuntimeError(f"plan reader {i} got {got} B with {left.get(i, 0)} B to come")
                if i == 0:
                    first += self.buf[:got]
                left[i] -= got
                if not left[i]:
                    del left[i]
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{len(left)} plan readers still waiting after {timeout_s} s")
        elapsed = time.perf_counter() - t0
        if bytes(first) != reply * self.requests[0]:
            raise RuntimeError(f"plan reader 0 got {len(first)} B that are not the plan")
        return elapsed, self.n * len(value)

    def close(self) -> None:
        for s in self.socks:
            self.sel.unregister(s)
            s.close()
        self.sel.close()


def server_cpu_s(r) -> float:
    """CPU seconds the redis-server has used (its main thread and the rest, user + system)."""
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def fan_out(plan: Plan, owner: list[int], tree: ClientPlaceTree) -> tuple[set, set, int, int]:
    """The data path a plan implies.

    Args:
        plan: a step's plan (buckets of the DP axis: one per Data Constructor).
        owner: the loader process of each stream.
        tree: the mesh, for the ranks that consume a bucket.

    Returns:
        (loader, DP group) pairs, (loader, rank) pairs, sample sends to Data
        Constructors, sample sends to ranks.
    """
    groups, ranks, sends, rank_sends = set(), set(), 0, 0
    for b, bucket in enumerate(plan.buckets):
        consumers = tree.ranks(plan.axis, b)
        loaders = {owner[stream] for mb in bucket for stream, _, _ in mb}
        groups |= {(k, b) for k in loaders}
        ranks |= {(k, rank) for k in loaders for rank in consumers}
        samples = sum(len(mb) for mb in bucket)
        sends += samples
        rank_sends += samples * len(consumers)
    return groups, ranks, sends, rank_sends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=300)
    parser.add_argument("--dp", type=int, default=256)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--loaders", type=int, default=64, help="Source Loader processes, simulated")
    parser.add_argument("--steps", type=int, default=20, help="measured steps of each of Overlord and the baseline")
    parser.add_argument(
        "--fetch-rounds", type=int, default=4, help="extra all-readers plan fetches timed after each measured step"
    )
    parser.add_argument("--no-baseline", action="store_true", help="measure Overlord's phase only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from overlord.config import Mesh
    from overlord.heap import tune_planner
    from overlord.plan import meta
    from overlord.plan.checkpoint import Checkpoints
    from overlord.plan.core import PlannerCore, resolve_strategy
    from overlord.plan.meta import MetaChunk
    from overlord.plan.tree import ClientPlaceTree
    from overlord.planner.step_write import StepScript, StepWrite
    from overlord.runtime.lease import RENEW_S, Lease
    from overlord.store import EmbeddedRedis, Keys, connect
    from overlord.store.schema import built_entry

    tune_planner()  # as the Planner process does before its first step
    mesh = Mesh(dp=args.dp, tp=args.tp, cp=args.cp)
    tree = ClientPlaceTree(mesh)
    n = args.sources
    streams = [f"s{i}.0" for i in range(n)]
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.0, n)
    core = PlannerCore(
        streams=streams,
        stream_source=list(range(n)),
        tree=tree,
        weights=list(weights),
        seed=0,
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        finite=False,
        context_length=8192,
        strategy=resolve_strategy("overlord.plan.strategies:balanced"),
    )
    mean_len = rng.integers(200, 6000, n)  # sources differ in document length
    fed = np.zeros(n, dtype=np.int64)
    chunk = max(16, args.global_batch // n * 4)

    def chunk_of(i: int) -> MetaChunk:
        seq = np.arange(fed[i], fed[i] + chunk)
        fed[i] += chunk
        tokens = np.maximum(16, rng.exponential(mean_len[i], chunk)).astype(np.int64)
        return MetaChunk(0, seq, tokens, np.zeros(chunk, np.int32), tokens * 4)

    # per phase: its plan readers (Data Constructors, or every rank) and what was measured
    phases = {"overlord": ("c", args.dp), "baseline": ("r", mesh.world_size)}
    if args.no_baseline:  # e.g. 16,384 ranks: more connections than a redis-server's maxclients
        del phases["baseline"]
    got = {ph: {"ops": [], "fetch_ms": [], "fetched": [], "cpu_ms": [], "conns": 0} for ph in phases}
    times, sizes, fan = [], [], []
    owner = [i % args.loaders for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="ovl-scale-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "run").start()
        try:
            r = connect(server.url)
            keys = Keys("scale")
            # renewed once per RENEW_S of a one-second step, not by a thread: a TTL of a
            # minute keeps a step that takes seconds (65,536 samples on a loaded machine) leading
            lease = Lease(r, keys, node="n0", ttl_s=60.0)
            lease.acquire(threading.Event())
            ckpts = Checkpoints(keys)
            script = StepScript(r)
            pipe = r.pipeline()
            ckpts.write(pipe, 0, None, core.state)
            pipe.execute()
            for i in range(n):  # the loaders' first reports
                core.add(i, chunk_of(i))
            last_ids = {keys.meta(s): "0-0" for s in streams}
            progressed = "0-0"  # the `progressed` entries the simulated Planner has read
            index = {keys.meta(s).encode(): i for i, s in enumerate(streams)}
            reported = fed.copy()
            step = 0
            for phase, (prefix, n_readers) in phases.items():
                readers = PlanReaders(str(server.socket), n_readers)
                got[phase]["conns"] = len(readers.socks)
                roles = 1 + args.loaders + n_readers
                stale = [f for f in r.hkeys(keys.progress) if not f.decode().startswith(prefix)]
                if stale:  # the other phase's readers are gone
                    r.hdel(keys.progress, *stale)
                for warm in range(args.steps + 2):
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
                    for _ in range(round(1 / RENEW_S)):  # a step being about a second
                        if not lease.renew():
                            raise RuntimeError("the simulated Planner lost its lease")
                    plan, t0 = None, 0.0
                    for _ in range(8):
                        reply = r.xread(last_ids, count=chunk)
                        for stream_key, entries in reply or []:
                            i = index[stream_key]
                            for entry_id, fields in entries:
                                core.add(i, meta.decode(fields))
                                last_ids[stream_key.decode()] = entry_id
                        moved = r.xread({keys.progressed: progressed}, count=100_000)  # the marks ride on the entries
                        if moved:
                            progressed = moved[0][1][-1][0]
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
                    encoded = plan.encode()
                    delta = core.delta()

                    write = StepWrite()  # the Planner's one fenced script (its durability wait left out)
                    write.set(keys.plan(plan.step), encoded, ex=3600)
                    write.xadd(keys.plans, {"step": plan.step, "last": 0}, id=f"{plan.step + 1}-0")
                    write.hset(keys.planner, mapping={"step": plan.step, "updated": time.time()})
                    ckpts.write(write, core.step, delta, core.state)
                    with r.pipeline(transaction=False) as p:
                        marker = {"updated": time.time()}
                        script.queue(
                            p, keys=keys, lease_value=lease.value or b"", step=plan.step, write=write, marker=marker
                        )
                        if p.execute()[0] == -1:
                            raise RuntimeError("the simulated Planner lost its lease")
                    elapsed = time.perf_counter() - t0
                    # plan readers (Data Constructors, or every rank): all fetch the plan at
                    # once, each on its own connection, then report progress
                    fetch_s, fetched = readers.fetch(keys.plan(plan.step), encoded)
                    p = r.pipeline(transaction=False)
                    for d in range(n_readers):
                        p.hset(keys.progress, f"{prefix}{d}", plan.step)
                        p.xadd(keys.progressed, built_entry(d, plan.step), maxlen=1000, approximate=True)
                    p.execute()
                    # heartbeats: every role once a second, a step being about a second
                    p = r.pipeline(transaction=False)
                    for role in range(roles):
                        p.set(keys.heartbeat("sim", str(role)), json.dumps({"pid": role, "time": time.time()}), ex=5)
                    p.execute()
                    after = int(r.info("stats")["total_commands_processed"])
                    step += 1
                    if warm < 2:  # the first steps warm caches
                        continue
                    got[phase]["ops"].append(after - before - 2)  # minus the two INFO calls
                    got[phase]["fetched"].append(fetched)
                    got[phase]["fetch_ms"].append(fetch_s * 1000)
                    cpu = server_cpu_s(r)
                    for _ in range(args.fetch_rounds):  # outside the count: more samples of the same
                        got[phase]["fetch_ms"].append(readers.fetch(keys.plan(plan.step), encoded)[0] * 1000)
                    if args.fetch_rounds:
                        got[phase]["cpu_ms"].append((server_cpu_s(r) - cpu) / args.fetch_rounds * 1000)
                    fan.append(fan_out(plan, owner, tree))
                    if phase == "overlord":
                        times.append(elapsed * 1000)
                        sizes.append(len(encoded))
                readers.close()
        finally:
            server.stop()
    ovl = got["overlord"]
    base = got.get("baseline", ovl)  # without a baseline its fields are left out below
    ops, base_ops = int(statistics.median(ovl["ops"])), int(statistics.median(base["ops"]))
    conns = int(statistics.median(len(f[0]) for f in fan))
    base_conns = int(statistics.median(len(f[1]) for f in fan))

    def pct(ms: list[float], q: int) -> float:
        return round(float(np.percentile(ms, q)), 1)

    line = {
        "planner_ms_per_step": round(statistics.median(times), 1),
        "planner_ms_p90": round(float(np.percentile(times, 90)), 1),
        "redis_ops_per_step": ops,
        "plan_bytes_per_step": int(statistics.median(sizes)),
        "gpus": mesh.world_size,
        "dp": args.dp,
        "tp": args.tp,
        "cp": args.cp,
        "sources": n,
        "global_batch": args.global_batch,
        "micro_batches": args.micro_batches,
        "loader_processes": args.loaders,
        "steps": args.steps,
        "baseline_redis_ops_per_step": base_ops,
        "redis_ops_ratio": round(base_ops / ops, 1),
        "plan_bytes_fetched_per_step": int(statistics.median(ovl["fetched"])),
        "baseline_plan_bytes_fetched_per_step": int(statistics.median(base["fetched"])),
        "fetch_ms_p50": pct(ovl["fetch_ms"], 50),
        "fetch_ms_p99": pct(ovl["fetch_ms"], 99),
        "baseline_fetch_ms_p50": pct(base["fetch_ms"], 50),
        "baseline_fetch_ms_p99": pct(base["fetch_ms"], 99),
        "fetch_ms_p50_ratio": round(float(np.percentile(base["fetch_ms"], 50) / np.percentile(ovl["fetch_ms"], 50)), 1),
        "fetch_rounds": len(ovl["fetch_ms"]),
        "fetch_server_cpu_ms": round(statistics.median(ovl["cpu_ms"]), 1) if ovl["cpu_ms"] else None,
        "baseline_fetch_server_cpu_ms": round(statistics.median(base["cpu_ms"]), 1) if base["cpu_ms"] else None,
        "reader_connections": ovl["conns"],
        "baseline_reader_connections": base["conns"],
        "connections": conns,
        "baseline_connections": base_conns,
        "connections_ratio": round(base_conns / conns, 1),
        "connections_over_run": len(set().union(*(f[0] for f in fan))),
        "baseline_connections_over_run": len(set().union(*(f[1] for f in fan))),
        "sample_sends_per_step": int(statistics.median(f[2] for f in fan)),
        "baseline_sample_sends_per_step": int(statistics.median(f[3] for f in fan)),
    }
    if args.no_baseline:
        line = {k: v for k, v in line.items() if "baseline" not in k and "ratio" not in k}
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
