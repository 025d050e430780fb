"""Observability of a running job: the sidecar's Prometheus endpoint scraped over HTTP,
`overlord top`, and JSON logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from overlord import BatchSpec, Mesh

pytestmark = pytest.mark.timeout(180)

JOB = dict(seed=3, epochs=1, mesh=Mesh(dp=2),
           batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20))


def _samples(text: str) -> dict[str, float]:
    """Prometheus text format: 'name{labels}' -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(samples: dict[str, float], name: str, **labels) -> list[float]:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return [v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want)]


def test_metrics_endpoint_top_and_json_logs_describe_a_running_job(cluster, monkeypatch):
    from harness import free_port

    port = free_port()
    monkeypatch.setenv("OVERLORD_LOG_FORMAT", "json")
    c = cluster(**JOB, metrics_port=port)
    c.start_sidecar()
    c.start_trainers(sleep=0.04)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 60
    while True:  # until the running totals of loaders and trainers have been published
        try:
            samples = _samples(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            samples = {}
        batches = _metric(samples, "overlord_trainer_batches_total")
        # every rank has published (each does once a second), not just the sum of one
        if len(batches) == 2 and min(batches) >= 2 and _metric(samples, "overlord_source_samples_total", source="web"):
            break
        assert time.monotonic() < deadline, f"no figures at {url}: {sorted(samples)[:20]}\n{c.log()}"
        time.sleep(0.3)
    job = c.job.name
    assert _metric(samples, "overlord_up", job=job) == [1.0]
    assert _metric(samples, "overlord_planner_step")[0] >= 0
    assert sorted(_metric(samples, "overlord_source_samples_total", source="web", stream="web.0"))[0] > 0
    assert _metric(samples, "overlord_source_transform_seconds_total", stream="web.0")[0] > 0
    assert _metric(samples, "overlord_source_workers", stream="web.0") == [1.0]
    (held,) = _metric(samples, "overlord_source_buffered_bytes", stream="web.0")
    (buffered,) = _metric(samples, "overlord_source_buffered_samples", stream="web.0")
    assert (held > 0) == (buffered > 0), (held, buffered)  # bytes of the samples in the read buffer
    assert all(v > 0 for v in _metric(samples, "overlord_role_rss_bytes", role="constructor0"))
    assert _metric(samples, "overlord_role_heartbeat_age_seconds", role="planner0")[0] < 5
    assert len(_metric(samples, "overlord_constructor_lag_steps")) == 2
    assert _metric(samples, "overlord_trainer_wait_seconds_total", rank="0")[0] >= 0

    # `overlord top`: one view, rates between two snapshots
    top = subprocess.run([sys.executable, "-m", "overlord.cli", "top", "--config", str(c.config), "--json",
                          "--interval", "1"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    view = json.loads(top.stdout)
    assert {"planner0", "constructor0"} <= set(view["roles"]), view["roles"]
    assert any(s["source"] == "web" for s in view["streams"].values()), view["streams"]
    assert set(view["ranks"]) == {"0", "1"} and all(0 <= t["stall_pct"] <= 100 for t in view["ranks"].values())
    page = subprocess.run([sys.executable, "-m", "overlord.cli", "top", "--config", str(c.config), "--once",
                           "--interval", "0.5"], capture_output=True, text=True, timeout=60)
    assert page.returncode == 0 and "SAMPLES/S" in page.stdout and "STALL %" in page.stdout, page.stderr

    out = c.results()
    assert all(rec["end"] == "stop" for rec in out.values()), out
    assert c.stop() == 0, c.log()
    # every log line of the sidecar and its roles is one JSON object naming the job
    logs = [c.workdir / f"{job}-sidecar.log", *(p for p in c.job.run_path.glob("*.log") if "redis" not in p.name)]
    lines = [line for path in logs for line in path.read_text().splitlines() if line.strip()]
    assert not [line for line in lines if not line.startswith("{")], [l for l in lines if not l.startswith("{")][:5]
    records = [json.loads(line) for line in lines]
    assert {r["role"] for r in records} >= {"sidecar", "planner0", "loader0", "metrics"}, logs
    assert all(r["job"] == job and r["node"] == c.job.node for r in records if r["role"] != "sidecar"), records
    assert all({"time", "level", "logger", "pid", "message"} <= set(r) for r in records)
