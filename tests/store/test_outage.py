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

from overlord.errors import StoreError
from overlord.store import EmbeddedRedis, connect, outage_within

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path):
    s = EmbeddedRedis(tmp_path / "r").start()
    yield s
    if s.proc is not None:  # a test may have stopped it
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


def test_a_known_server_gone_at_connect_is_waited_for_and_an_unknown_one_is_an_error_at_once(server):
    """A role connects to the server its sidecar reached (`known`): a role started again
    while that server restarts (both were killed at once) waits for it, as any command
    does; a client given a URL to check still hears at once that nothing answers there."""
    server.stop()  # gone: its socket path answers nothing
    started = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        connect(server.url, timeout_s=0.5, ride_through_s=10)
    assert time.monotonic() - started < 2
    got: dict = {}

    def connecting() -> None:
        started = time.monotonic()
        try:
            got["client"] = connect(server.url, timeout_s=0.5, ride_through_s=10, known=True)
        except StoreError as exc:
            got["error"] = exc
        got["waited"] = time.monotonic() - started

    role = threading.Thread(target=connecting)
    role.start()
    time.sleep(1.5)
    # from this thread, which outlives the test: the server gets SIGTERM when the thread
    # that started it ends (PR_SET_PDEATHSIG follows the thread, not the process)
    server.start()
    role.join(timeout=30)
    assert "error" not in got, got["error"]
    assert 1.0 < got["waited"] < 8
    assert got["client"].ping() and outage_within(got["client"], 60)


def test_revive_starts_a_dead_server_again_from_the_command_that_found_it_gone(server):
    """The sidecar's client revives its embedded server from inside a failed command: a
    server killed before the watch loop runs (while the roles start) is back before the
    client's short budget runs out, and its data with it (the append-only file)."""
    revived = []

    def revive() -> bool:
        if server.proc is None or server.proc.poll() is None:
            return False
        server.proc = None
        server.start()
        revived.append(time.monotonic())
        return True

    r = connect(server.url, timeout_s=0.5, ride_through_s=1.0, known=True, revive=revive)
    r.set("k", b"1")
    r.execute_command("WAITAOF", 1, 0, 2000)  # on disk before the kill
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    assert r.get("k") == b"1"
    assert len(revived) == 1
    assert r.get("k") == b"1" and len(revived) == 1  # alive: nothing more to revive
