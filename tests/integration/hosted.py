"""A job whose nodes are hosts (hosts.py): its Redis on a host of its own reached over
TCP, one sidecar per node host (Flight on the node's own address), and each trainer
rank on the host torchrun would put it on. The surface of harness.Cluster, one sidecar per
node (start_sidecar, start_trainers, results, log, stop, kill_all), plus the host faults.

For tests and benches (bench/nodes.py) alike: `kill_roles` (a node's sidecar and roles
die, its trainers live), `cut_for` (a node's link down for a while), `segments` (what a
host's /dev/shm holds of the job) and `stall` (the trainers' longest wait between two
batches against the median, from the times ledger_trainer.py records); and the steps
of a node_loss: `lose_node` (the node vanishes with its trainers), `stop_trainers` (as
torchrun stops the others), `save_states`, `restart_node` (its host boots, its sidecar
starts again) and `reconfigure` (another mesh for a resume). A run with no fault is
`start` then `finish` (every rank to its end, every sidecar out cleanly, no segment left)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis
from harness import TRAINER, make_job
from hosts import Fabric, Host, HostProcess

from overlord.config import Job
from overlord.sidecar.sidecar import sidecar_running
from overlord.store import Keys, connect
from overlord.store.server import redis_server_binary

REDIS_PORT = 6379
SENTINEL_PORT = 26379
SERVICE = "overlord"  # the Sentinels' name for the job's Redis
FLIGHT_PORT = 28815  # the same on every host (each has its own network namespace); below the
# kernel's ephemeral range (32768-60999), so no outgoing connection on a host can take it first


class HostedJob:
    """`job` (several nodes) run on `fabric`: a host per node and one for Redis, or with
    `sentinel`, a Redis that survives its primary (see SentinelHosts)."""

    def __init__(self, fabric: Fabric, job: Job, workdir: Path, *, sentinel: bool = False) -> None:
        self.fabric, self.workdir = fabric, workdir
        self.sentinels: SentinelHosts | None = None
        if sentinel:
            self.sentinels = SentinelHosts(fabric, workdir).start()
            self.redis_host = self.sentinels.hosts["a"]
            self.redis = self.sentinels.procs["primary"]
            url = self.sentinels.url
        else:
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

    def start(self, sidecar_args: Mapping[str, Sequence[str]] | None = None, **trainer_args) -> None:
        """Every node's sidecar, in the order of `sidecar_args` (node -> its extra command
        line; default: every node, none), then every trainer rank with `trainer_args`."""
        for node, args in (sidecar_args or {n: () for n in self.job.node_ids}).items():
            self.start_sidecar(node, *args)
        self.start_trainers(**trainer_args)

    def finish(self, timeout: float = 180) -> dict[int, dict]:
        """Every rank's record of a run that must end cleanly: each rank read to the end
        ("stop"), each sidecar exits 0 on SIGTERM, and no host's /dev/shm keeps a segment
        of the job. A clean (reference) run is `start(...)` then `finish()`."""
        out = self.results(timeout=timeout)
        ends = {rank: rec["end"] for rank, rec in out.items()}
        assert all(end == "stop" for end in ends.values()), f"{ends}\n{self.log()}"
        assert self.stop() == {n: 0 for n in self.sidecars}, self.log()
        left = {n: self.segments(n) for n in self.hosts}
        assert not any(left.values()), f"segments left on a host: {left}"
        return out

    def reconfigure(self, **changes) -> Job:
        """Change the job's config (e.g. its mesh, for a resume on another DP size); the
        sidecars and trainers started from now on read the new one."""
        self.job = dataclasses.replace(self.job, **changes)
        self.config.write_text(self.job.to_json())
        return self.job

    def ranks_on(self, node: str) -> list[int]:
        """The trainer ranks that run on `node` (as torchrun places them)."""
        return [rank for rank in self.trainers if self.job.node_of_rank(rank) == node]

    def lose_node(self, node: str, timeout: float = 30) -> None:
        """node_loss: `node` vanishes with its sidecar, roles and trainers (its host's
        init is killed); returns once they are gone. Its /dev/shm stays."""
        self.hosts[node].kill()
        gone = [self.sidecars.get(node), *(self.trainers[rank] for rank in self.ranks_on(node))]
        for proc in gone:
            if proc is not None:
                proc.wait(timeout=timeout)

    def stop_trainers(self, timeout: float = 30) -> dict[int, dict]:
        """What torchrun does when a worker is lost: every other trainer is killed (they
        are started again, loading their last saved state). Returns every rank's last
        record (with --save-every: what it had up to its last checkpoint, and the state)."""
        for proc in self.trainers.values():
            proc.kill()
        for proc in self.trainers.values():
            proc.wait(timeout=timeout)
        records = {rank: json.loads(self.out(rank).read_text()) for rank in self.trainers}
        self.trainers.clear()
        return records

    def save_states(self, records: dict[int, dict]) -> dict[int, Path]:
        """Each rank's saved loader state (from `stop_trainers`) in a file of its own,
        for `start_trainers(..., **{"load-state": ...})`."""
        paths = {}
        for rank, record in records.items():
            paths[rank] = self.workdir / f"state-{rank}.json"
            paths[rank].write_text(json.dumps(record["state"]))
        return paths

    def restart_node(self, node: str, *args: str) -> HostProcess:
        """The lost `node` back: its host boots again and its sidecar starts with `args`
        (as systemd would: Restart=always, the same command line)."""
        self.hosts[node].boot()
        return self.start_sidecar(node, *args)

    def out(self, rank: int) -> Path:
        return self.workdir / f"{self.job.name}-rank{rank}.json"

    def results(self, timeout: float = 120) -> dict[int, dict]:
        """Every rank's record once all trainers have ended; past `timeout`, an
        AssertionError that says where the job waits (see `where`)."""
        deadline = time.monotonic() + timeout
        for rank, proc in self.trainers.items():
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"trainer rank {rank} still runs after {timeout:.0f} s\n{self.where()}") from None
        return {rank: json.loads(self.out(rank).read_text()) for rank in self.trainers}

    def where(self) -> str:
        """Where a job that does not end waits: its progress in Redis, the stacks of every
        Python process on its hosts (py-spy, where installed) and the logs."""
        text = ""
        try:
            r = connect(self.job.redis_url, ride_through_s=0)
            progress = {k.decode(): v.decode() for k, v in r.hgetall(f"{Keys(self.job.name).progress}").items()}
            text += f"== progress\n{json.dumps(progress, sort_keys=True)}\n"
        except redis.RedisError as e:
            text += f"== progress unreadable: {e}\n"
        text += self._processes()
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if Path(spy).exists():
            for node, host in self.hosts.items():
                for pid in host.pids()[1:]:
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[-160:]
                    except OSError:
                        continue
                    if "python" not in cmd:
                        continue
                    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
                    text += f"== py-spy {node} pid {pid}: {cmd}\n{dump.stdout[-3000:]}{dump.stderr[-300:]}\n"
        return text + self.log()

    def _processes(self) -> str:
        """Each host's processes (pid in the host, name, state), and every role's thread
        stacks written to its log (SIGUSR1: overlord.sidecar.role)."""
        text = ""
        for node, host in self.hosts.items():
            rows = []
            for machine, inner, name, state in host.processes():
                rows.append(f"{inner:>6} {name:<16} {state}")
                if name.startswith("ovl-"):
                    try:
                        os.kill(machine, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
            text += f"== processes on {node}\n" + "\n".join(rows) + "\n"
        time.sleep(0.5)  # for the stacks to reach the logs
        return text

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
                text += f"\n== {node}/{role.name}\n" + role.read_text(errors="replace")[-4000:]
        if self.sentinels is not None:
            text += "\n" + self.sentinels.logs()
        return text

    def kill_roles(self, node: str) -> float:
        """SIGKILL `node`'s sidecar and every role process on its host at once; its
        trainers live on. Returns when it was done (time.time(), the trainers' clock)."""
        trainers = {p.pid for p in self.trainers.values()}
        at = time.time()
        for pid in self.hosts[node].pids()[1:]:  # all but the host's init
            if pid not in trainers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.sidecars[node].wait(timeout=10)
        return at

    def cut_for(self, node: str, seconds: float) -> tuple[float, float]:
        """`node`'s link down for `seconds`, then up again; (when it went down, when it
        came back), on the trainers' clock (time.time())."""
        self.hosts[node].cut()
        down = time.time()
        time.sleep(seconds)
        self.hosts[node].mend()
        return down, time.time()

    def segments(self, node: str) -> list[str]:
        """The job's shared-memory segments in `node`'s own /dev/shm."""
        return sorted(p.name for p in self.hosts[node].shm.iterdir() if self.job.name in p.name)

    def kill_all(self) -> None:
        for proc in [*self.trainers.values(), *self.sidecars.values()]:
            proc.kill()


def stall(records: dict[int, dict], since: float = 0.0, until: float = float("inf")) -> dict:
    """The trainers' stall: the longest wait between two batches of a rank that ended
    within [since, until] (time.time(), as ledger_trainer.py records them), against the
    median wait between two batches over the whole run, every rank.

    Returns:
        {"median_gap_s", "longest_gap_s", "ratio" (longest / median), "rank" (whose
        wait was longest), "at" (when it ended), "by_rank" (each rank's longest wait)}.
    """
    gaps = [(b - a, rank, b) for rank, rec in records.items() for a, b in zip(rec["times"], rec["times"][1:])]
    if not gaps:
        raise ValueError("no rank received two batches: nothing to measure")
    median = statistics.median(g for g, _, _ in gaps)
    inside = [g for g in gaps if since <= g[2] <= until] or [(0.0, -1, since)]
    longest, rank, at = max(inside)
    by_rank = {r: round(max((g for g, gr, _ in inside if gr == r), default=0.0), 4) for r in sorted(records)}
    return {
        "median_gap_s": round(median, 4),
        "longest_gap_s": round(longest, 4),
        "ratio": round(longest / median, 2) if median > 0 else float("inf"),
        "rank": rank,
        "at": at,
        "by_rank": by_rank,
    }


def resumed(records: dict[int, dict], at: float) -> dict[int, float]:
    """Per rank: how long after `at` (time.time(): a link mended) its next batch came."""
    return {
        rank: round(min((t for t in rec["times"] if t >= at), default=float("inf")) - at, 4)
        for rank, rec in records.items()
    }


class SentinelHosts:
    """A Redis that survives its primary, each server on a host of its own: the primary
    on host `redis-a`, its replica on `redis-b` (append-only files, fsync every second,
    as in production), and three Sentinels (the same server binary in sentinel mode) on
    `redis-a`, `redis-b` and `redis-c` (quorum 2, a primary down after 3 s). Killing the
    primary's host takes one Sentinel with it; the other two promote the replica."""

    def __init__(self, fabric: Fabric, workdir: Path) -> None:
        self.fabric, self.root = fabric, workdir / "redis"
        self.hosts = {h: fabric.host(f"redis-{h}") for h in "abc"}
        self.procs: dict[str, HostProcess] = {}

    @property
    def url(self) -> str:
        where = ",".join(f"{host.address}:{SENTINEL_PORT}" for host in self.hosts.values())
        return f"redis+sentinel://{where}/{SERVICE}/0"

    def _run(self, host: str, name: str, args: list[str]) -> None:
        d = self.root / name
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.procs[name] = self.hosts[host].run(
            [redis_server_binary(), *args], log=d / "server.log", name=f"{name} on redis-{host}"
        )

    def start(self, timeout: float = 40) -> SentinelHosts:
        a, b = self.hosts["a"].address, self.hosts["b"].address
        for host, name, extra in (("a", "primary", []), ("b", "replica", ["--replicaof", a, str(REDIS_PORT)])):
            d = self.root / name
            self._run(
                host,
                name,
                [
                    "--port", str(REDIS_PORT), "--bind", self.hosts[host].address, "--protected-mode", "no",
                    "--dir", str(d), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                    "--repl-diskless-sync-delay", "0", *extra,
                ],
            )  # fmt: skip
        for host in "abc":
            d = self.root / f"sentinel-{host}"
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {SENTINEL_PORT}\nbind {self.hosts[host].address}\nprotected-mode no\ndir {d}\n"
                f"sentinel monitor {SERVICE} {a} {REDIS_PORT} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 3000\n"
                f"sentinel failover-timeout {SERVICE} 20000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self._run(host, f"sentinel-{host}", [str(conf), "--sentinel"])
        deadline = time.monotonic() + timeout
        while not self._ready(b):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinel group did not come up: {self.logs()}")
            time.sleep(0.1)
        return self

    def _ready(self, replica: str) -> bool:
        try:
            if (
                redis.Redis(host=replica, port=REDIS_PORT, socket_timeout=1)
                .info("replication")
                .get("master_link_status")
                != "up"
            ):
                return False  # a replica still loading its first sync is no failover target
            for host in self.hosts.values():
                s = redis.Redis(host=host.address, port=SENTINEL_PORT, socket_timeout=1)
                if int(s.sentinel_master(SERVICE).get("num-other-sentinels", 0)) < 2:
                    return False
                seen = s.sentinel_slaves(SERVICE)
                if not seen or seen[0].get("master-link-status") != "ok" or seen[0].get("is_disconnected"):
                    return False  # each Sentinel must have seen the replica in sync, or it would not promote it
            return True
        except redis.RedisError:
            return False

    def primary(self) -> str:
        """The address of the primary now, as the live Sentinels say."""
        for host in self.hosts.values():
            try:
                s = redis.Redis(host=host.address, port=SENTINEL_PORT, socket_timeout=1)
                address = s.sentinel_get_master_addr_by_name(SERVICE)[0]
                return address.decode() if isinstance(address, bytes) else address
            except (redis.RedisError, TypeError):
                continue
        raise RuntimeError("no Sentinel answers")

    def kill_primary(self) -> str:
        """The primary's host vanishes (with the Sentinel it runs); returns its address."""
        address = self.primary()
        for host in self.hosts.values():
            if host.address == address:
                host.kill()
                return address
        raise RuntimeError(f"the primary {address} is on no Redis host of this fabric")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.parent.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*/server.log"))
        )


class HostedJobs:
    """Jobs made from `corpus` with `job_args` (several nodes), each on a fabric of its
    own under `root`; `close()` stops them and takes their fabrics down."""

    def __init__(self, corpus, root: Path, **job_args) -> None:
        self.corpus, self.root, self.job_args = corpus, root, job_args
        self.made: list[tuple[Fabric, HostedJob]] = []

    def make(self, *, sentinel: bool = False, shadow: bool = False, **overrides) -> HostedJob:
        """A new job (`overrides` on the job arguments; `shadow`: every source shadowed)."""
        n = len(self.made)
        # HostedJob points redis_url at the Redis it starts
        job = make_job(self.corpus, self.root / f"run{n}", redis_url="redis://unset", **{**self.job_args, **overrides})
        if shadow:
            job = dataclasses.replace(job, sources=tuple(dataclasses.replace(s, shadow=True) for s in job.sources))
        workdir = self.root / f"work{n}"
        workdir.mkdir()
        fabric = Fabric()
        try:
            self.made.append((fabric, HostedJob(fabric, job, workdir, sentinel=sentinel)))
        except BaseException:
            fabric.close()
            raise
        return self.made[-1][1]

    def close(self) -> None:
        for fabric, h in self.made:
            try:
                h.stop()
            except Exception:  # noqa: BLE001 - closing the fabric kills what is left
                pass
            h.kill_all()
            fabric.close()


def until(condition, h: HostedJob, timeout: float = 90, what: str = "") -> None:
    """Wait (bounded) for `condition`; on time out, fail naming `what` with the job's logs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{h.log()}"
        time.sleep(0.05)
