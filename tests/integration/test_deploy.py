"""The deployment units: the systemd unit verifies, and the container entrypoint's
start-up checks refuse a host that cannot run the job with what to change."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import make_job

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "tools" / "overlord-sidecar.service").read_text()
    assert "Restart=on-failure" in unit and "EnvironmentFile=" in unit and "MemoryMax=" in unit
    # as installed: the overlord command of this environment, a user that exists here
    unit = unit.replace("/opt/overlord/venv/bin/overlord", str(BIN / "overlord"))
    unit = unit.replace("User=overlord", "User=root").replace("Group=overlord", "Group=root")
    path = tmp_path / "overlord-sidecar.service"
    path.write_text(unit)
    run = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (run.stdout + run.stderr).splitlines() if "overlord-sidecar.service" in line]
    assert run.returncode == 0 and not complaints, run.stdout + run.stderr


def _entrypoint(config: Path | None, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OVERLORD_")}
    environ.update(PATH=f"{BIN}:{environ['PATH']}", OVERLORD_METRICS_PORT="0", **env)
    if config is not None:
        environ["OVERLORD_CONFIG"] = str(config)
    return subprocess.run(
        ["sh", str(ROOT / "tools" / "docker-entrypoint.sh")], capture_output=True, text=True, timeout=90, env=environ
    )


def _config(tmp_path: Path, job) -> Path:
    path = tmp_path / "job.json"
    path.write_text(job.to_json())
    return path


def test_entrypoint_refuses_a_missing_config(tmp_path):
    run = _entrypoint(tmp_path / "nope.yaml")
    assert run.returncode == 2 and "cannot read the job config" in run.stderr and "nope.yaml" in run.stderr


def test_entrypoint_refuses_a_dev_shm_too_small_for_the_rings(corpus, tmp_path):
    st = os.statvfs("/dev/shm")
    total = st.f_blocks * st.f_frsize
    job = make_job(corpus, tmp_path / "run", sample_ring_bytes=1 << total.bit_length())  # one ring > /dev/shm
    run = _entrypoint(_config(tmp_path, job))
    assert run.returncode == 2, run.stderr
    for words in ("StartupError", "rings may hold", "/dev/shm is only", "--shm-size=", "sample_ring_bytes"):
        assert words in run.stderr, (words, run.stderr)
    from overlord.shm import list_segments

    assert not list_segments(job.name), "a refused start leaves no segment"


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_entrypoint_refuses_an_unreachable_redis_and_missing_sources(corpus, tmp_path):
    from harness import free_port

    job = make_job(corpus, tmp_path / "run", redis_url=f"redis://overlord:s3cret@127.0.0.1:{free_port()}/0")
    run = _entrypoint(_config(tmp_path, job))
    assert run.returncode == 2 and "StartupError" in run.stderr and "unreachable" in run.stderr, run.stderr
    assert "s3cret" not in run.stderr and "Job.redis_url" in run.stderr
    from dataclasses import replace

    gone = replace(
        job, redis_url=None, sources=(replace(job.sources[0], paths=(str(tmp_path / "none" / "*.parquet"),)),)
    )
    run = _entrypoint(_config(tmp_path, gone))
    assert run.returncode == 2 and "source 'web'" in run.stderr and "matches no file" in run.stderr, run.stderr
    # `overlord check` says the same, check by check
    check = subprocess.run(
        [str(BIN / "overlord"), "check", "--config", str(_config(tmp_path, gone))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 1 and "ok   shared memory" in check.stdout and "FAIL sources" in check.stdout, (
        check.stdout
    )


def test_shm_check_counts_what_a_node_may_hold():
    from overlord import BatchSpec, Job, Mesh, Source
    from overlord.sidecar.checks import MIB, ring_bytes, shm_problem

    src = (Source(name="web", paths=("x",)),)
    one = Job(
        name="j",
        sources=src,
        mesh=Mesh(dp=4),
        sample_ring_bytes=8 * MIB,
        batch=BatchSpec(global_batch=8, ring_bytes=16 * MIB),
    )
    assert ring_bytes(one, loaders=2) == 2 * 4 * 8 * MIB + 4 * 16 * MIB
    many = Job(
        name="j",
        sources=src,
        mesh=Mesh(dp=4),
        sample_ring_bytes=8 * MIB,
        nodes=("a", "b"),
        node="b",
        redis_url="redis://h/0",
        flight_port=1,
        batch=BatchSpec(global_batch=8, ring_bytes=16 * MIB),
    )
    assert ring_bytes(many, loaders=4) == 2 * 4 * 8 * MIB + 2 * 16 * MIB  # its 2 loaders, its 2 ranks
    error, warning = shm_problem(128 * MIB, 64 * MIB, 60 * MIB)
    assert "--shm-size=160m" in error and "only 64m" in error and warning is None
    error, warning = shm_problem(128 * MIB, 1 << 30, 100 * MIB)
    assert error is None and "100m free" in warning and "SIGBUS" in warning
    assert shm_problem(128 * MIB, 1 << 30, 1 << 30) == (None, None)
