"""The Lane: a hot loop's commands on one held connection, against a real redis-server."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from overlord.store import EmbeddedRedis, connect, outage_within
from overlord.store.lane import Batch, Lane

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path):
    s = EmbeddedRedis(tmp_path / "r").start()
    yield s
    if s.proc is not None:
        os.kill(s.proc.pid, signal.SIGCONT)
    s.stop()


def test_xread_reads_what_the_clients_xread_reads(r):
    ids = [r.xadd("a", {"c": "1", "v": str(n)}) for n in range(3)] + [r.xadd("b", {"t": "0", "v": b"\x00\xff"})]
    lane = Lane(r)
    last = {"a": "0-0", "b": "0-0"}
    assert lane.xread(last, count=10) == [(k, list(map(tuple, v))) for k, v in r.xread(last, count=10)]
    assert [entry_id for _, entries in lane.xread(last) for entry_id, _ in entries] == ids
    assert lane.xread({"a": ids[2]}, block_ms=10) == []  # nothing new within the block
    assert lane.xread({"a": ids[1]}, count=1) == [(b"a", [(ids[2], {b"c": b"1", b"v": b"2"})])]


def test_a_blocking_xread_wakes_on_the_entry_written_meanwhile(r):
    lane = Lane(r)
    writer = threading.Timer(0.2, r.xadd, ("s", {"f": "x"}))
    writer.start()
    started = time.monotonic()
    reply = lane.xread({"s": "0-0"}, block_ms=5000)
    writer.join()
    assert [fields for _, entries in reply for _, fields in entries] == [{b"f": b"x"}]
    assert time.monotonic() - started < 4


def test_a_refused_command_raises_after_every_reply_is_read_and_the_lane_reads_on(r):
    lane = Lane(r)
    r.set("text", "x")
    batch = Batch()
    batch.set("a", 1)
    batch.execute_command("HGET", "text", "f")  # WRONGTYPE
    batch.set("b", 2)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        lane.execute(batch.commands)
    assert (r.get("a"), r.get("b")) == (b"1", b"2")  # the commands after the refused one ran
    assert lane.command("GET", "b") == b"2"  # its reply was read: the connection is in step


def test_a_connection_killed_under_the_lane_is_replaced(r):
    lane = Lane(r)
    killed = lane.command("CLIENT", "ID")
    r.client_kill_filter(_id=killed)
    assert lane.command("SET", "k", "v") in (b"OK", "OK", True)
    assert r.get("k") == b"v" and lane.command("CLIENT", "ID") != killed  # on a connection dialled anew


def test_a_frozen_server_is_ridden_through_as_any_command_of_the_client(server):
    r = connect(server.url, timeout_s=0.5, ride_through_s=10)
    lane = Lane(r)
    r.set("k", b"1")
    lane.command("GET", "k")
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw = threading.Timer(2, os.kill, (server.proc.pid, signal.SIGCONT))
    thaw.start()
    try:
        assert lane.command("GET", "k") == b"1"
    finally:
        thaw.join(timeout=10)
    assert outage_within(r, 60)  # the client's outage, as its own commands would report it


def test_a_server_gone_past_the_budget_is_the_clients_named_error(server):
    r = connect(server.url, timeout_s=0.3, ride_through_s=1)
    lane = Lane(r)
    lane.command("PING")
    os.kill(server.proc.pid, signal.SIGSTOP)
    with pytest.raises(redis.exceptions.TimeoutError, match="unreachable for"):
        lane.command("GET", "k")


def test_close_gives_the_connection_back(r):
    lane = Lane(r)
    lane.command("PING")
    held = lane.conn
    lane.close()
    assert lane.conn is None and held in r.connection_pool._available_connections
