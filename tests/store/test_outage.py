"""A client rides through a Redis outage up to its budget, against a real redis-server:
frozen (SIGSTOP) within the budget, a command answers once the server does; frozen past
it, the error reaches the caller at the budget (plus at most one socket timeout)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from overlord.store import EmbeddedRedis, connect, outage_within

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path):
    s = EmbeddedRedis(tmp_path / "r").start()
    yield s
    os.kill(s.proc.pid, signal.SIGCONT)
    s.stop()


def test_a_frozen_redis_within_the_budget_is_waited_for(server):
    r = connect(server.url, timeout_s=0.5, ride_through_s=10)
    r.set("k", b"1")
    assert not outage_within(r, 60)
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw = threading.Timer(3, os.kill, (server.proc.pid, signal.SIGCONT))
    thaw.start()
    started = time.monotonic()
    try:
        assert r.get("k") == b"1"
    finally:
        thaw.join(timeout=10)
    assert 2.5 < time.monotonic() - started < 5
    assert outage_within(r, 60) and not outage_within(r, 0)


def test_an_outage_ridden_through_on_a_second_connection_is_the_clients(server):
    """redis-py gives a connection it opens later a copy of the client's retry: an
    outage ridden through there must still be the client's, which `outage_within`
    reads (a constructor thread whose plan read ran beside another's took the
    Planner's heartbeat, stale from the outage, for a dead Planner)."""
    r = connect(server.url, timeout_s=0.5, ride_through_s=10)
    r.set("k", b"1")
    held = r.connection_pool.get_connection()  # another thread's command holds the first connection
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        thaw = threading.Timer(1.5, os.kill, (server.proc.pid, signal.SIGCONT))
        thaw.start()
        try:
            assert r.get("k") == b"1"  # on a connection opened now
        finally:
            thaw.join(timeout=10)
        assert outage_within(r, 60)
    finally:
        r.connection_pool.release(held)


def test_a_redis_frozen_past_the_budget_fails_at_the_budget(server):
    r = connect(server.url, timeout_s=0.5, ride_through_s=2)
    r.set("k", b"1")
    os.kill(server.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        r.get("k")
    # the budget, then one read's timeout and a backoff at most past it (3.5 s); the rest
    # is slack for a busy machine: the regression is a wait of many timeouts, or none
    assert 2 <= time.monotonic() - started < 2 + 3
    assert outage_within(r, 60)


def test_a_client_without_ride_through_fails_at_once(server):
    r = connect(server.url, timeout_s=0.5, ride_through_s=0)
    os.kill(server.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        r.get("k")
    assert time.monotonic() - started < 2  # one timeout of 0.5 s, not the 2 s of a ride-through
