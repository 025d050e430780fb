"""A job whose nodes are hosts (hosts.py): its Redis on a host of its own reached over
TCP, one sidecar per node host (Flight on the node's own address), and each trainer
rank on the host torchrun would put it on. The same surface as harness.Cluster/Nodes
(start_sidecar, start_trainers, results, log, stop, kill_all), plus the host faults."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from harness import TRAINER
from hosts import Fabric, Host, HostProcess

from overlord.config import Job
from overlord.sidecar.sidecar import sidecar_running
from overlord.store import connect
from overlord.store.server import redis_server_binary

REDIS_PORT = 6379
FLIGHT_PORT = 47470  # the same on every host: each has its own network namespace


class HostedJob:
    """`job` (several nodes) run on `fabric`: a host per node and one for Redis."""

    def __init__(self, fabric: Fabric, job: Job, workdir: Path) -> None:
        self.fabric, self.workdir = fabric, workdir
        self.redis_host = fabric.host("redis")
        (workdir / "redis").mkdir(mode=0o700)
        self.redis = self._start_redis()
        url = f"redis://{self.redis_host.address}:{REDIS_PORT}/0"
        self.job = dataclasses.replace(job, redis_url=url, flight_port=FLIGHT_PORT)
        self.config = workdir / f"{job.name}.json"
        self.config.write_text(self.job.to_json())
        self.hosts: dict[str, Host] = {node: fabric.host(node) for node in self.job.node_ids}
        self.sidecars: dict[str, HostProcess] = {}
        self.trainers: dict[int, HostProcess] = {}

    def _start_redis(self) -> HostProcess:
        proc = self.redis_host.run(
            [
                redis_server_binary(),
                "--port",
                str(REDIS_PORT),
                "--bind",
                self.redis_host.address,
                "--protected-mode",
                "no",
                "--dir",
                str(self.workdir / "redis"),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            log=self.workdir / "redis.log",
            name="redis-server",
        )
        url = f"redis://{self.redis_host.address}:{REDIS_PORT}/0"
        deadline = time.monotonic() + 20
        while True:
            try:
                connect(url, timeout_s=1, ride_through_s=0).close()
                return proc
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {url} did not start: {self.log()}") from None
                time.sleep(0.05)

    def env(self, node: str) -> dict[str, str]:
        return dict(os.environ, OVERLORD_FLIGHT_HOST=self.hosts[node].address)

    def start_sidecar(self, node: str, *args: str) -> HostProcess:
        argv = [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(self.config), "--node", node, *args]
        self.sidecars[node] = proc = self.hosts[node].run(
            argv, env=self.env(node), log=self.workdir / f"sidecar-{node}.log", name=f"sidecar of {node}"
        )
        deadline = time.monotonic() + 30
        while not sidecar_running(self.job.on_node(node)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the sidecar of {node} did not start\n{self.log()}")
            time.sleep(0.05)
        return proc

    def start_trainers(self, ranks=None, **args) -> None:
        world = self.job.mesh.world_size
        for rank in ranks if ranks is not None else range(world):
            node = self.job.node_of_rank(rank)
            extra = [str(x) for kv in args.items() for x in (f"--{kv[0]}", kv[1])]
            self.trainers[rank] = self.hosts[node].run(
                [sys.executable, str(TRAINER), str(self.config), str(self.out(rank)), *extra],
                env=dict(self.env(node), RANK=str(rank), WORLD_SIZE=str(world)),
                log=self.workdir / f"trainer-{rank}.log",
                name=f"trainer rank {rank} on {node}",
            )

    def out(self, rank: int) -> Path:
        return self.workdir / f"{self.job.name}-rank{rank}.json"

    def results(self, timeout: float = 120) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        for proc in self.trainers.values():
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        return {rank: json.loads(self.out(rank).read_text()) for rank in self.trainers}

    def stop(self, timeout: float = 30) -> dict[str, int]:
        for proc in self.sidecars.values():
            proc.send_signal(signal.SIGTERM)
        return {n: proc.wait(timeout=timeout) for n, proc in self.sidecars.items()}

    def log(self) -> str:
        text = ""
        for path in sorted(self.workdir.glob("*.log")):
            text += f"\n== {path.name}\n" + path.read_text(errors="replace")[-4000:]
        for node in self.job.node_ids:
            for role in sorted(self.job.on_node(node).run_path.glob("*.log")):
                text += f"\n== {node}/{role.name}\n" + role.read_text(errors="replace")[-2500:]
        return text

    def kill_all(self) -> None:
        for proc in [*self.trainers.values(), *self.sidecars.values()]:
            proc.kill()
