"""Intake against a real redis-server: only the current generation's reports reach the
core, read streams are trimmed, demand is asked once (with its `demanded` entry, only
while this Planner leads) and lowered once steps stop needing it, and a stall is told
from back-pressure by the loaders' heartbeats."""

from __future__ import annotations

import json
import threading
import time

import pytest
from planner_helpers import chunk, small_core

from overlord.errors import PlanError
from overlord.plan.meta import encode
from overlord.planner.intake import DEMAND_HOLD_STEPS, Intake
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


def test_read_streams_are_trimmed_together_once_a_period(r):
    # trimmed after every read, a job of 300 streams sent an XTRIM for each stream read
    # (17 a step in bench/peers.py); now the read streams are trimmed in one round trip
    # once a period, each to the last entry read of it
    now = [100.0]
    intake = Intake(
        r, KEYS, LAYOUT, leading(r), generation=7, timeout_s=30, run_dir="/run", trim_every_s=5.0, clock=lambda: now[0]
    )
    report(r, "s0.0", range(5), token=7)
    assert len(intake.read({})) == 1
    assert r.xlen(KEYS.meta("s0.0")) == 1  # the first read trims at once, to its last entry
    report(r, "s0.0", range(5, 8), token=7)
    report(r, "s1.0", range(3), token=7)
    now[0] += 1.0
    assert [(i, list(c.seq)) for i, c in intake.read({})] == [(0, [5, 6, 7]), (1, [0, 1, 2])]
    assert r.xlen(KEYS.meta("s0.0")) == 2 and r.xlen(KEYS.meta("s1.0")) == 1  # within the period: kept
    report(r, "s1.0", range(3, 6), token=7)
    now[0] += 4.0
    assert [(i, list(c.seq)) for i, c in intake.read({}, block_ms=1)] == [(1, [3, 4, 5])]
    last_s1 = r.xrevrange(KEYS.meta("s1.0"), count=1)[0][0]
    assert r.xlen(KEYS.meta("s0.0")) == 1 and [e[0] for e in r.xrange(KEYS.meta("s1.0"))] == [last_s1]
    report(r, "s0.0", range(8, 9), token=7)  # after the trim, unread: left for the next read
    assert r.xlen(KEYS.meta("s0.0")) == 2
    assert [(i, list(c.seq)) for i, c in intake.read({}, block_ms=1)] == [(0, [8])]


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
    # the time without reports is set back rather than slept: a timeout short enough to
    # sleep through could pass before the first check on a busy machine
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=1, timeout_s=30, run_dir="/run")
    streams = small_core().streams  # nothing buffered in either
    intake.check_stalled(0, streams)  # not yet
    intake.waiting_since -= 31
    for k in (0, 1):  # both loaders turn their loops: they are held back, not hung
        r.set(KEYS.heartbeat("loader", str(k)), json.dumps({"pid": 1, "loop_age": 0.1, "time": time.time()}))
    intake.check_stalled(0, streams)
    intake.waiting_since -= 31
    r.delete(KEYS.heartbeat("loader", "1"))
    with pytest.raises(PlanError, match=r"loader process\(es\) \[0, 1\].*'s0.0', 's1.0'.*/run"):
        intake.check_stalled(0, streams)


def demand_now(r) -> dict[str, int]:
    return demanded_values(r.hgetall(KEYS.demand))


def entries(r) -> list[dict[str, int]]:
    return [demanded_values(fields) for _, fields in r.xrange(KEYS.demanded)]


def test_a_demand_steps_stop_needing_is_lowered_and_asked_again_when_needed(r):
    # a mixing schedule turned to s0 (a step wanted 50 of it), then away: steps take 3
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=1, timeout_s=30, run_dir="/run")
    intake.read({0: 50}, block_ms=1)
    assert demand_now(r) == {"s0.0": 50}
    for _ in range(DEMAND_HOLD_STEPS - 1):
        intake.planned({0: 3, 1: 8})
    assert demand_now(r) == {"s0.0": 50}  # not yet: a burst may come back
    intake.planned({0: 2})
    assert demand_now(r) == {"s0.0": 3}  # the most a step of the window took
    assert entries(r)[-1] == {"s0.0": 3}  # the loaders blocked on `demanded` see it at once
    for _ in range(DEMAND_HOLD_STEPS):
        intake.planned({1: 8})
    assert demand_now(r) == {"s0.0": 0} and intake.asked == {}
    writes = r.xlen(KEYS.demanded)
    for _ in range(DEMAND_HOLD_STEPS):
        intake.planned({1: 8})
    assert r.xlen(KEYS.demanded) == writes  # nothing left to lower: no writes
    intake.read({0: 10}, block_ms=1)  # a step needs 10 again: asked again
    assert demand_now(r) == {"s0.0": 10}


def test_a_demand_a_step_still_takes_is_kept(r):
    intake = Intake(r, KEYS, LAYOUT, leading(r), generation=1, timeout_s=30, run_dir="/run")
    intake.read({1: 20}, block_ms=1)
    for step in range(3 * DEMAND_HOLD_STEPS):
        intake.planned({1: 20 if step % DEMAND_HOLD_STEPS == 7 else 1})
    assert demand_now(r) == {"s1.0": 20} and r.xlen(KEYS.demanded) == 1


def test_a_planner_that_takes_over_lowers_its_predecessors_demand(r):
    lease = leading(r)
    Intake(r, KEYS, LAYOUT, lease, generation=1, timeout_s=30, run_dir="/run").read({1: 40}, block_ms=1)
    successor = Intake(r, KEYS, LAYOUT, lease, generation=2, timeout_s=30, run_dir="/run")
    assert successor.asked == {1: 40}
    for _ in range(DEMAND_HOLD_STEPS):
        successor.planned({1: 5})
    assert demand_now(r) == {"s1.0": 5}


def test_a_deposed_planner_lowers_nothing(r):
    lease = leading(r)
    intake = Intake(r, KEYS, LAYOUT, lease, generation=1, timeout_s=30, run_dir="/run")
    intake.read({0: 30}, block_ms=1)
    r.set(KEYS.leader, b"another planner")
    with pytest.raises(Superseded):
        for _ in range(DEMAND_HOLD_STEPS):
            intake.planned({})
    assert demand_now(r) == {"s0.0": 30} and r.xlen(KEYS.demanded) == 1
