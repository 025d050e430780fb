"""`overlord top`: a live view of a running job, refreshed every second.

Per role: heartbeat age, main-loop age, RSS, restarts. Per stream (source
partition): samples per second, transform milliseconds per sample, read-buffer fill,
transform workers, rows skipped. Per trainer rank: batches per second, the share of
its time spent waiting for data (stall), its step, and how far it is behind the plan.
Rates are taken between two snapshots of the job's Redis (overlord.metrics.snapshot),
so `top` needs nothing but the config and adds no load to the data path.

`--once` prints one view (two snapshots `--interval` apart) and exits; `--json`
prints that view as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from overlord.config import Job
from overlord.metrics import snapshot, source_of
from overlord.status import redis_url_of
from overlord.store import Keys, connect


def view(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    """What changed between two snapshots, as rates (pure)."""
    dt = max(1e-6, cur["time"] - prev["time"])
    streams = {}
    for name, record in cur["loaders"].items():
        before = prev["loaders"].get(name, {}).get("streams", {})
        for stream, s in record["streams"].items():
            b = before.get(stream, {"prepared": s["prepared"], "transform_s": s["transform_s"]})
            n = s["prepared"] - b["prepared"]
            if n < 0:  # the loader process restarted: its totals began again
                n, b = s["prepared"], {"transform_s": 0.0}
            streams[stream] = {
                "source": source_of(stream),
                "loader": name,
                "node": record.get("node", ""),
                "samples_per_s": round(n / dt, 1),
                "transform_ms": round(1000 * (s["transform_s"] - b["transform_s"]) / n, 3) if n > 0 else None,
                "buffered": s["buffered"],
                "workers": s["workers"],
                "skipped": s["skipped"],
            }
    ranks = {}
    for rank, record in cur["ranks"].items():
        b = prev["ranks"].get(rank, record)
        batches, wait = record["batches"] - b["batches"], record["wait_s"] - b["wait_s"]
        if batches < 0:
            batches, wait = record["batches"], record["wait_s"]
        ranks[rank] = {
            "node": record.get("node", ""),
            "batches_per_s": round(batches / dt, 1),
            "stall_pct": round(100 * min(1.0, max(0.0, wait / dt)), 1),
            "step": record["step"],
            "behind": (cur["step"] - record["step"]) if cur["step"] is not None and record["step"] >= 0 else None,
            "done": record.get("done", False),
            "age_s": round(cur["time"] - record["time"], 1),
        }
    roles = {
        name: {
            "node": r["node"],
            "pid": r["pid"],
            "heartbeat_age_s": round(r["age_s"], 1),
            "loop_age_s": round(r["loop_age_s"], 1),
            "rss_mb": r["rss_mb"],
            "restarts": cur["restarts"].get(name, 0),
        }
        for name, r in cur["roles"].items()
    }
    lag = {dp: cur["step"] - written for dp, written in cur["progress"].items()} if cur["step"] is not None else {}
    return {
        "step": cur["step"],
        "done": cur["done"],
        "pressure": cur["pressure"],
        "node_pressure": cur["node_pressure"],
        "errors": cur["errors"],
        "constructor_lag": lag,
        "roles": roles,
        "streams": streams,
        "ranks": ranks,
        "interval_s": round(dt, 2),
    }


def render(job: str, v: dict[str, Any]) -> str:
    """The view as a terminal page."""
    head = f"overlord top  job {job}  step {v['step']}{' (all planned)' if v['done'] else ''}"
    if v["pressure"] is not None:
        head += f"  loader pressure {v['pressure']}"
    if v["node_pressure"]:
        head += "  nodes " + " ".join(f"{n}={p}" for n, p in sorted(v["node_pressure"].items()))
    if v["errors"]:
        head += f"  ERRORS {v['errors']} (overlord status)"
    lines = [head, ""]
    lines.append(f"{'ROLE':<16}{'NODE':<10}{'PID':>8}{'HEARTBEAT':>11}{'LOOP':>8}{'RSS MiB':>9}{'RESTARTS':>10}")
    for name, r in sorted(v["roles"].items()):
        rss = "" if r["rss_mb"] is None else f"{r['rss_mb']:.0f}"
        lines.append(
            f"{name:<16}{r['node']:<10}{r['pid']:>8}{r['heartbeat_age_s']:>10.1f}s{r['loop_age_s']:>7.1f}s"
            f"{rss:>9}{r['restarts']:>10}"
        )
    lines += [
        "",
        f"{'STREAM':<24}{'LOADER':<10}{'SAMPLES/S':>10}{'MS/SAMPLE':>11}{'BUFFERED':>10}{'WORKERS':>9}{'SKIPPED':>9}",
    ]
    for stream, s in sorted(v["streams"].items()):
        ms = "-" if s["transform_ms"] is None else f"{s['transform_ms']:.2f}"
        lines.append(
            f"{stream:<24}{s['loader']:<10}{s['samples_per_s']:>10.1f}{ms:>11}{s['buffered']:>10}"
            f"{s['workers']:>9}{s['skipped']:>9}"
        )
    lines += ["", f"{'RANK':<6}{'NODE':<10}{'BATCHES/S':>10}{'STALL %':>9}{'STEP':>8}{'BEHIND':>8}"]
    for rank, t in sorted(v["ranks"].items()):
        behind = "-" if t["behind"] is None else str(t["behind"])
        state = " done" if t["done"] else (f" (silent {t['age_s']:.0f}s)" if t["age_s"] > 5 else "")
        lines.append(
            f"{rank:<6}{t['node']:<10}{t['batches_per_s']:>10.1f}{t['stall_pct']:>9.1f}{t['step']:>8}{behind:>8}{state}"
        )
    if v["constructor_lag"]:
        lines += [
            "",
            "constructor lag (steps planned, not yet written): "
            + ", ".join(f"dp{dp}={n}" for dp, n in sorted(v["constructor_lag"].items())),
        ]
    return "\n".join(lines)


def run(job: Job, *, interval: float = 1.0, once: bool = False, as_json: bool = False, out=sys.stdout) -> int:
    """Draw the view every `interval` seconds until interrupted (or once)."""
    r, keys = connect(redis_url_of(job), timeout_s=5), Keys(job.name)
    prev = snapshot(r, keys)
    try:
        while True:
            time.sleep(interval)
            cur = snapshot(r, keys)
            v = view(prev, cur)
            if as_json:
                out.write(json.dumps(v) + "\n")
            else:
                out.write(("" if once else "\x1b[2J\x1b[H") + render(job.name, v) + "\n")
            out.flush()
            if once:
                return 0
            prev = cur
    except KeyboardInterrupt:
        return 0
