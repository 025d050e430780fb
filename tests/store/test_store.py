"""The control path against a real redis-server: keys, embedded server, URLs."""

from __future__ import annotations

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


def test_unreachable_redis_names_the_url_without_password(tmp_path):
    with pytest.raises(StoreError, match=r"unix://\*\*\*@.*nothing\.sock is unreachable"):
        connect(f"unix://:secret@{tmp_path}/nothing.sock", timeout_s=1)
    assert redact("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
