"""Durable acknowledgements against real servers: the embedded Valkey with its
append-only file, one without it, and a primary with a real replica that stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

import pytest
import redis

from overlord.errors import StoreError
from overlord.store.durable import Durability, wanted
from overlord.store.server import redis_server_binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, redis.Redis]:
    port = _free_port()
    d = tmp_path / name
    d.mkdir()
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.02)


@pytest.fixture
def servers(tmp_path):
    started: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> redis.Redis:
        proc, client = _server(tmp_path, name, *args)
        started.append(proc)
        client.pid = proc.pid  # type: ignore[attr-defined]
        return client

    yield start
    for proc in started:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def _mark(key: str, value: int):
    return lambda pipe: pipe.hset(key, "durable", value)


def test_the_embedded_servers_append_only_file_is_waited_for(r):
    durable = Durability(r, timeout_s=5)
    assert (durable.want.local, durable.want.replicas) == (1, 0)
    assert durable.acknowledge(_mark("k", 1)) >= 0
    assert r.hget("k", "durable") == b"1"


def test_an_acl_user_without_info_probes_with_the_waits(r):
    """INFO is in @dangerous, which a least-privilege user lacks: the waits themselves
    tell what the server can confirm."""
    r.execute_command("ACL", "SETUSER", "least", "on", ">pw", "~*", "+@all", "-@dangerous")
    least = redis.Redis(unix_socket_path=r.connection_pool.connection_kwargs["path"], username="least", password="pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        least.info("persistence")
    want = wanted(least)
    assert (want.local, want.replicas) == (1, 0)
    assert Durability(least, timeout_s=5).acknowledge(_mark("k", 3)) >= 0
    assert r.hget("k", "durable") == b"3"


def test_a_server_with_nothing_to_wait_for_is_named_once_in_the_log(servers, caplog):
    plain = servers("plain", "--appendonly", "no")
    durable = Durability(plain, timeout_s=5)
    assert (durable.want.local, durable.want.replicas) == (0, 0)
    with caplog.at_level(logging.WARNING, logger="overlord.store"):
        for i in range(3):
            durable.acknowledge(_mark("k", i))
    assert plain.hget("k", "durable") == b"2"
    said = [rec.getMessage() for rec in caplog.records if "acknowledged in memory only" in rec.getMessage()]
    assert len(said) == 1 and "appendonly yes" in said[0]


def test_a_write_waits_for_the_replica_and_a_stopped_replica_is_an_error(servers):
    primary = servers("primary", "--appendonly", "yes")
    port = primary.connection_pool.connection_kwargs["port"]
    replica = servers("replica", "--replicaof", "127.0.0.1", str(port))
    deadline = time.monotonic() + 15
    while wanted(primary).replicas < 1 or replica.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never connected"
        time.sleep(0.05)
    durable = Durability(primary, timeout_s=10)  # the first wait: whatever the disk's fsync takes
    assert (durable.want.local, durable.want.replicas) == (1, 1)
    durable.acknowledge(_mark("k", 1))
    durable.timeout_s = 2
    deadline = time.monotonic() + 5
    while replica.hget("k", "durable") != b"1":  # WAIT said the replica received it; it applies it at once
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(replica.pid, signal.SIGSTOP)  # connected as far as the primary knows, but acknowledging nothing
    start = time.monotonic()
    # got 1 (fsynced) and 0 (replicas); 0 and 0 when the last wait for the fsync fell short too (a slow disk)
    with pytest.raises(StoreError, match=r"1 replica\(s\), got [01] and 0"):
        durable.acknowledge(_mark("k", 2))
    assert 2 <= time.monotonic() - start < 10
