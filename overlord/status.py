"""`overlord status`: what a job is doing, read from Redis (the same keys an operator
would read with redis-cli)."""

from __future__ import annotations

import json
import time
from typing import Any

from overlord.config import Job
from overlord.loader.skips import per_file
from overlord.plan.checkpoint import Checkpoints
from overlord.runtime.lease import holder
from overlord.store import Keys, connect
from overlord.store.schema import (
    RESUME_STEP,
    counter_values,
    decode_active,
    dp_of,
    is_built_field,
    is_replay_field,
    is_trainer_stats_field,
    json_records,
    log_entries,
    planner_state,
    replay_step,
    resume_fields,
    skipped_file_of,
    stats_rank,
)
from overlord.store.server import redis_url_of


def collect(job: Job) -> dict[str, Any]:
    """The job's status as plain data."""
    r = connect(redis_url_of(job), timeout_s=5)
    keys = Keys(job.name)
    planner = planner_state(r.hgetall(keys.planner))
    ckpts = Checkpoints(keys)
    newest = ckpts.newest(r)
    state = ckpts.load(r, newest) if newest is not None else {}
    now = time.time()
    roles = {}
    for key in sorted(r.scan_iter(match=keys.heartbeat_pattern, count=1000)):
        raw = r.get(key)
        if raw:
            hb = json.loads(raw)
            roles[key.decode().split(":hb:", 1)[1]] = {
                "pid": hb["pid"],
                "node": hb["node"],
                "age_s": round(now - hb["time"], 2),
                "loop_age_s": round(hb.get("loop_age", 0.0) + now - hb["time"], 2),
            }
    return {
        "job": job.name,
        "step": planner.step,
        "cursors": state.get("cursors", {}),
        "roles": roles,
        "progress": {k.decode(): int(v) for k, v in r.hgetall(keys.progress).items() if is_built_field(k)},
        "replays": {k.decode(): replay_step(v) for k, v in r.hgetall(keys.progress).items() if is_replay_field(k)},
        "leader": holder(r, keys),
        "generation": planner.token,
        "active_loaders": {
            k.decode(): dict(zip(("pid", "node"), decode_active(v) or ())) for k, v in r.hgetall(keys.active).items()
        },
        "promotions": log_entries(r.xrange(keys.promotions)),
        "restarts": {k.decode(): int(v) for k, v in r.hgetall(keys.restarts).items()},
        "workers": {k.decode(): int(v) for k, v in r.hgetall(keys.workers).items()},
        "pressure": planner.pressure,
        "node_pressure": planner.node_pressure,
        "scaling": log_entries(r.xrevrange(keys.scaling, count=10))[::-1],
        "handoffs": log_entries(r.xrevrange(keys.handoffs, count=10))[::-1],
        "reshards": log_entries(r.xrevrange(keys.reshards, count=10))[::-1],
        "autoscale": json.loads(r.get(keys.autoscale) or "null"),
        "counters": counter_values(r.hgetall(keys.counters)),
        "nodes": json_records(r.hgetall(keys.nodes)),
        "placement": {k.decode(): v.decode() for k, v in r.hgetall(keys.placement).items()},
        "moves": log_entries(r.xrevrange(keys.placements, count=10))[::-1],
        "errors": [json.loads(e)["message"] for e in r.lrange(keys.errors, 0, -1)],
        "checkpoints": _checkpoints(r, keys),
        "resume": resume_fields(r.hgetall(keys.resume)),
        "trainers": {k: v for k, v in json_records(r.hgetall(keys.stats)).items() if is_trainer_stats_field(k)},
    }


def _checkpoints(r, keys: Keys) -> dict[str, Any]:
    steps = Checkpoints(keys).steps(r)
    return {
        "count": len(steps),
        "oldest_step": steps[0] if steps else None,
        "newest_step": steps[-1] if steps else None,
        "snapshots": r.hlen(keys.ckpt),
        "deltas": r.hlen(keys.ckpt_delta),
    }


def render(status: dict[str, Any]) -> str:
    lines = [f"job {status['job']}: planned step {status['step']}"]
    lease = status.get("leader")
    if lease:
        lines.append(
            f"planner lease: token {lease['token']} held by pid {lease['pid']} on node {lease['node']} "
            f"(planning generation {status.get('generation')})"
        )
    else:
        lines.append("planner lease: free (no Planner leads)")
    lines.append("roles (heartbeat age, time since the role's main loop last turned):")
    for name, hb in status["roles"].items():
        lines.append(
            f"  {name:<16} pid {hb['pid']:<8} node {hb['node']:<10} heartbeat {hb['age_s']:.1f}s ago, "
            f"loop {hb['loop_age_s']:.1f}s ago"
        )
    for node, info in sorted(status["nodes"].items()):
        beat = status["roles"].get(f"sidecar:{node}")
        alive = f"heartbeat {beat['age_s']:.1f}s ago" if beat else "NO heartbeat (lapsed)"
        lines.append(
            f"node {node}: sidecar pid {info.get('pid')} on {info.get('host', '?')}, {alive}, "
            f"ranks {info.get('ranks')}, budget {info.get('cpus')} CPUs ({info.get('loader_cpus')} for "
            f"loaders) / {info.get('memory_mb')} MiB"
            + (f", pressure {status['node_pressure'][node]}" if node in status["node_pressure"] else "")
            + (f", Flight {info['flight']}" if info.get("flight") else "")
        )
    if status["placement"]:
        lines.append("placement: " + ", ".join(f"{u}@{n}" for u, n in sorted(status["placement"].items())))
    for move in status["moves"]:
        lines.append(f"  moved {move['unit']} {move['from']} -> {move['to']} ({move['reason']})")
    if status["progress"]:
        lines.append(
            "constructors (last step written): " + ", ".join(f"{k}={v}" for k, v in sorted(status["progress"].items()))
        )
    for name, t in sorted(status.get("trainers", {}).items(), key=lambda kv: stats_rank(kv[0])):
        lines.append(
            f"trainer {name}: {t.get('batches', 0)} batches, waited {t.get('wait_s', 0):.1f}s, "
            f"{t.get('copies', 0)} copied out of the ring (held more than it can lease)"
            + (f", {t['dropped']} received twice and dropped" if t.get("dropped") else "")
        )
    lines.append("cursors (epoch, seq) per stream:")
    for name, cur in sorted(status["cursors"].items()):
        lines.append(f"  {name:<24} epoch {cur[0]} seq {cur[1]}")
    ck = status["checkpoints"]
    if ck["count"]:
        lines.append(
            f"planner checkpoints: {ck['snapshots']} snapshot(s) + {ck['deltas']} delta(s) "
            f"(a trainer can resume at steps {ck['oldest_step']}..{ck['newest_step']})"
        )
    if status.get("active_loaders"):
        lines.append(
            "active Source Loader processes: "
            + ", ".join(f"loader{k}=pid {v['pid']} on {v['node']}" for k, v in sorted(status["active_loaders"].items()))
        )
    for p in status.get("promotions", []):
        lines.append(
            f"promoted: shadow pid {p['pid']} of loader{p['loader']} on {p['node']} ({p['reason']}) "
            f"at {time.strftime('%H:%M:%S', time.localtime(float(p['time'])))}"
        )
    for name, n in sorted(status.get("restarts", {}).items()):
        lines.append(f"restarted: {name} {n} time(s) by the sidecar")
    if status.get("autoscale"):
        lines.append(
            "auto-partitioned: "
            + ", ".join(f"{n}={p} partition(s)" for n, p in status["autoscale"]["partitions"].items())
        )
    if status.get("pressure") is not None:
        lines.append(
            f"loader CPU pressure: {status['pressure']} (busy workers demanded / CPU budget; over 1, "
            "loading holds the trainers back)"
        )
    if status.get("workers"):
        lines.append("transform workers: " + ", ".join(f"{k}={v}" for k, v in sorted(status["workers"].items())))
    for e in status.get("scaling", []):
        lines.append(
            f"scaled: step {e['step']} source {e['source']} -> {e['workers']} worker(s) "
            f"({e['rate']} samples/s x {e['cost_ms']} ms = {e['demand']} busy workers)"
        )
    for e in status.get("handoffs", []):
        if e["to"] == "-1":
            lines.append(f"handoff refused: stream {e['stream']} at step {e['step']}: {e['reason']}")
        elif e["from"] != e["to"]:
            lines.append(
                f"handoff: stream {e['stream']} loader process {e['from']} -> {e['to']} from step {e['step']} "
                f"({e['reason']})"
            )
    for e in status.get("reshards", []):
        if e["to"] == "-1":
            lines.append(f"reshard refused: source {e['source']}: {e['reason']}")
        elif e["streams"]:
            lines.append(
                f"reshard: source {e['source']} {e['from']} -> {e['to']} streams from step {e['step']} ({e['streams']})"
            )
    for dp, step in sorted(status.get("replays", {}).items()):
        lines.append(f"replay: Data Constructor {dp_of(dp)} restarted at step {step}")
    if status["resume"].get(RESUME_STEP) is not None:
        lines.append(f"resumed at step {status['resume'][RESUME_STEP]}")
    for (source, uri), n in sorted(per_file(status["counters"]).items()):
        what = (
            "skipped whole (not readable, or lacks a declared column)"
            if n["whole"]
            else (f"{n['rows']} row(s) skipped" + (f", {n['groups']} unreadable row group(s)" if n["groups"] else ""))
        )
        lines.append(f"skipped (on_error: skip): source {source!r} file {uri!r}: {what}; the loader log says why")
    for k, v in sorted(status["counters"].items()):
        if skipped_file_of(k) is None:
            lines.append(f"counter {k} = {v}")
    for e in status["errors"]:
        lines.append(f"ERROR {e}")
    return "\n".join(lines)
