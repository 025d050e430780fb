"""A constructor host's DP groups read each step's plan once (overlord.plan.waiting.SharedPlans)."""

import threading
import time

import numpy as np

from overlord.plan.step_plan import Plan
from overlord.plan.waiting import SharedPlans, wait_plan
from overlord.store import Keys
from overlord.store.schema import plans_after, plans_entry, plans_entry_id, plans_entry_step


def _plan(step: int) -> Plan:
    items = np.array([[step % 3, 0, 10 * step + k] for k in range(4)], dtype=np.int64)
    return Plan(step=step, items=items, bounds=np.array([0, 2, 4], dtype=np.int64))


def _publish(r, keys: Keys, step: int) -> None:
    r.set(keys.plan(step), _plan(step).encode())
    r.xadd(keys.plans, plans_entry(step, False), id=plans_entry_id(step))


def _gets(r) -> int:
    return int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_the_groups_of_a_host_get_each_plan_once_as_it_is_published(r):
    """Three threads (a host's three DP groups) wait for steps 0-11, published one by
    one while they wait: each gets every step's plan, and Redis served one GET per step
    that was there (plus the misses of the threads that looked before it was)."""
    keys, steps, groups = Keys("sp"), 12, 3
    shared = SharedPlans(groups)
    stop = threading.Event()
    got: dict[int, list[Plan]] = {g: [] for g in range(groups)}

    def group(g: int) -> None:
        for step in range(steps):
            got[g].append(wait_plan(r, keys, step, stop, 30.0, block_ms=50, shared=shared))

    threads = [threading.Thread(target=group, args=(g,)) for g in range(groups)]
    before = _gets(r)
    for t in threads:
        t.start()
    for step in range(steps):
        time.sleep(0.02)
        _publish(r, keys, step)
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    for g in range(groups):
        assert got[g] == [_plan(s) for s in range(steps)], f"group {g}"
    assert shared.fetched == steps
    assert not shared._plans, "a plan every group took is still held"
    gets = _gets(r) - before
    # every step is fetched once when published; before that, one group's look finds it
    # missing and the others wait on the plans stream without asking, until a read of it
    # finds that very step announced (a late read, for an earlier step, sent each group
    # to ask: 31 GETs in one CI run). Without sharing: a GET per group and step, and misses
    assert steps <= gets <= 2 * steps, gets


def test_a_group_that_stopped_taking_leaves_at_most_keep_plans_held(r):
    keys = Keys("sp2")
    shared = SharedPlans(users=2)  # the second group never asks (its unit moved elsewhere)
    for step in range(SharedPlans.KEEP + 10):
        _publish(r, keys, step)
        assert shared.fetch(r, keys, step) == _plan(step)
        assert len(shared._plans) <= SharedPlans.KEEP
    assert min(shared._plans) == 10  # the oldest went first
    assert shared.fetch(r, keys, 10) == _plan(10)  # held: the second taker ends it
    assert 10 not in shared._plans


def test_a_step_found_unpublished_is_not_asked_again_until_the_plans_stream_wakes_a_group(r):
    """The groups wait ahead of the Planner: once one found step 5 unpublished, neither
    step 5 nor a later one is asked of Redis (they go to the blocking read of the plans
    stream) until that read returns; then the plan is read, once."""
    keys = Keys("sp3")
    shared = SharedPlans(users=2)
    gets = _gets(r)
    assert shared.fetch(r, keys, 5) is None and not shared._plans
    assert _gets(r) == gets + 1
    _publish(r, keys, 5)
    assert shared.fetch(r, keys, 5) is None and shared.fetch(r, keys, 6) is None
    assert _gets(r) == gets + 1, "asked Redis again before a wake"
    shared.woke(4)  # a late wake, for an earlier step: 5 is still taken as unpublished
    assert shared.fetch(r, keys, 5) is None and _gets(r) == gets + 1, "a wake for step 4 sent a group to ask for 5"
    shared.woke(5)
    assert shared.fetch(r, keys, 5) == _plan(5) and shared.fetched == 1
    assert shared.fetch(r, keys, 5) == _plan(5) and _gets(r) == gets + 2


def test_a_wake_for_a_step_that_came_before_a_miss_keeps_the_miss(r):
    """One group took step 3 and found 4 unpublished; another group's read of the plans
    stream returns late with step 3's entry. Step 4 is not asked of Redis again until
    its own entry is read (the old wake cleared the miss: a GET miss per group and step,
    which put 31 GETs for 12 steps in a CI run)."""
    keys = Keys("sp5")
    shared = SharedPlans(users=2)
    _publish(r, keys, 3)
    assert shared.fetch(r, keys, 3) == _plan(3) and shared.fetch(r, keys, 4) is None
    gets = _gets(r)
    stop = threading.Event()
    read = r.xread({keys.plans: plans_after(3)}, count=1)
    shared.woke(plans_entry_step(read[0][1][0][0]))  # what wait_plan does with the late read
    assert shared.fetch(r, keys, 3) == _plan(3) and shared.fetch(r, keys, 4) is None
    assert _gets(r) == gets, "a late wake for step 3 sent a group to Redis for step 4"
    threading.Timer(0.2, _publish, args=(r, keys, 4)).start()
    assert wait_plan(r, keys, 4, stop, 10.0, block_ms=5000, shared=shared) == _plan(4)
    assert _gets(r) == gets + 1


def test_a_group_waiting_for_a_step_another_found_unpublished_gets_it_when_published(r):
    """wait_plan through the shared plans: the skip sends the second group to the
    blocking read, which returns once the plan is published (no spin, no miss)."""
    keys, stop = Keys("sp4"), threading.Event()
    shared = SharedPlans(users=2)
    assert shared.fetch(r, keys, 0) is None  # the first group looked: unpublished
    threading.Timer(0.3, _publish, args=(r, keys, 0)).start()
    t = time.monotonic()
    assert wait_plan(r, keys, 0, stop, 10.0, block_ms=5000, shared=shared) == _plan(0)
    assert time.monotonic() - t < 4.0  # woken by the publish, not by the read's block time
