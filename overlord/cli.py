"""The `overlord` command: `sidecar`, `check`, `status`, `top`, `plan`, `partition`, `demo`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from overlord import heap
from overlord.config import Job
from overlord.errors import OverlordError
from overlord.logs import setup_logging


def _sidecar(args: argparse.Namespace) -> int:
    heap.use_system_arrow_pool()  # before anything imports pyarrow: Arrow picks its pool then
    # deferred: the sidecar's modules import pyarrow (~0.5 s with numpy, redis), after the pool is chosen
    from overlord.sidecar.sidecar import Sidecar

    job = Job.from_file(args.config)
    if args.cpus is not None:  # the roles it starts read the node's budget from here too
        os.environ["OVERLORD_CPUS"] = str(args.cpus)
    if args.memory_mb is not None:
        os.environ["OVERLORD_MEMORY_MB"] = str(args.memory_mb)
    if args.node:
        job = job.on_node(args.node)
    if args.flight_port or args.metrics_port is not None or args.metrics_host:
        job = dataclasses.replace(
            job,
            flight_port=args.flight_port or job.flight_port,
            metrics_port=job.metrics_port if args.metrics_port is None else args.metrics_port or None,
            metrics_host=args.metrics_host or job.metrics_host,
        )
    return Sidecar(job, exit_when_idle=args.exit_when_idle, resume=args.resume).run()


def _top(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.top import run

    return run(Job.from_file(args.config), interval=args.interval, once=args.once or args.json, as_json=args.json)


def _check(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.runtime.layout import Layout
    from overlord.sidecar.checks import run_checks

    job = Job.from_file(args.config)
    if args.node:
        job = job.on_node(args.node)
    results = run_checks(job, Layout.plan(job).loaders, job.redis_url)
    for name, problem in results:
        print(f"{'FAIL' if problem else 'ok':<5}{name}" + (f": {problem}" if problem else ""))
    return 1 if any(problem for _, problem in results) else 0


def _status(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.status import collect, render

    status = collect(Job.from_file(args.config))
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def _handoff(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.planner.request import request_handoff
    from overlord.store import Keys, connect
    from overlord.store.server import redis_url_of

    job = Job.from_file(args.config)
    code, message = request_handoff(
        connect(redis_url_of(job), timeout_s=5), Keys(job.name), args.stream, args.loader, args.timeout
    )
    print(message, file=sys.stderr if code else sys.stdout)
    return code


def _reshard(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.planner.request import request_reshard
    from overlord.store import Keys, connect
    from overlord.store.server import redis_url_of

    job = Job.from_file(args.config)
    code, message = request_reshard(
        connect(redis_url_of(job), timeout_s=5),
        Keys(job.name),
        args.source,
        args.partitions,
        args.timeout,
        at_step=args.at_step,
    )
    print(message, file=sys.stderr if code else sys.stdout)
    return code


def _plan(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.planner.dryrun import dry_run

    if not args.dry_run:
        print(
            "overlord plan: only --dry-run is supported (plans of a running job are in Redis: overlord status)",
            file=sys.stderr,
        )
        return 2
    result = dry_run(Job.from_file(args.config), steps=args.steps)
    if args.json:
        print(
            json.dumps(
                {
                    "strategy": result.strategy,
                    "steps": result.steps,
                    "imbalance": result.imbalance,
                    "vanilla_imbalance": result.vanilla_imbalance,
                    "speedup_vs_vanilla": result.speedup,
                }
            )
        )
    else:
        print(result.render())
    return 0


def _partition(args: argparse.Namespace) -> int:
    """Print the auto-partitioning a job would get: costs from the profile journal of a
    running (or stopped, embedded) job's Redis where there is one, else profiled now."""
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.autoscale.apply import partition_job
    from overlord.autoscale.profile import costs_from, journaled, measure
    from overlord.status import redis_url_of
    from overlord.store import Keys, connect

    job = Job.from_file(args.config)
    profiled = {}
    try:
        profiled = costs_from(journaled(connect(redis_url_of(job), timeout_s=2, ride_through_s=0), Keys(job.name)), job)
    except OverlordError:
        pass  # no Redis for this job: profile every source here
    missing = [s for s in job.sources if s.name not in profiled]
    measured = measure(dataclasses.replace(job, sources=tuple(missing)), args.samples) if missing else {}
    costs = [profiled.get(s.name) or measured[s.name] for s in job.sources]
    result = partition_job(job, costs)
    if args.json:
        print(
            json.dumps(
                {
                    "costs": [dataclasses.asdict(c) for c in costs],
                    "sources": [dataclasses.asdict(s) for s in result.sources],
                    "loaders": result.loaders,
                    "loader_workers": result.loader_workers,
                    "memory_mb": result.memory_mb,
                    "notes": result.notes,
                }
            )
        )
    else:
        print(
            f"costs: {len(profiled)} source(s) from the profile journal, {len(measured)} profiled now "
            f"({args.samples} samples each)"
        )
        for c in costs:
            print(
                f"  {c.name:<20} {c.transform_ms:9.3f} ms/sample {c.sample_kb:8.1f} KiB/sample {c.state_mb:8.1f} MiB state"
            )
        print(result.render())
    return 0


def _demo(args: argparse.Namespace) -> int:
    # deferred: each subcommand imports only what it runs (pyarrow, redis, numpy: 0.2-0.5 s), so the rest start fast
    from overlord.demo.run import run_demo

    return run_demo(out_dir=args.out, ranks=args.ranks, steps=args.steps, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlord", description="Overlord data loader")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sidecar", help="run the node's sidecar for a job")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("--exit-when-idle", action="store_true", help="exit once the job's trainers are gone")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue where the trainers' load_state_dict positions say (planner checkpoints in Redis)",
    )
    p.add_argument(
        "--node", help="this node's id, one of the job's `nodes` (default: $OVERLORD_NODE, or the config's node)"
    )
    p.add_argument(
        "--flight-port",
        type=int,
        help="serve Arrow Flight on this port instead of the config's flight_port (several nodes on one host)",
    )
    p.add_argument(
        "--cpus",
        type=float,
        help="CPUs this node gives the sidecar (default: the config's autoscale cpus, else all it may use)",
    )
    p.add_argument(
        "--memory-mb",
        type=float,
        help="MiB this node gives the sidecar (default: the config's, else half of what is available)",
    )
    p.add_argument(
        "--metrics-port",
        type=lambda v: int(v) if v.strip() else 0,  # "" from an unset variable: none
        help="serve Prometheus metrics on this port (/metrics); 0: none (default: the config's metrics_port)",
    )
    p.add_argument(
        "--metrics-host",
        help="the address /metrics listens on (default: the config's metrics_host, else 127.0.0.1 on one "
        "node, 0.0.0.0 on several); $OVERLORD_METRICS_TOKEN makes it require that bearer token",
    )
    p.set_defaults(fn=_sidecar)
    p = sub.add_parser("check", help="check what a sidecar needs from this host: shared memory, Redis, sources")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("--node", help="this node's id (several nodes)")
    p.set_defaults(fn=_check)
    p = sub.add_parser("top", help="live view of a running job: roles, sources, trainers")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two refreshes")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.add_argument("--json", action="store_true", help="print one view as JSON and exit")
    p.set_defaults(fn=_top)
    p = sub.add_parser("status", help="show a running job's state from Redis")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_status)
    p = sub.add_parser("handoff", help="serve a stream from another loader process, live, from the next step")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("stream", help="the stream: <source>.<partition> (overlord status lists them)")
    p.add_argument("loader", type=int, help="the loader process index to serve it")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the Planner's answer")
    p.set_defaults(fn=_handoff)
    p = sub.add_parser("reshard", help="read a source with another number of streams, live, from the next step")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("source", help="the source's name")
    p.add_argument("partitions", type=int, help="how many streams (loader partitions) read it from then on")
    p.add_argument(
        "--at-step",
        type=int,
        default=None,
        help="not before this step (a run given the same reshards at the same steps plans the same samples)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the Planner's answer")
    p.set_defaults(fn=_reshard)
    p = sub.add_parser("plan", help="show what the job's strategy would do (per-rank cost, imbalance, speedup)")
    p.add_argument("--config", required=True, help="job YAML/JSON")
    p.add_argument("--dry-run", action="store_true", help="plan in this process; start nothing")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_plan)
    p = sub.add_parser(
        "partition", help="show how autoscale would size the Source Loaders (workers, partitions, processes)"
    )
    p.add_argument("--config", required=True, help="job YAML/JSON (its autoscale: block is the budget)")
    p.add_argument("--samples", type=int, default=32, help="samples to profile per source without a journal")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_partition)
    p = sub.add_parser("demo", help="generate a demo corpus and run a 4-rank job end to end")
    p.add_argument("--out", default="demo-data")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    setup_logging(args.command)
    try:
        return args.fn(args)
    except OverlordError as exc:
        print(f"overlord {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
