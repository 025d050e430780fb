"""The control path against a real redis-server: keys, embedded server, URLs."""

from __future__ import annotations

import threading
import time

import pytest

from overlord.errors import StoreError
from overlord.store import EmbeddedRedis, Keys, connect, redact


def test_keys_share_the_job_hash_tag():
    k = Keys("j1")
    every = [
        k.planner,
        k.plan(3),
        k.plans,
        k.meta("web.0"),
        k.progress,
        k.heartbeat("loader", "0"),
        k.nodes,
        k.layout,
        k.errors,
        k.counters,
        k.job_config,
    ]
    assert all(key.startswith("overlord:{j1}:") for key in every)
    assert len(set(every)) == len(every)


def test_embedded_server_is_private_persistent_and_stops(tmp_path):
    server = EmbeddedRedis(tmp_path / "run").start()
    try:
        assert (tmp_path / "run" / "redis.sock").stat().st_mode & 0o777 == 0o600
        r = connect(server.url)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("port")["port"] == "0"  # no TCP listener
        r.set("overlord:{x}:k", "v")
    finally:
        server.stop()
    # the data survives a restart from the same run directory
    again = EmbeddedRedis(tmp_path / "run").start()
    try:
        assert connect(again.url).get("overlord:{x}:k") == b"v"
    finally:
        again.stop()


def test_an_embedded_server_killed_before_it_answers_is_started_again_and_one_that_cannot_start_is_named(tmp_path):
    """Killed by a signal while it starts (a fault, not its configuration), the server is
    started again: a sidecar restarting a server killed twice in a row kept going; one
    that exits with a status of its own (here: its append-only directory is a file) is
    an error naming it, at once."""
    server = EmbeddedRedis(tmp_path / "run")
    started, killed = threading.Event(), []

    def kill_the_first() -> None:
        while not started.is_set():
            proc = server.proc
            if proc is not None:
                proc.kill()
                killed.append(proc.pid)
                return
            time.sleep(0.0001)

    killer = threading.Thread(target=kill_the_first)
    killer.start()
    try:
        server.start()
    finally:
        started.set()
        killer.join(timeout=10)
    try:
        assert killed and server.proc.pid != killed[0]
        assert connect(server.url).ping()
    finally:
        server.stop()
    (tmp_path / "bad").mkdir(mode=0o700)
    (tmp_path / "bad" / "appendonlydir").write_text("")  # where its append-only files go: a file
    with pytest.raises(StoreError, match=r"exited with [1-9]"):
        EmbeddedRedis(tmp_path / "bad").start()


def test_unreachable_redis_names_the_url_without_password(tmp_path):
    with pytest.raises(StoreError, match=r"unix://\*\*\*@.*nothing\.sock is unreachable"):
        connect(f"unix://:secret@{tmp_path}/nothing.sock", timeout_s=1)
    assert redact("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
