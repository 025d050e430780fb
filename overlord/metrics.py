"""What a job is doing, as numbers: one snapshot of its Redis state, served to
Prometheus and drawn by `overlord top`.

Every role already keeps its state in the job's Redis keys (heartbeats with loop age
and RSS, the Planner's step and pressure, the constructors' progress, the loaders'
and trainers' running totals in `stats`). `snapshot` reads them in one round trip;
nothing is measured twice and no role serves anything itself. A sidecar started with
a metrics port runs this module as a process of its own (`python -m
overlord.metrics`), which answers each scrape with a fresh snapshot of the roles and
ranks of its node plus the job-wide figures:

    overlord_up                                   1 while the job's Redis answers
    overlord_planner_step                         last step planned
    overlord_constructor_step{dp}                 last step a Data Constructor wrote
    overlord_constructor_lag_steps{dp}            planned minus written
    overlord_constructor_copies_total{dp}         samples copied out of a loader ring: the
                                                  constructor held more than the ring holds,
                                                  or took the ring over from a Flight endpoint
    overlord_role_heartbeat_age_seconds{role}     since the role's last heartbeat
    overlord_role_loop_age_seconds{role}          since its main loop last turned
    overlord_role_rss_bytes{role}
    overlord_source_samples_total{source,stream}  samples read and transformed
    overlord_source_transform_seconds_total{..}   time spent on them
    overlord_source_buffered_samples{..}          in the read buffer, not yet sent
    overlord_source_buffered_bytes{..}            their bytes (what the buffer holds in memory)
    overlord_source_workers{..}                   transform workers
    overlord_source_skipped_total{..}             bad rows skipped (on_error: skip)
    overlord_source_skipped_files_total{..}       files skipped whole (on_error: skip)
    overlord_source_skipped_row_groups_total{..}  unreadable row groups skipped (on_error: skip)
    overlord_trainer_batches_total{rank}
    overlord_trainer_wait_seconds_total{rank}     time in DataLoader.__next__ (stall)
    overlord_trainer_copies_total{rank}           batches copied out of the ring: the trainer
                                                  held more than the ring can lease
    overlord_loader_pressure                      busy workers demanded / loader CPUs
    overlord_node_pressure{of_node}               the same per node (several nodes)
    overlord_role_restarts_total{role}
    overlord_errors                               error records of the job

Every series carries `job` and `node` labels. Rates (samples/s, stall share) are
PromQL's `rate()`; `overlord top` takes them between two snapshots.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from overlord.config import Job, split_redis_password
from overlord.errors import ConfigError
from overlord.runtime import service
from overlord.store import Keys, connect
from overlord.store.client import password_env
from overlord.store.schema import (
    copied_field,
    counter_values,
    dp_of,
    is_built_field,
    is_loader_stats_field,
    is_trainer_stats_field,
    json_records,
    planner_state,
    stats_rank,
)

TOKEN_ENV = "OVERLORD_METRICS_TOKEN"


def snapshot(r, keys: Keys) -> dict[str, Any]:
    """The job's figures now, as plain data (one pipelined round trip plus a SCAN)."""
    beats = sorted(r.scan_iter(match=keys.heartbeat_pattern, count=1000))
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.planner)
    pipe.hgetall(keys.progress)
    pipe.hgetall(keys.stats)
    pipe.hgetall(keys.restarts)
    pipe.hgetall(keys.counters)
    pipe.llen(keys.errors)
    for key in beats:
        pipe.get(key)
    planner, progress, stats, restarts, counters, errors, *raw_beats = pipe.execute()
    now = time.time()
    planner = planner_state(planner)
    roles = {}
    for key, raw in zip(beats, raw_beats):
        if raw is None:
            continue
        hb = json.loads(raw)
        role, ident = key.decode().split(":hb:", 1)[1].split(":", 1)
        name = f"sidecar:{ident}" if role == "sidecar" else f"{role}{ident}"
        roles[name] = {
            "pid": hb.get("pid"),
            "node": hb.get("node", ""),
            "age_s": max(0.0, now - hb["time"]),
            "loop_age_s": hb.get("loop_age", 0.0) + max(0.0, now - hb["time"]),
            "rss_mb": hb.get("rss_mb"),
        }
    stats = json_records(stats)
    return {
        "time": now,
        "step": planner.step,
        "done": planner.done,
        "pressure": planner.pressure,
        "node_pressure": planner.node_pressure,
        "progress": {dp_of(k): int(v) for k, v in progress.items() if is_built_field(k)},
        "roles": roles,
        "loaders": {k: v for k, v in stats.items() if is_loader_stats_field(k)},
        "ranks": {stats_rank(k): v for k, v in stats.items() if is_trainer_stats_field(k)},
        "restarts": {k.decode(): int(v) for k, v in restarts.items()},
        "counters": counter_values(counters),
        "errors": int(errors),
    }


def source_of(stream: str) -> str:
    """The source a stream (`<source>.<partition>`) belongs to."""
    return stream.rsplit(".", 1)[0]


class JobCollector:
    """A prometheus_client collector: each scrape reads a fresh snapshot of the job.

    Args:
        job: the job.
        r: a Redis client of the job's Redis.
        node: only the roles and ranks of this node (None: all of them); job-wide
            figures come from every node's endpoint alike.
    """

    def __init__(self, job: Job, r, node: str | None = None) -> None:
        self.job, self.r, self.node, self.keys = job, r, node, Keys(job.name)

    def _mine(self, node: str | None) -> bool:
        return self.node is None or node == self.node

    def collect(self) -> Iterator:
        # deferred: prometheus_client (~0.3 s to import) serves the metrics process only, not the
        # sidecar and the roles it forks, which import this module for start_metrics_process
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        base = {"job": self.job.name, "node": self.node or self.job.node}

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()):
            return GaugeMetricFamily(f"overlord_{name}", doc, labels=[*base, *extra])

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return CounterMetricFamily(f"overlord_{name}", doc, labels=[*base, *extra])

        up = gauge("up", "1 while the job's Redis answers")
        try:
            snap = snapshot(self.r, self.keys)
        except Exception:  # noqa: BLE001 - Redis away: say so, do not fail the scrape
            up.add_metric(list(base.values()), 0)
            yield up
            return
        up.add_metric(list(base.values()), 1)
        yield up
        labels = list(base.values())
        if snap["step"] is not None:
            g = gauge("planner_step", "last step the Planner published")
            g.add_metric(labels, snap["step"])
            yield g
        step, lag = (
            gauge("constructor_step", "last step a Data Constructor wrote", ("dp",)),
            gauge("constructor_lag_steps", "steps planned but not yet written by the Data Constructor", ("dp",)),
        )
        for dp, written in sorted(snap["progress"].items()):
            step.add_metric([*labels, str(dp)], written)
            if snap["step"] is not None:
                lag.add_metric([*labels, str(dp)], max(0, snap["step"] - written))
        yield step
        yield lag
        copied = counter(
            "constructor_copies",
            "samples copied out of a loader ring: held more than it holds, or taken from a Flight endpoint",
            ("dp",),
        )
        for dp in sorted(snap["progress"]):
            copied.add_metric([*labels, str(dp)], snap["counters"].get(copied_field(dp), 0))
        yield copied
        age = gauge("role_heartbeat_age_seconds", "seconds since the role's last heartbeat", ("role",))
        loop = gauge("role_loop_age_seconds", "seconds since the role's main loop last turned", ("role",))
        rss = gauge("role_rss_bytes", "resident memory of the role's process", ("role",))
        for role, info in sorted(snap["roles"].items()):
            if not self._mine(info["node"]):
                continue
            age.add_metric([*labels, role], info["age_s"])
            loop.add_metric([*labels, role], info["loop_age_s"])
            if info["rss_mb"] is not None:
                rss.add_metric([*labels, role], info["rss_mb"] * 2**20)
        yield age
        yield loop
        yield rss
        families = {
            "samples": counter("source_samples", "samples read and transformed", ("source", "stream")),
            "transform_s": counter(
                "source_transform_seconds", "seconds spent reading and transforming", ("source", "stream")
            ),
            "buffered": gauge(
                "source_buffered_samples", "samples in the read buffer, not yet sent", ("source", "stream")
            ),
            "buffered_bytes": gauge(
                "source_buffered_bytes", "bytes of the samples in the read buffer", ("source", "stream")
            ),
            "workers": gauge("source_workers", "transform workers of the stream", ("source", "stream")),
            "skipped": counter("source_skipped", "bad rows skipped (on_error: skip)", ("source", "stream")),
            "skipped_files": counter(
                "source_skipped_files", "files skipped whole (on_error: skip)", ("source", "stream")
            ),
            "skipped_row_groups": counter(
                "source_skipped_row_groups", "unreadable row groups skipped (on_error: skip)", ("source", "stream")
            ),
        }
        for record in snap["loaders"].values():
            if not self._mine(record.get("node")):
                continue
            for stream, s in sorted(record["streams"].items()):
                at = [*labels, source_of(stream), stream]
                families["samples"].add_metric(at, s["prepared"])
                families["transform_s"].add_metric(at, s["transform_s"])
                families["buffered"].add_metric(at, s["buffered"])
                families["buffered_bytes"].add_metric(at, s["buffered_bytes"])
                families["workers"].add_metric(at, s["workers"])
                families["skipped"].add_metric(at, s["skipped"])
                families["skipped_files"].add_metric(at, s.get("skipped_files", 0))
                families["skipped_row_groups"].add_metric(at, s.get("skipped_row_groups", 0))
        yield from families.values()
        batches = counter("trainer_batches", "micro-batches the trainer read", ("rank",))
        wait = counter("trainer_wait_seconds", "seconds the trainer waited in DataLoader.__next__", ("rank",))
        copies = counter(
            "trainer_copies", "batches copied out of the ring: the trainer held more than it can lease", ("rank",)
        )
        for rank, record in sorted(snap["ranks"].items()):
            if self._mine(record.get("node")):
                batches.add_metric([*labels, str(rank)], record["batches"])
                wait.add_metric([*labels, str(rank)], record["wait_s"])
                copies.add_metric([*labels, str(rank)], record.get("copies", 0))
        yield batches
        yield wait
        yield copies
        if snap["pressure"] is not None:
            g = gauge("loader_pressure", "busy transform workers demanded over the loaders' CPU budget")
            g.add_metric(labels, snap["pressure"])
            yield g
        g = gauge("node_pressure", "a node's loader demand and memory over its budget (several nodes)", ("of_node",))
        for node, p in sorted(snap["node_pressure"].items()):
            g.add_metric([*labels, node], p)
        yield g
        c = counter("role_restarts", "times the sidecar restarted the role", ("role",))
        for role, n in sorted(snap["restarts"].items()):
            c.add_metric([*labels, role], n)
        yield c
        g = gauge("errors", "error records the job's roles pushed")
        g.add_metric(labels, snap["errors"])
        yield g


def start_metrics_process(job: Job, run_dir, redis_url: str) -> subprocess.Popen:
    """Serve /metrics for this node in a process of its own (overlord.runtime.service)."""
    return service.start(
        "overlord.metrics",
        run_dir,
        "metrics.log",
        {"OVERLORD_REDIS_URL": split_redis_password(redis_url)[0], **password_env(redis_url)},
    )


def metrics_host(job: Job) -> str:
    """The address /metrics listens on: `Job.metrics_host`, else loopback on one node and
    every interface on several (a Prometheus elsewhere scrapes each node)."""
    if job.metrics_host:
        return job.metrics_host
    return "0.0.0.0" if job.multi_node else "127.0.0.1"


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is not news


def guarded(app: Callable, token: str | None) -> Callable:
    """`app` behind `Authorization: Bearer <token>` (compared in constant time); None: open."""
    if not token:
        return app
    want = f"Bearer {token}".encode()

    def check(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, want):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", 'Bearer realm="overlord"')],
            )
            return [
                f"401: /metrics needs the header 'Authorization: Bearer <token>' with the token the "
                f"sidecar has in ${TOKEN_ENV}\n".encode()
            ]
        return app(environ, start_response)

    return check


def serve_http(app: Callable, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve the WSGI `app` on (host, port) from a daemon thread (IPv4 or IPv6 by `host`)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    server: WSGIServer = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http")
    thread.start()
    return server, thread


def main(argv: list[str] | None = None) -> int:
    def start(job: Job):
        # deferred: prometheus_client (~0.3 s to import) is needed by this server process only
        from prometheus_client import make_wsgi_app
        from prometheus_client.core import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(
            JobCollector(
                job, connect(os.environ["OVERLORD_REDIS_URL"], timeout_s=5), node=job.node if job.multi_node else None
            )
        )
        token = os.environ.get(TOKEN_ENV) or None
        host, port = metrics_host(job), job.metrics_port
        if port is None:
            raise ConfigError(f"job {job.name!r} has no Job.metrics_port; the sidecar starts this server only with one")
        server, _ = serve_http(guarded(make_wsgi_app(registry), token), host, port)
        logging.getLogger("overlord.metrics").info(
            "serving Prometheus metrics on %s port %d (/metrics)%s",
            host,
            port,
            f", bearer token from ${TOKEN_ENV} required" if token else "",
        )
        return server.shutdown

    return service.main("metrics", argv, start)


if __name__ == "__main__":
    sys.exit(main())
