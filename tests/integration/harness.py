"""The integration-test harness: a job over the test corpus, and a Cluster of real
processes (one sidecar, its trainer ranks) to run it. conftest.py builds fixtures on it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM
from overlord.errors import StoreError
from overlord.sidecar.sidecar import sidecar_running
from overlord.status import redis_url_of
from overlord.store import Keys, connect

HERE = Path(__file__).parent
TRAINER = HERE / "ledger_trainer.py"


def make_job(corpus, run_dir: Path, **overrides) -> Job:
    weights = {"web": 0.4, "code": 0.3, "books": 0.2, "images": 0.1}
    sources = tuple(
        Source(
            name=name,
            paths=tuple(files),
            weight=weights.get(name, 0.1),
            shuffle_window=48,
            transform=IMAGE_TRANSFORM if name.startswith("images") else TEXT_TRANSFORM,
        )
        for name, files in corpus.items()
    )
    args = dict(
        name=f"t{uuid.uuid4().hex[:8]}",
        sources=sources,
        mesh=Mesh(dp=4),
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=4 << 20),
        seed=11,
        run_dir=str(run_dir),
        timeout_s=20.0,
        sample_ring_bytes=2 << 20,
        buffer_samples=128,
    )
    args.update(overrides)
    return Job(**args)


def partitioned_job(corpus, run_dir: Path, *, seed: int, epochs: int, partitions: int = 2) -> Job:
    """A 2-DP-group job of two loader processes whose every source has `partitions`
    partitions (a source read by both processes at once), for live handoffs and reshards."""
    job = make_job(
        corpus,
        run_dir,
        seed=seed,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
        epochs=epochs,
        loader_processes=2,
        buffer_samples=None,
    )
    return dataclasses.replace(job, sources=tuple(dataclasses.replace(s, partitions=partitions) for s in job.sources))


def wait_planning(r, keys, timeout_s: float = 60) -> None:
    """Wait for the job's first plan: a sidecar starting afresh clears the job's keys first."""
    deadline = time.monotonic() + timeout_s
    while r.get(keys.plan(0)) is None:
        assert time.monotonic() < deadline, f"no plan in {timeout_s:g} s"
        time.sleep(0.05)


def kill_after_step(c, step: int, role: str, index: int) -> None:
    """SIGKILL `role` `index` of cluster `c` once every Data Constructor built `step`."""
    r, keys = c.redis(), Keys(c.job.name)
    deadline = time.monotonic() + 60
    while any(int(r.hget(keys.progress, f"c{dp}") or -1) < step for dp in range(c.job.mesh.dp)):
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.02)
    raw = r.get(keys.heartbeat(role, str(index)))
    assert raw is not None, f"no heartbeat of {role}{index}"
    os.kill(json.loads(raw)["pid"], signal.SIGKILL)


def assert_delivered(results: dict, corpus_keys: set[str], times: int = 1, log=lambda: "") -> None:
    """Every corpus key reached the trainers exactly `times` times (one per epoch)."""
    seen = Counter(k for rec in results.values() for batch in rec["keys"] for k in batch)
    lost = corpus_keys - set(seen)
    wrong = [k for k, n in seen.items() if n != times or k not in corpus_keys]
    assert not lost and not wrong, f"{len(lost)} sample(s) lost; delivered other than {times}x: {wrong[:5]}\n{log()}"


def clean_run(job: Job, tmp: Path) -> dict[int, dict]:
    """Every rank's ledger of `job` run to its end with no fault (a reference to compare with)."""
    (tmp / "work").mkdir()
    c = Cluster(job, tmp / "work")
    try:
        c.start_sidecar()
        c.start_trainers()
        out = c.results()
        assert c.stop() == 0
    finally:
        c.kill_all()
    assert all(r["end"] == "stop" for r in out.values()), out
    return out


class Cluster:
    """One sidecar and its trainer ranks, all real processes."""

    def __init__(self, job: Job, workdir: Path) -> None:
        self.job, self.workdir = job, workdir
        self.config = workdir / f"{job.name}.json"
        self.config.write_text(job.to_json())
        self.sidecar: subprocess.Popen | None = None
        self.trainers: dict[int, subprocess.Popen] = {}

    def start_sidecar(self, resume: bool = False, wait: bool = True) -> subprocess.Popen:
        """Start the sidecar; with `wait`, return once it runs the job."""
        self.sidecar = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "overlord.cli",
                "sidecar",
                "--config",
                str(self.config),
                *(["--resume"] if resume else []),
            ],
            stdout=open(self.workdir / f"{self.job.name}-sidecar.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while wait and not sidecar_running(self.job):
            assert self.sidecar.poll() is None, self.log()
            assert time.monotonic() < deadline, "sidecar did not start"
            time.sleep(0.05)
        return self.sidecar

    def start_trainers(self, ranks=None, **args) -> None:
        world = self.job.mesh.world_size
        for rank in ranks if ranks is not None else range(world):
            extra = [str(x) for kv in args.items() for x in (f"--{kv[0]}", kv[1])]
            self.trainers[rank] = subprocess.Popen(
                [sys.executable, str(TRAINER), str(self.config), str(self.out(rank)), *extra],
                env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world)),
            )

    def out(self, rank: int) -> Path:
        return self.workdir / f"{self.job.name}-rank{rank}.json"

    def results(self, timeout: float = 120) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        for _rank, proc in self.trainers.items():
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        return {rank: json.loads(self.out(rank).read_text()) for rank in self.trainers}

    def stop(self, timeout: float = 30) -> int | None:
        if self.sidecar is None:
            return None
        if self.sidecar.poll() is None:
            self.sidecar.send_signal(signal.SIGTERM)
        return self.sidecar.wait(timeout=timeout)

    def redis(self, timeout: float = 60):
        """A client of the job's Redis, once it answers: the embedded server starts with the
        sidecar, which a loaded machine may take seconds to reach."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return connect(redis_url_of(self.job))
            except StoreError:
                assert time.monotonic() < deadline, f"the job's Redis did not answer in {timeout:g}s\n{self.log()}"
                time.sleep(0.1)

    def log(self) -> str:
        text = (
            (self.workdir / f"{self.job.name}-sidecar.log").read_text()
            if (self.workdir / f"{self.job.name}-sidecar.log").exists()
            else ""
        )
        for role in sorted(self.job.run_path.glob("*.log")):
            text += f"\n== {role.name}\n" + role.read_text()[-3000:]
        return text

    def kill_all(self) -> None:
        for proc in [*self.trainers.values(), self.sidecar]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
