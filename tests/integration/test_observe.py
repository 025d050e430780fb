"""Observability of a running job: the sidecar's Prometheus endpoint scraped over HTTP,
`overlord top`, and JSON logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from overlord import BatchSpec, Mesh
from overlord.metrics import metrics_host

pytestmark = pytest.mark.timeout(180)

JOB = dict(
    seed=3,
    epochs=1,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)


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


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
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
    assert _metric(samples, "overlord_constructor_copies_total") == [0, 0]  # 2 MiB rings hold what they keep
    assert _metric(samples, "overlord_trainer_wait_seconds_total", rank="0")[0] >= 0

    # `overlord top`: one view, rates between two snapshots
    top = subprocess.run(
        [sys.executable, "-m", "overlord.cli", "top", "--config", str(c.config), "--json", "--interval", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert top.returncode == 0, top.stderr
    view = json.loads(top.stdout)
    assert {"planner0", "constructor0"} <= set(view["roles"]), view["roles"]
    assert any(s["source"] == "web" for s in view["streams"].values()), view["streams"]
    assert set(view["ranks"]) == {"0", "1"} and all(0 <= t["stall_pct"] <= 100 for t in view["ranks"].values())
    page = subprocess.run(
        [sys.executable, "-m", "overlord.cli", "top", "--config", str(c.config), "--once", "--interval", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert page.returncode == 0 and "SAMPLES/S" in page.stdout and "STALL %" in page.stdout, page.stderr

    out = c.results()
    assert all(rec["end"] == "stop" for rec in out.values()), out
    assert c.stop() == 0, c.log()
    # every log line of the sidecar and its roles is one JSON object naming the job
    logs = [c.workdir / f"{job}-sidecar.log", *(p for p in c.job.run_path.glob("*.log") if "redis" not in p.name)]
    lines = [line for path in logs for line in path.read_text().splitlines() if line.strip()]
    assert not [line for line in lines if not line.startswith("{")], [
        line for line in lines if not line.startswith("{")
    ][:5]
    records = [json.loads(line) for line in lines]
    assert {r["role"] for r in records} >= {"sidecar", "planner0", "loader0", "metrics"}, logs
    assert all(r["job"] == job and r["node"] == c.job.node for r in records if r["role"] != "sidecar"), records
    assert all({"time", "level", "logger", "pid", "message"} <= set(r) for r in records)


def _listening(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at `port` (from /proc/net/tcp)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _wait_listening(port: int, c) -> set[str]:
    deadline = time.monotonic() + 30
    while not _listening(port):
        assert time.monotonic() < deadline, f"nothing listens on port {port}\n{c.log()}"
        time.sleep(0.1)
    return _listening(port)


def test_metrics_listen_on_loopback_by_default_and_require_the_bearer_token(cluster, monkeypatch):
    from harness import free_port

    port, token = free_port(), "metrics-t0ken"
    monkeypatch.setenv("OVERLORD_METRICS_TOKEN", token)  # the sidecar's environment, inherited by its server
    c = cluster(**JOB, metrics_port=port)
    c.start_sidecar()
    assert _wait_listening(port, c) == {"127.0.0.1"}  # loopback only, not 0.0.0.0
    url = f"http://127.0.0.1:{port}/metrics"
    for given in (None, "wrong", token + "x", ""):
        status, body = _get(url, given)
        assert status == 401 and "Authorization: Bearer" in body and "overlord_up" not in body, (given, status, body)
    status, body = _get(url, token)
    assert status == 200 and "overlord_up" in body, (status, body[:300])
    assert c.stop() == 0, c.log()


def test_metrics_listen_on_the_configured_address_and_are_open_without_a_token(cluster, monkeypatch):
    from harness import free_port

    port = free_port()
    monkeypatch.delenv("OVERLORD_METRICS_TOKEN", raising=False)
    c = cluster(**JOB, metrics_port=port, metrics_host="127.0.0.2")  # Linux routes all of 127/8 to lo
    c.start_sidecar()
    assert _wait_listening(port, c) == {"127.0.0.2"}
    status, body = _get(f"http://127.0.0.2:{port}/metrics")
    assert status == 200 and "overlord_up" in body, (status, body[:300])
    with pytest.raises(urllib.error.URLError):  # nothing on 127.0.0.1
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert c.stop() == 0, c.log()


def test_metrics_host_is_loopback_on_one_node_and_every_interface_on_several(corpus, tmp_path):
    from harness import make_job

    one = make_job(corpus, tmp_path / "one")
    several = make_job(corpus, tmp_path / "two", nodes=("n0", "n1"), redis_url="redis://127.0.0.1:1/0", flight_port=1)
    assert metrics_host(one) == "127.0.0.1"
    assert metrics_host(several) == "0.0.0.0"
    assert (
        metrics_host(
            make_job(
                corpus,
                tmp_path / "three",
                nodes=("n0", "n1"),
                redis_url="redis://127.0.0.1:1/0",
                flight_port=1,
                metrics_host="10.0.0.5",
            )
        )
        == "10.0.0.5"
    )
