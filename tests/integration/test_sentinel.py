"""A Redis that survives its primary: a primary, a replica and three Sentinels (the
same server binary in sentinel mode) on 127.0.0.1, and a job whose `redis_url` names
the Sentinels. Killing the primary mid-run (SIGKILL: no shutdown, no last fsync) makes
the Sentinels promote the replica; every client finds the new primary through them and
the job delivers every sample exactly once. Only the addresses of these servers, on
127.0.0.1, are dialled."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from harness import assert_delivered

from overlord.config import BatchSpec, Mesh
from overlord.store import Keys, connect
from overlord.store.server import redis_server_binary

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # make test-slow

SERVICE = "overlord"
JOB = dict(
    seed=3,
    epochs=1,
    mesh=Mesh(dp=2),
    loader_processes=1,
    plan_ahead=2,
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SentinelGroup:
    """A primary (append-only file, fsync every second), its replica and three
    Sentinels watching them (quorum 2, a primary down after 3 s)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {name: _port() for name in ("primary", "replica", "s0", "s1", "s2")}

    def _run(self, name: str, args: list[str]) -> None:
        d = self.root / name
        d.mkdir(mode=0o700, exist_ok=True)
        log = open(d / "server.log", "ab")
        self.procs[name] = subprocess.Popen([redis_server_binary(), *args], cwd=d, stdout=log, stderr=subprocess.STDOUT)

    def _data(self, name: str, *extra: str) -> None:
        args = ["--port", str(self.ports[name]), "--bind", "127.0.0.1", "--dir", str(self.root / name)]
        sync = ["--repl-diskless-sync-delay", "0"]  # a replica in sync at once, not after 5 s
        self._run(name, [*args, "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", *sync, *extra])

    def start(self) -> SentinelGroup:
        self.root.mkdir(mode=0o700)
        self._data("primary")
        self._data("replica", "--replicaof", "127.0.0.1", str(self.ports["primary"]))
        for name in ("s0", "s1", "s2"):
            d = self.root / name
            d.mkdir(mode=0o700, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {self.ports[name]}\nbind 127.0.0.1\ndir {d}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['primary']} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 3000\n"
                f"sentinel failover-timeout {SERVICE} 20000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self._run(name, [str(conf), "--sentinel"])
        deadline = time.monotonic() + 30
        while not self._ready():
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            replica = redis.Redis(host="127.0.0.1", port=self.ports["replica"], socket_timeout=1)
            if replica.info("replication").get("master_link_status") != "up":
                return False  # connected is not enough: a replica still loading its first sync is no failover target
            for name in ("s0", "s1", "s2"):
                s = redis.Redis(host="127.0.0.1", port=self.ports[name], socket_timeout=1)
                if int(s.sentinel_master(SERVICE).get("num-other-sentinels", 0)) < 2:
                    return False
                seen = s.sentinel_slaves(SERVICE)
                if not seen or seen[0].get("master-link-status") != "ok" or seen[0].get("is_disconnected"):
                    return False  # each Sentinel must have read the replica in sync, or it would not promote it
            return True
        except redis.RedisError:
            return False

    @property
    def url(self) -> str:
        where = ",".join(f"127.0.0.1:{self.ports[s]}" for s in ("s0", "s1", "s2"))
        return f"redis+sentinel://{where}/{SERVICE}/0"

    def primary_port(self, agree_s: float = 15.0) -> int:
        """The primary's port once all three Sentinels name the same one. The Sentinel
        that led a failover learns of it first; the others hear of it from its hello
        messages (every 2 s), so asking one of them alone can name the old primary."""
        deadline = time.monotonic() + agree_s
        while True:
            seen = set()
            for name in ("s0", "s1", "s2"):
                s = redis.Redis(host="127.0.0.1", port=self.ports[name], socket_timeout=1)
                try:
                    seen.add(int(s.sentinel_get_master_addr_by_name(SERVICE)[1]))
                except redis.RedisError:
                    seen.add(-1)
            if len(seen) == 1 and -1 not in seen:
                return seen.pop()
            assert time.monotonic() < deadline, f"the Sentinels name different primaries: {seen}\n{self.logs()}"
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.parent.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*/server.log"))
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def sentinels(tmp_path):
    group = SentinelGroup(tmp_path / "redis").start()
    yield group
    group.stop()


def test_a_client_finds_the_primary_through_the_sentinels_and_follows_a_failover(sentinels):
    r = connect(sentinels.url, timeout_s=2, ride_through_s=30)
    r.set("k", b"before")
    assert r.execute_command("WAIT", 1, 2000) == 1  # the replica has it
    first = sentinels.primary_port()
    sentinels.kill("primary")
    assert r.get("k") == b"before"  # rides through while the Sentinels promote the replica
    r.set("k", b"after")
    assert sentinels.primary_port() == sentinels.ports["replica"] != first
    assert r.get("k") == b"after"


def test_killing_the_primary_mid_run_loses_and_repeats_nothing(cluster, sentinels, corpus_keys):
    c = cluster(**JOB, redis_url=sentinels.url, timeout_s=8.0)
    c.start_sidecar()
    c.start_trainers(sleep="0.1")
    keys, deadline = Keys(c.job.name), time.monotonic() + 60
    r = connect(sentinels.url, timeout_s=2, ride_through_s=30)
    while True:
        progress = r.hgetall(keys.progress)
        if progress and all(int(progress.get(f"c{d}".encode(), -1)) >= 4 for d in range(2)):
            break
        assert time.monotonic() < deadline, f"the job did not reach step 4: {progress}\n{c.log()}"
        time.sleep(0.05)
    durable = int(r.hget(keys.planner, "durable"))
    sentinels.kill("primary")
    out = c.results(timeout=180)
    assert all(rec["end"] == "stop" for rec in out.values()), (
        {k: rec["end"] for k, rec in out.items()},
        c.log(),
        sentinels.logs(),
    )
    assert_delivered(out, corpus_keys, log=c.log)
    assert sentinels.primary_port() == sentinels.ports["replica"]
    assert int(r.hget(keys.planner, "durable")) >= durable  # no acknowledged step went back
    assert c.stop() == 0, c.log()
