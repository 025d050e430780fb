"""Refill turns: they stop between streams for a published plan and resume after it; the
pace they and the plans set, without the burst of plans published ahead at a start."""

from __future__ import annotations

import threading
import time

from overlord.loader.refill import Pace, PlanWatch, RefillTurns
from overlord.runtime.readbuffer import MAX_REFILL_STEPS, ReadBudget
from overlord.store import Keys
from overlord.store.schema import plans_entry, plans_entry_id


class Clock:
    """Each top-up costs `step` seconds of this clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_turn(turns: RefillTurns, clock: Clock, streams, below, plan_at: float | None):
    """One turn; returns (its result, the streams topped up, how many looks)."""
    done: list[int] = []
    looks = [0]

    def top_up(i: int) -> bool:
        if i not in below:
            return False
        clock.now += 0.01
        done.append(i)
        return True

    def plan_out() -> bool:
        looks[0] += 1
        return plan_at is not None and clock.now >= plan_at

    return turns.turn(streams, top_up, plan_out), done, looks[0]


def test_a_turn_without_a_plan_tops_up_every_stream_looking_every_look_s():
    clock = Clock()
    turns = RefillTurns(look_s=0.015, clock=clock)
    filled, done, looks = run_turn(turns, clock, list(range(10)), set(range(10)), None)
    assert filled and done == list(range(10))
    assert looks == 4  # after streams 1, 3, 5, 7 (not after the last: the loop looks next)
    assert turns.yielded == 0 and turns.start == 0


def test_a_published_plan_stops_the_turn_and_the_next_turn_starts_after_it():
    clock = Clock()
    turns = RefillTurns(look_s=0.015, clock=clock)
    filled, done, _ = run_turn(turns, clock, list(range(10)), set(range(10)), plan_at=0.035)
    assert filled and done == [0, 1, 2, 3]  # the look after stream 3 saw the plan
    assert turns.yielded == 1 and turns.start == 4
    filled, done, _ = run_turn(turns, clock, list(range(10)), set(range(10)), None)
    assert done == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3]  # every stream gets its turn


def test_streams_above_their_mark_cost_no_look():
    clock = Clock()
    turns = RefillTurns(look_s=0.015, clock=clock)
    filled, done, looks = run_turn(turns, clock, [0, 1, 2], set(), plan_at=0.0)
    assert not filled and done == [] and looks == 0
    assert not turns.turn([], lambda i: True, lambda: True)


def test_the_start_wraps_when_streams_go():
    clock = Clock()
    turns = RefillTurns(look_s=0.0, clock=clock)
    run_turn(turns, clock, [5, 6, 7, 8], {5, 6, 7, 8}, plan_at=0.0)
    assert turns.start == 1
    turns.start = 7  # more than the streams left after a handoff
    _, done, _ = run_turn(turns, clock, [5, 6], {5, 6}, None)
    assert done == [6, 5]


def test_the_plan_watch_follows_the_plans_stream(r):
    """A real Redis: announcements before the watch's step do not count, later ones do."""
    keys, stop = Keys("j"), threading.Event()
    for step in range(3):
        r.xadd(keys.plans, plans_entry(step, False), id=plans_entry_id(step))
    watch = PlanWatch(r, keys, stop)
    watch.start(2)
    try:
        wait_for(lambda: watch.published(2))
        assert not watch.published(3)
        r.xadd(keys.plans, plans_entry(3, False), id=plans_entry_id(3))
        r.xadd(keys.plans, plans_entry(4, True), id=plans_entry_id(4))
        wait_for(lambda: watch.published(4))
        assert not watch.published(5)
    finally:
        stop.set()


def test_the_plan_watch_sees_nothing_before_its_step(r):
    keys, stop = Keys("j"), threading.Event()
    r.xadd(keys.plans, plans_entry(0, False), id=plans_entry_id(0))
    watch = PlanWatch(r, keys, stop)
    watch.start(1)
    time.sleep(0.3)
    stop.set()
    assert watch.latest == -1 and not watch.published(1)


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the watch did not see the announcement in time"
        time.sleep(0.01)


def served(pace: Pace, steps, start: float, spacing: float) -> float:
    """Serve `steps` `spacing` seconds apart from `start`; returns the last time."""
    now = start
    for step in steps:
        pace.served(step, now)
        now += spacing
    return now - spacing


def test_the_plans_published_ahead_at_a_start_do_not_set_the_pace():
    # the Planner publishes plan_ahead + 1 plans before any trainer consumes; the process
    # serves them 2 ms apart while its first refill turns take seconds (every stream's
    # first fill). Taken for the job's steps, that set the refill latency to the most
    # steps and every stream filled to twice its need while the trainers started.
    pace = Pace(plan_ahead=4)
    pace.refilled(3.0)
    served(pace, range(5), start=0.0, spacing=0.002)
    assert pace.known() is None  # no step time yet: the budgets keep one refill step
    budget = ReadBudget(draw=1.0, plan_ahead=4, cap_bytes=1 << 30)
    budget.observe([1000] * 8)
    before = budget.target_samples()
    # the trainers start 20 s later and then step every 100 ms
    last = served(pace, range(5, 40), start=20.0, spacing=0.1)
    for _ in range(20):
        pace.refilled(0.05)
    refill_s, step_s = pace.known()
    assert step_s < 0.5 and refill_s < 0.2
    budget.pace(refill_s, step_s)
    assert budget.refill_steps == 1 and budget.target_samples() == before
    assert last > 20.0


def test_the_burst_counts_from_the_first_step_a_process_serves():
    # a restart (or a resume) at step 100: the burst is 100..104, then the job's steps
    pace = Pace(plan_ahead=4)
    pace.refilled(0.25)
    served(pace, range(100, 105), start=0.0, spacing=0.001)
    assert pace.known() is None
    served(pace, range(105, 107), start=1.0, spacing=0.1)
    assert pace.known() is None  # the refill turn was made during the burst
    pace.refilled(0.25)
    assert pace.known() is not None
    budget = ReadBudget(draw=1.0, plan_ahead=4, cap_bytes=1 << 30)
    budget.pace(*pace.known())
    assert 1 <= budget.refill_steps < MAX_REFILL_STEPS


def test_the_first_fill_does_not_set_the_refill_latency():
    # a process's first refill turns fill every stream from empty (seconds) while the
    # burst is served; the job's turns then take tens of ms. Folded in, the first fill
    # held the refill latency at the most steps for tens of steps after the burst, and
    # every stream's buffer at twice its need: the loaders' peak memory at a start.
    pace = Pace(plan_ahead=4)
    pace.refilled(3.0)
    served(pace, range(5), start=0.0, spacing=0.002)
    pace.refilled(1.5)  # still every stream's first fill, while the burst is served
    served(pace, range(5, 8), start=0.038, spacing=0.03)  # the trainers step every 30 ms
    pace.refilled(0.05)
    refill_s, step_s = pace.known()
    assert refill_s == 0.05 and abs(step_s - 0.03) < 1e-9
    budget = ReadBudget(draw=4.0, plan_ahead=4, cap_bytes=1 << 30)
    budget.observe([1000] * 8)
    budget.pace(refill_s, step_s)
    assert budget.refill_steps == 2
