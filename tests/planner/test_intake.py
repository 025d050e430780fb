"""Intake against a real redis-server: only the current generation's reports reach the
core, read streams are trimmed, demand is asked once (with its `demanded` entry, only
while this Planner leads), and a stall is told from back-pressure by the loaders'
heartbeats."""

from __future__ import annotations

import json
import threading
import time

import pytest
from planner_helpers import chunk, small_core

from overlord.errors import PlanError
from overlord.plan.meta import encode
from overlord.planner.intake import Intake
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease, Superseded
from overlord.store import Keys
from overlord.store.schema import demanded_values

KEYS = Keys("j")
LAYOUT = Layout(
    streams=["s0.0", "s1.0"],
    stream_source=[0, 1],
    loader_of=[0, 1],
    loaders=2,
    constructor_hosts=1,
    constructor_of=[0, 0],
    shadowed=[],
)


def leading(r) -> Lease:
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    return lease


def report(r, stream: str, seqs, token: int) -> None:
    r.xadd(KEYS.meta(stream), encode(chunk(seqs, token=token)))


def test_only_this_generations_reports_are_read_and_then_trimmed(r):
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=7, timeout_s=30, run_dir="/run")
    report(r, "s0.0", range(5), token=6)  # to the previous Planner: reported again below
    report(r, "s0.0", range(5), token=7)
    report(r, "s1.0", range(3), token=7)
    got = intake.read({})
    assert [(i, list(c.seq)) for i, c in got] == [(0, [0, 1, 2, 3, 4]), (1, [0, 1, 2])]
    assert r.xlen(KEYS.meta("s0.0")) <= 1 and r.xlen(KEYS.meta("s1.0")) <= 1  # what was read is dropped
    assert intake.read({}, block_ms=1) == []  # nothing new


def test_a_step_short_of_samples_asks_the_loaders_once(r):
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=1, timeout_s=30, run_dir="/run")
    core = small_core()
    core.add(0, chunk(range(2), token=1))
    assert core.plan_step() is None and core.wanted
    intake.read(core.wanted, block_ms=1)
    asked = demanded_values(r.hgetall(KEYS.demand))
    assert asked == {LAYOUT.streams[i]: n for i, n in core.wanted.items()}
    # the same values reach the loaders blocked on `demanded`, in one entry
    assert [demanded_values(fields) for _, fields in r.xrange(KEYS.demanded)] == [asked]
    r.delete(KEYS.demand)
    intake.read(core.wanted, block_ms=1)
    assert r.hgetall(KEYS.demand) == {} and r.xlen(KEYS.demanded) == 1  # asked already


def test_a_deposed_planner_asks_nothing(r):
    lease = leading(r)
    intake = Intake(r, KEYS, LAYOUT, lease, generation=1, timeout_s=30, run_dir="/run")
    r.set(KEYS.leader, b"another planner")  # the lease lapsed and another took it
    with pytest.raises(Superseded):
        intake.read({0: 5}, block_ms=1)
    assert lease.lost.is_set()
    assert r.hgetall(KEYS.demand) == {} and r.xlen(KEYS.demanded) == 0


def test_no_reports_from_hung_loaders_is_a_stall_but_back_pressure_is_not(r):
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=1, timeout_s=0.2, run_dir="/run")
    streams = small_core().streams  # nothing buffered in either
    intake.check_stalled(0, streams)  # not yet
    time.sleep(0.25)
    for k in (0, 1):  # both loaders turn their loops: they are held back, not hung
        r.set(KEYS.heartbeat("loader", str(k)), json.dumps({"pid": 1, "loop_age": 0.1, "time": time.time()}))
    intake.check_stalled(0, streams)
    time.sleep(0.25)
    r.delete(KEYS.heartbeat("loader", "1"))
    with pytest.raises(PlanError, match=r"loader process\(es\) \[0, 1\].*'s0.0', 's1.0'.*/run"):
        intake.check_stalled(0, streams)
