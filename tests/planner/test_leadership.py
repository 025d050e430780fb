"""Leadership against a real redis-server: one Planner leads; when its lease lapses
another takes over from the newest checkpoint, with a new generation, and the old one
can no longer write."""

from __future__ import annotations

import threading
import time

import pytest
from planner_helpers import chunk, small_core

from overlord.plan.checkpoint import Checkpoints
from overlord.planner.leadership import Leadership, wait_done
from overlord.planner.publishing import Publisher
from overlord.runtime.lease import Lease, Superseded
from overlord.store import Keys

KEYS = Keys("j")


def lead(r, node: str, ttl_s: float):
    lease = Lease(r, KEYS, node=node, ttl_s=ttl_s)
    token = lease.acquire(threading.Event())
    return lease, Leadership(r, KEYS, lease, token)


def lapse(r, keys: Keys) -> None:
    """The leader's lease runs out now, as when it paused past it (nobody renews it):
    a lease of seconds made to lapse, not one of 0.3 s that the leader's own first writes
    (a WAITAOF waits for the next fsync, 0.1-0.2 s and more on a busy disk) could outlive."""
    r.pexpire(keys.leader, 1)
    deadline = time.monotonic() + 5
    while r.exists(keys.leader):
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.005)


def test_the_second_planner_takes_over_from_the_newest_checkpoint(r):
    lease_a, a = lead(r, "a", ttl_s=30)
    core_a, ckpts = small_core(), Checkpoints(KEYS)
    gen_a = a.take_over(core_a, ckpts)
    assert gen_a is not None and ckpts.newest(r) == 0  # the first leader writes the first checkpoint
    assert int(r.hget(KEYS.planner, "token")) == gen_a
    for i in range(2):
        core_a.add(i, chunk(range(100), token=gen_a))
    publisher = Publisher(r, KEYS, lease_a, ckpts, first=0, dp=2)
    for _ in range(3):
        plan = core_a.plan_step()
        publisher.publish_turn([(plan, core_a.delta())], core_a.state, publisher.bound())
    a.check()  # still leads

    lapse(r, KEYS)  # a paused past its lease
    lease_b, b = lead(r, "b", ttl_s=5)
    core_b = small_core()
    gen_b = b.take_over(core_b, ckpts)
    assert gen_b is not None and gen_b > gen_a  # loaders report again, tagged with the new one
    assert int(r.hget(KEYS.planner, "token")) == gen_b
    assert core_b.step == 3 and core_b.state() == core_a.state()  # where a stopped, nothing replanned

    plan = core_a.plan_step()
    with pytest.raises(Superseded):  # the old leader cannot publish step 3 any more
        publisher.publish_turn([(plan, core_a.delta())], core_a.state, publisher.bound())
    with pytest.raises(Superseded):
        a.check()
    assert int(r.hget(KEYS.planner, "step")) == 2


def test_nothing_to_lead_once_the_last_step_is_planned(r):
    _, a = lead(r, "a", ttl_s=5)
    r.hset(KEYS.planner, "done", 1)
    assert a.take_over(small_core(), Checkpoints(KEYS)) is None
    assert r.get(KEYS.fence) == b"1"  # no new generation: loaders are not asked to report again


def test_a_checkpoint_after_the_last_step_marks_the_job_done(r):
    ckpts = Checkpoints(KEYS)
    core = small_core()
    core.done = True
    pipe = r.pipeline()
    ckpts.write(pipe, 0, None, core.state)
    pipe.execute()
    _, a = lead(r, "a", ttl_s=5)
    assert a.take_over(small_core(), ckpts) is None
    assert r.hget(KEYS.planner, "done") == b"1"


def test_a_standby_leaves_when_the_job_is_done_but_a_leader_does_not(r):
    standby, leader = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=wait_done, args=(r, KEYS, standby, lambda: True), daemon=True),
        threading.Thread(target=wait_done, args=(r, KEYS, leader, lambda: False), daemon=True),
    ]
    for t in threads:
        t.start()
    r.hset(KEYS.planner, "done", 1)
    assert standby.wait(5)
    assert not leader.wait(1.2)
    leader.set()
    for t in threads:
        t.join(timeout=5)
