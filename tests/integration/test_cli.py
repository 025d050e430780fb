"""The `overlord` command line against a running job."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from overlord import BatchSpec, Mesh
from overlord.store import EmbeddedRedis

pytestmark = pytest.mark.timeout(180)


def overlord(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "overlord.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_status_reads_a_running_job_and_external_redis_url_is_used(cluster, tmp_path):
    server = EmbeddedRedis(tmp_path / "external").start()  # plays an operator-run Redis
    try:
        c = cluster(
            mesh=Mesh(dp=2),
            batch=BatchSpec(global_batch=8, context_length=256, ring_bytes=1 << 20),
            redis_url=server.url,
        )
        c.start_sidecar()
        c.start_trainers(batches=6, timeout=30)
        assert all(r["end"] == "limit" for r in c.results().values())
        time.sleep(1.5)  # let heartbeats land
        out = overlord("status", "--config", str(c.config), "--json")
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["job"] == c.job.name and status["step"] >= 2
        assert {"planner:0", "loader:0", "constructor:0"} <= set(status["roles"])
        assert all(0 <= role["loop_age_s"] < 30 for role in status["roles"].values())
        assert status["checkpoints"]["oldest_step"] == 0 and status["checkpoints"]["newest_step"] >= 3
        assert set(status["cursors"]) == {"web.0", "code.0", "books.0", "images.0"}
        assert status["leader"]["token"] >= 1 and status["generation"] > status["leader"]["token"]
        assert set(status["active_loaders"]) == {"0"} and status["checkpoints"]["deltas"] >= 3
        assert "sidecar:node0" in status["roles"] and status["nodes"]["node0"]["cpus"] > 0
        assert not (c.job.run_path / "redis.sock").exists(), "no embedded server with a configured URL"
        text = overlord("status", "--config", str(c.config))
        assert "planned step" in text.stdout and "web.0" in text.stdout and "planner checkpoints" in text.stdout
        assert "planner lease: token" in text.stdout and "node node0: sidecar pid" in text.stdout
        c.stop()
    finally:
        server.stop()


def test_sidecar_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: j\nsources:\n  - {name: web, paths: [x], weight: -1}\n")
    out = overlord("sidecar", "--config", str(bad))
    assert out.returncode == 2 and "Source.weight=-1" in out.stderr


@pytest.mark.slow  # make test-slow: ~20 s
def test_dataloader_spawns_a_sidecar_when_none_runs(cluster):
    from overlord.torch import DataLoader

    c = cluster(mesh=Mesh(dp=1), batch=BatchSpec(global_batch=4, context_length=128, ring_bytes=1 << 20), epochs=1)
    loader = DataLoader(c.config, rank=0, world_size=1, timeout_s=30)
    keys = []
    for batch in loader:
        assert batch["input_ids"].shape[1] == 128
        keys += loader.last_meta["keys"]
    assert len(keys) == len(set(keys)) == 4 * 240
    # the spawned sidecar exits once its only trainer is done, and cleans up after itself
    deadline = time.monotonic() + 30
    from overlord.shm import list_segments
    from overlord.sidecar.sidecar import sidecar_running

    while (sidecar_running(c.job) or list_segments(c.job.name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sidecar_running(c.job) and not list_segments(c.job.name)


def test_demo_runs_end_to_end(tmp_path):
    out = overlord(
        "demo", "--out", str(tmp_path / "demo"), "--ranks", "2", "--steps", "10", "--no-progress", timeout=170
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for words in (
        "delivered",
        "samples/s",
        "tokens/s",
        "requested  achieved",
        "PSS",
        "first batch",
        "no shared-memory segment left",
    ):
        assert words in out.stdout, (words, out.stdout)


def test_copy_true_batches_outlive_the_next_read(cluster):
    import hashlib

    from overlord.torch import DataLoader

    c = cluster(mesh=Mesh(dp=1), batch=BatchSpec(global_batch=4, context_length=128, ring_bytes=1 << 20), epochs=1)
    c.start_sidecar()
    kept, digests = [], []
    loader = DataLoader(c.config, rank=0, world_size=1, timeout_s=30, copy=True)
    for batch in loader:
        kept.append(batch)
        digests.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest())
    assert len(kept) > 100
    assert [hashlib.sha256(b["input_ids"].numpy().tobytes()).hexdigest() for b in kept] == digests
    assert c.stop() == 0


def test_plan_dry_run_prices_the_strategy_against_vanilla(cluster):
    c = cluster(mesh=Mesh(dp=4), batch=BatchSpec(global_batch=64, micro_batches=2, context_length=2048))
    out = overlord("plan", "--dry-run", "--config", str(c.config), "--steps", "8", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["steps"] == 8 and result["strategy"].endswith(":balanced")
    assert result["imbalance"] < result["vanilla_imbalance"] and result["speedup_vs_vanilla"] > 1.0
    text = overlord("plan", "--dry-run", "--config", str(c.config), "--steps", "4")
    assert "predicted step-time speedup" in text.stdout and "dp 3" in text.stdout
    assert not c.job.run_path.exists(), "a dry run starts nothing"


def test_partition_profiles_the_sources_and_prints_a_layout_within_budget(cluster):
    c = cluster(autoscale={"cpus": 8, "memory_mb": 4000, "profile_samples": 8})
    out = overlord("partition", "--config", str(c.config), "--samples", "8", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {s["name"] for s in result["sources"]} == {"web", "code", "books", "images"}
    assert all(cost["transform_ms"] > 0 for cost in result["costs"])
    assert sum(s["workers"] for s in result["sources"]) <= 8
    hosted = sorted(tuple(x) for loader in result["loaders"] for x in loader)
    assert hosted == sorted((s["name"], p) for s in result["sources"] for p in range(s["partitions"]))
    text = overlord("partition", "--config", str(c.config), "--samples", "8")
    assert "profiled now" in text.stdout and "loader 0:" in text.stdout


def test_every_subcommand_has_help_and_top_without_a_job_says_so(tmp_path):
    commands = ("sidecar", "check", "status", "top", "plan", "partition", "demo")
    out = overlord("--help")
    assert out.returncode == 0 and all(c in out.stdout for c in commands), out.stdout
    for command in commands:
        sub = overlord(command, "--help")
        assert sub.returncode == 0 and "--" in sub.stdout, (command, sub.stderr)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: idle\nrun_dir: {tmp_path / 'run'}\nsources:\n  - {{name: web, paths: [x]}}\n")
    top = overlord("top", "--config", str(job), "--once")
    assert top.returncode == 2 and "unreachable" in top.stderr and "redis" in top.stderr.lower(), top.stderr


def test_a_sidecar_asked_to_stop_while_it_exits_still_exits_0():
    # A job that ended on its own and a supervisor's SIGTERM can cross: the sidecar has
    # cleaned up and is exiting when the signal lands. CPython puts SIGTERM's default
    # action back while it finalizes, so the sidecar used to die with -15 there (seen
    # twice in CI). Here SIGTERMs keep coming every millisecond until it is gone.
    code = """
import os, subprocess, sys, threading, time
from overlord.sidecar.sidecar import Sidecar

sidecar = Sidecar.__new__(Sidecar)  # run()'s own code; the job's start, watch and clean-up done
sidecar.stop = threading.Event()
sidecar.start, sidecar.watch, sidecar.shutdown = (lambda: None), (lambda: 0), (lambda: None)
status = sidecar.run()
subprocess.Popen(["sh", "-c", f"while kill -TERM {os.getpid()}; do sleep 0.001; done"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not our pipes: it ends when we are reaped
time.sleep(0.3)
sys.exit(status)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
