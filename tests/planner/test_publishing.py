"""Publishing against a real redis-server: a step is published once though a write is
cut short (retried only if it did not land), with its checkpoint, and never past the
job's bound (trainers' consumed step and slowest constructor, plus plan_ahead)."""

from __future__ import annotations

import threading
import time

import pytest
from planner_helpers import chunk, small_core

from overlord.plan.checkpoint import Checkpoints
from overlord.plan.step_plan import Plan
from overlord.planner.process import turn_steps
from overlord.planner.publishing import (
    FSYNC_EVERY_S,
    MARKS_REFRESH_S,
    PLAN_KEEP_STEPS,
    PRUNE_MAX,
    Bound,
    Pace,
    Publisher,
)
from overlord.runtime.lease import Lease, Superseded
from overlord.store import Keys
from overlord.store.schema import built_entry, built_field, consumed_entry, consumed_field

KEYS = Keys("j")


def leading(r) -> Lease:
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    return lease


def fed_core():
    core = small_core()
    for i in range(2):
        core.add(i, chunk(range(200)))
    return core


def plans_stream(r) -> list[int]:
    return [int(fields[b"step"]) for _, fields in r.xrange(KEYS.plans)]


def test_each_step_is_published_once_with_its_checkpoint(r):
    ckpts, core = Checkpoints(KEYS), fed_core()
    publisher = Publisher(r, KEYS, leading(r), ckpts, first=0, dp=2)
    pipe = r.pipeline()
    ckpts.write(pipe, 0, None, core.state)  # as the leader's take-over does
    pipe.execute()
    plans = []
    for _ in range(3):
        plan = core.plan_step()
        plans.append(plan)
        publisher.publish_turn([(plan, core.delta())], core.state, publisher.bound())
    assert plans_stream(r) == [0, 1, 2]
    assert [r.get(KEYS.plan(s)) for s in range(3)] == [p.encode() for p in plans]
    assert int(r.hget(KEYS.planner, "step")) == 2
    assert ckpts.newest(r) == 3 and ckpts.load(r, 3) == core.state()  # the state before step 3
    # sent again (its reply was lost with the connection): the script finds it there
    # and writes it no second time (a second XADD of its id would be refused)
    publisher.publish_turn([(plans[2], {"step": 99})], core.state, publisher.bound())
    assert plans_stream(r) == [0, 1, 2] and ckpts.load(r, 3) == core.state()
    # lost in a failover (the promoted replica never had it): written again
    r.hset(KEYS.planner, "step", 1)
    r.delete(KEYS.plan(2))
    r.delete(KEYS.plans)  # the replica had the entries of steps 0 and 1 only
    for step in (0, 1):
        r.xadd(KEYS.plans, {"step": step, "last": 0}, id=f"{step + 1}-0")
    publisher.publish_turn([(plans[2], core.delta())], core.state, publisher.bound())
    assert r.get(KEYS.plan(2)) == plans[2].encode() and int(r.hget(KEYS.planner, "step")) == 2


def test_a_deposed_planner_writes_nothing(r):
    lease = leading(r)
    ckpts, core = Checkpoints(KEYS), fed_core()
    publisher = Publisher(r, KEYS, lease, ckpts, first=0, dp=2)
    r.set(KEYS.leader, b"another")  # the lease changed hands while this Planner planned
    before = {k: r.type(k) for k in r.keys("*")}
    with pytest.raises(Superseded, match="no longer this process's"):
        publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert lease.lost.is_set()
    assert r.get(KEYS.plan(0)) is None and not plans_stream(r) and ckpts.newest(r) is None
    assert {k: r.type(k) for k in r.keys("*")} == before


def test_a_server_that_lost_the_script_is_given_it_again(r):
    core = fed_core()
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=0, dp=2)
    r.script_flush()  # as a restarted server, or a promoted replica, has no script
    plan = core.plan_step()
    publisher.publish_turn([(plan, core.delta())], core.state, publisher.bound())
    assert r.get(KEYS.plan(0)) == plan.encode() and plans_stream(r) == [0]


def test_a_turn_publishes_its_steps_and_their_checkpoints_in_one_script_once(r):
    ckpts, core = Checkpoints(KEYS), fed_core()
    publisher = Publisher(r, KEYS, leading(r), ckpts, first=0, dp=2)
    pipe = r.pipeline()
    ckpts.write(pipe, 0, None, core.state)
    pipe.execute()
    states, turn = [], []
    for _ in range(3):
        turn.append((core.plan_step(), core.delta()))
        states.append(core.state())

    def calls(stats, command):
        return stats.get(f"cmdstat_{command}", {}).get("calls", 0)

    before = r.info("commandstats")
    publisher.publish_turn(turn, core.state, publisher.bound())
    after = r.info("commandstats")
    scripts = calls(after, "evalsha") - calls(before, "evalsha")
    # one script and one fsync wait for the turn, not one per step (a wait that came back
    # short, on a slow disk, sends both again: the script's count follows the waits')
    assert 1 <= scripts == calls(after, "waitaof") - calls(before, "waitaof"), scripts
    assert plans_stream(r) == [0, 1, 2]
    assert [r.get(KEYS.plan(s)) for s in range(3)] == [p.encode() for p, _ in turn]
    assert int(r.hget(KEYS.planner, "step")) == 2
    # a resume may start inside the turn: every step's checkpoint is there
    assert [ckpts.load(r, s + 1) for s in range(3)] == states
    # sent again (its reply lost): nothing is written twice
    publisher.publish_turn(turn, core.state, publisher.bound())
    assert plans_stream(r) == [0, 1, 2] and ckpts.load(r, 3) == states[-1]


def test_a_snapshot_can_only_end_a_turn(r):
    """A snapshot is the core's state when the turn is published: taken inside a turn,
    it would hold the steps planned after it."""
    ckpts, core = Checkpoints(KEYS, every=2), fed_core()
    publisher = Publisher(r, KEYS, leading(r), ckpts, first=0, dp=2)
    turn = [(core.plan_step(), core.delta()) for _ in range(3)]  # the state before step 2 is a snapshot
    with pytest.raises(ValueError, match="snapshot"):
        publisher.publish_turn(turn, core.state, publisher.bound())
    assert r.get(KEYS.plan(0)) is None and not plans_stream(r)
    with pytest.raises(ValueError, match="at least one"):
        publisher.publish_turn([], core.state, publisher.bound())


def test_a_turn_waits_for_room_for_half_the_look_ahead():
    assert [turn_steps(a) for a in (1, 2, 3, 4, 8)] == [1, 1, 1, 2, 4]
    bound = Bound(slowest=9, consumed=5)  # trainers bind: steps up to 5 + 4 may be planned
    assert [bound.room(s, 4) for s in (6, 8, 9, 10, 12)] == [4, 2, 1, 0, 0]
    assert Bound(slowest=3, consumed=5).room(6, 4) == 2  # the slowest constructor binds
    # waiting for room for a turn keeps at least plan_ahead - turn + 1 plans in front of the trainers
    for plan_ahead in range(1, 9):
        assert plan_ahead - turn_steps(plan_ahead) + 1 >= (plan_ahead + 1) // 2


def rise(r, built: dict[int, int] | None = None, consumed: dict[int, int] | None = None) -> None:
    """Move the marks as the Data Constructors and their MarkWatch threads do: the
    `progress` field and a `progressed` entry carrying its new value."""
    pipe = r.pipeline(transaction=False)
    for dp, step in (built or {}).items():
        pipe.hset(KEYS.progress, built_field(dp), step)
        pipe.xadd(KEYS.progressed, built_entry(dp, step))
    for dp, mark in (consumed or {}).items():
        pipe.hset(KEYS.progress, consumed_field(dp), mark)
        pipe.xadd(KEYS.progressed, consumed_entry(dp, mark))
    pipe.execute()


def test_the_bound_follows_the_trainers_and_the_slowest_constructor(r):
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=0, dp=2)
    plan_ahead = 2
    # nothing consumed or built yet: the constructors stand before the first step (-1)
    bound = publisher.bound()
    assert bound == Bound(slowest=-1, consumed=0)
    assert [s for s in range(6) if bound.room(s, plan_ahead) > 0] == [0, 1]
    # constructors built up to step 5; trainers of group 0 consumed step 3, group 1 step 1
    rise(r, built={0: 5, 1: 5}, consumed={0: 4, 1: 2})
    publisher.wait(1)
    bound = publisher.bound()
    assert bound == Bound(slowest=5, consumed=1)
    assert [s for s in range(8) if bound.room(s, plan_ahead) > 0] == [0, 1, 2, 3]
    # a slow constructor holds the Planner back as well
    rise(r, built={1: 2}, consumed={1: 9})
    publisher.wait(1)
    assert [s for s in range(10) if publisher.bound().room(s, plan_ahead) > 0] == [0, 1, 2, 3, 4]


def test_the_marks_come_from_the_entries_not_a_read_of_the_hash_per_step(r):
    """Per step the Planner reads the `progressed` entries it waits on, and the bound
    from their values: the `progress` hash only when it starts, or after a quiet second."""
    rise(r, built={0: 3, 1: 3}, consumed={0: 2, 1: 2})  # before this Planner leads
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=0, dp=2)
    assert publisher.bound() == Bound(slowest=3, consumed=1)
    before = r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    for step in range(4, 30):
        rise(r, built={0: step, 1: step}, consumed={0: step - 1, 1: step - 1})
        publisher.wait(1000)  # returns at once: the entries are there
        assert publisher.bound() == Bound(slowest=step, consumed=step - 2)
    assert r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0) == before
    # an entry without its value (a writer that does not carry it): the hash is read
    r.hset(KEYS.progress, built_field(0), 40)
    r.xadd(KEYS.progressed, {"c": 0})
    publisher.wait(1000)
    assert publisher.bound() == Bound(slowest=29, consumed=27)
    # and a quiet second: read again (a backstop for an entry trimmed away)
    r.hset(KEYS.progress, built_field(1), 41)
    publisher.marks_read -= MARKS_REFRESH_S
    assert publisher.bound() == Bound(slowest=40, consumed=27)


def test_a_resumed_job_starts_its_bound_at_the_resume_step(r):
    r.hset(KEYS.resume, "step", 40)
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=40, dp=2)
    bound = publisher.bound()
    assert bound == Bound(slowest=39, consumed=40)  # no group consumed or built since the resume
    assert [s for s in range(38, 46) if bound.room(s, 2) > 0] == [38, 39, 40, 41]


def test_plans_far_behind_the_slowest_constructor_are_deleted(r):
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=0, dp=2)
    core = fed_core()
    for s in range(3):
        r.set(KEYS.plan(s), "old")  # published earlier
    core.step = 3
    plan = core.plan_step()
    slowest = PLAN_KEEP_STEPS + 1  # steps 0 and 1 are more than PLAN_KEEP_STEPS behind it
    publisher.publish_turn([(plan, core.delta())], core.state, Bound(slowest=slowest, consumed=slowest))
    assert r.get(KEYS.plan(0)) is None and r.get(KEYS.plan(1)) is None and r.get(KEYS.plan(2)) == b"old"
    assert Plan.decode(r.get(KEYS.plan(3))).step == 3 and publisher.pruned == 2 < PRUNE_MAX


def test_a_published_step_is_marked_durable_once_the_server_fsynced_it(r):
    """The embedded server keeps an append-only file: about once a second a step waits
    for WAITAOF (the server's next fsync) and the `planner` hash says which step is
    durable and how long that wait took; the steps between wait for no fsync."""
    core = fed_core()
    publisher = Publisher(r, KEYS, leading(r), Checkpoints(KEYS), first=0, dp=2)
    assert publisher.durable.want.local == 1 and publisher.durable.want.replicas == 0
    publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert int(r.hget(KEYS.planner, "durable")) == 0  # the first step waits
    publisher.fsynced_at = time.monotonic()  # the next step comes within the second (however long that fsync took)
    publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert int(r.hget(KEYS.planner, "durable")) == 0  # within the second: no fsync waited for
    publisher.fsynced_at -= FSYNC_EVERY_S  # a second later
    publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert int(r.hget(KEYS.planner, "durable")) == 2
    assert float(r.hget(KEYS.planner, "durable_ms")) > 0


def test_a_superseded_planner_marks_nothing_durable(r):
    # the plan and its durability marker are one fenced script: a Planner deposed after
    # one step went out neither writes the next nor moves the marker
    core = fed_core()
    lease = leading(r)
    publisher = Publisher(r, KEYS, lease, Checkpoints(KEYS), first=0, dp=2)
    publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert int(r.hget(KEYS.planner, "durable")) == 0
    r.set(KEYS.leader, b"another")  # the lease changed hands after the plan went out
    publisher.fsynced_at -= FSYNC_EVERY_S  # the next step would wait for an fsync and mark it
    with pytest.raises(Superseded):
        publisher.publish_turn([(core.plan_step(), core.delta())], core.state, publisher.bound())
    assert int(r.hget(KEYS.planner, "durable")) == 0
    assert r.get(KEYS.plan(1)) is None


def test_the_settle_of_a_planner_short_of_a_turn_lasts_until_the_steps_it_lacks_are_due():
    now = [100.0]
    pace = Pace(clock=lambda: now[0])
    assert pace.settle_s(2) == Pace.LEAST_S  # nothing seen move yet
    consumed = 4
    pace.saw(Bound(slowest=9, consumed=consumed))
    for _ in range(20):  # the bound moves a step every 20 ms
        now[0] += 0.01
        pace.saw(Bound(slowest=99, consumed=consumed))  # seen again without moving: no step
        now[0] += 0.01
        consumed += 1
        pace.saw(Bound(slowest=99, consumed=consumed))
    assert abs(pace.settle_s(1) - 0.02) < 1e-9 and abs(pace.settle_s(2) - 0.04) < 1e-9
    now[0] += 0.015  # counted from when the bound last moved
    assert abs(pace.settle_s(1) - 0.005) < 1e-9
    now[0] += 0.01  # overdue: a short look, then `progressed` is read
    assert pace.settle_s(1) == Pace.LEAST_S
    for _ in range(30):  # a training step's pace (2 s): the most, so the loop's checks run between
        now[0] += 2.0
        pace.saw(Bound(slowest=99, consumed=pace._seen[1] + 1))
    assert pace.settle_s(1) == Pace.MOST_S
    for _ in range(60):  # two steps at once every 0.2 ms: the least
        now[0] += 0.0002
        pace.saw(Bound(slowest=999, consumed=pace._seen[1] + 2))
    assert pace.settle_s(2) == Pace.LEAST_S
    step_s = pace.step_s
    now[0] += 50.0  # a rewind: the bound goes back, and the time before it is no step
    pace.saw(Bound(slowest=999, consumed=3))
    assert pace.step_s == step_s
    now[0] += 0.0001
    pace.saw(Bound(slowest=3, consumed=10))  # the slower of the two marks is the bound
    assert pace.step_s == step_s
