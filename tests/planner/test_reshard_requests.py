"""The Planner's reshards against a real redis-server: requests taken at a step boundary
(not before the step they name) or refused with why, made between two steps, logged
and deleted once their plans are out, and the controllers that follow the streams."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from planner_helpers import chunk

from overlord.config import Job, Mesh, Source
from overlord.plan.core import PlannerCore
from overlord.plan.step_plan import Plan
from overlord.plan.tree import ClientPlaceTree
from overlord.planner.handoff import Handoffs
from overlord.planner.request import request_handoff, request_reshard
from overlord.planner.reshard import Reshards, parse_request, spread
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease, Superseded
from overlord.runtime.reshard import RETIRED
from overlord.store import Keys
from overlord.store.schema import log_entries

KEYS = Keys("j")
LAYOUT = Layout(
    streams=["web.0", "web.1", "img.0"],
    stream_source=[0, 0, 1],
    loader_of=[0, 1, 1],
    loaders=2,
    constructor_hosts=1,
    constructor_of=[0],
    shadowed=[1],
)


def _job(tmp_path) -> Job:
    return Job(
        name="j",
        sources=(
            Source(name="web", paths=(str(tmp_path / "w.parquet"),), partitions=2),
            Source(name="img", paths=(str(tmp_path / "i.parquet"),), shadow=True),
        ),
        mesh=Mesh(dp=2),
    )


def _lease(r) -> Lease:
    r.delete(KEYS.leader)
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    return lease


def _core() -> PlannerCore:
    core = PlannerCore(
        streams=list(LAYOUT.streams),
        stream_source=list(LAYOUT.stream_source),
        weights=[1.0, 1.0],
        seed=3,
        global_batch=8,
        micro_batches=2,
        finite=False,
        tree=ClientPlaceTree(Mesh(dp=2)),
    )
    for i in range(3):
        core.add(i, chunk(range(200)))
    return core


def test_requests_are_made_between_two_steps_or_refused_with_why(r, tmp_path):
    lease = _lease(r)
    reshards = Reshards(r, KEYS, lease, _job(tmp_path))
    handoffs = Handoffs(r, KEYS, lease, LAYOUT)
    r.hset(KEYS.reshard, mapping={"web": "3@4", "nosuch": "2", "web2": "x"})
    reshards.next_look = 0.0
    reshards.look()
    assert [p[1:] for p in reshards.pending] == [("web", 3, 4, "requested")]  # the others refused
    core, layout = _core(), LAYOUT
    for _ in range(3):
        core.plan_step()
        layout = reshards.make(core, layout, handoffs.serving)
    assert layout is LAYOUT and core.step == 3  # not before step 4
    core.plan_step()
    grown = reshards.make(core, layout, handoffs.serving)
    (record,) = core.reshards
    assert record.step == 4 and record.streams == ("web.r1p0", "web.r1p1", "web.r1p2")
    # the new streams start where the fewest live streams are (img.0 on process 1; web's
    # retired streams do not count): 0, then a tie at one each (the lower index), then 1
    assert record.homes == (0, 0, 1)
    assert grown.streams[3:] == list(record.streams) and grown.loader_of[:2] == [RETIRED, RETIRED]
    handoffs.grow(grown)
    assert handoffs.serving == [RETIRED, RETIRED, 1, 0, 0, 1]
    assert not handoffs.allowed(0, 1)  # a retired stream is handed to nobody
    assert handoffs.stamp(Plan(step=4), len(core.reshards)).generation == 1
    assert r.hlen(KEYS.reshard) == 3 and not r.exists(KEYS.reshards)  # logged once the plans are out
    reshards.published()
    assert r.hlen(KEYS.reshard) == 0
    log = {e["source"]: e for e in log_entries(r.xrange(KEYS.reshards))}
    assert (log["web"]["step"], log["web"]["from"], log["web"]["to"]) == ("4", "2", "3")
    assert log["web"]["streams"] == "web.r1p0,web.r1p1,web.r1p2"
    assert "no source 'nosuch'" in log["nosuch"]["reason"]
    assert "'x' is not PARTITIONS or PARTITIONS@STEP" in log["web2"]["reason"]
    assert all(log[n]["to"] == "-1" for n in ("nosuch", "web2"))


def test_a_source_with_shadow_loaders_gets_its_new_streams_where_a_standby_follows_them(r, tmp_path):
    # img has Shadow Loaders: its streams live on process 1 (the one with a standby), even
    # though process 0 serves fewer streams; web's go where the fewest are, as before
    reshards = Reshards(r, KEYS, _lease(r), _job(tmp_path))
    r.hset(KEYS.reshard, mapping={"img": "3"})
    reshards.next_look = 0.0
    reshards.look()
    core = _core()
    core.plan_step()
    grown = reshards.make(core, LAYOUT, list(LAYOUT.loader_of))
    (record,) = core.reshards
    assert record.streams == ("img.r1p0", "img.r1p1", "img.r1p2") and record.homes == (1, 1, 1)
    assert grown.loader_of[3:] == [1, 1, 1] and grown.shadowed == [1]
    r.hset(KEYS.reshard, mapping={"web": "3"})
    reshards.next_look = 0.0
    reshards.look()
    core.plan_step()
    grown = reshards.make(core, grown, list(grown.loader_of))
    assert core.reshards[1].homes == (0, 0, 0)
    reshards.request("img", 2, core.step, "autoscaler: the schedule")  # the autoscaler's: the same homes
    core.plan_step()
    grown = reshards.make(core, grown, list(grown.loader_of))
    assert core.reshards[2].streams == ("img.r3p0", "img.r3p1") and core.reshards[2].homes == (1, 1)
    reshards.published()
    log = [(e["source"], e["from"], e["to"], e["reason"]) for e in log_entries(r.xrange(KEYS.reshards))]
    assert log == [
        ("img", "1", "3", "requested"),
        ("web", "2", "3", "requested"),
        ("img", "3", "2", "autoscaler: the schedule"),
    ], log


def test_a_request_for_the_streams_it_has_changes_nothing(r, tmp_path):
    reshards = Reshards(r, KEYS, _lease(r), _job(tmp_path))
    r.hset(KEYS.reshard, "web", "2")
    reshards.next_look = 0.0
    reshards.look()
    core = _core()
    core.plan_step()
    assert reshards.make(core, LAYOUT, list(LAYOUT.loader_of)) is LAYOUT and not core.reshards
    reshards.published()
    (entry,) = log_entries(r.xrange(KEYS.reshards))
    assert entry["to"] == "2" and entry["streams"] == "" and entry["reason"] == "read by as many already"


def test_a_deposed_planner_logs_nothing_and_leaves_the_request(r, tmp_path):
    lease = _lease(r)
    reshards = Reshards(r, KEYS, lease, _job(tmp_path))
    r.hset(KEYS.reshard, "web", "1")
    reshards.next_look = 0.0
    reshards.look()
    core = _core()
    core.plan_step()
    reshards.make(core, LAYOUT, list(LAYOUT.loader_of))
    _lease(r)  # another Planner took the lease
    with pytest.raises(Superseded):
        reshards.published()
    assert r.hget(KEYS.reshard, "web") == b"1" and not r.exists(KEYS.reshards)


def test_parse_and_spread():
    assert parse_request("4") == (4, 0) and parse_request("4@100") == (4, 100)
    assert parse_request("four")[0] is None and parse_request("4@x")[0] is None
    # two live streams on process 0, one on 1 (stream 3 leaves): 1, 1, 0, then 1 and 0 alternate
    assert spread([0, 0, 1, 1, RETIRED], {3}, 2, 4) == [1, 0, 1, 0]
    assert spread([0, 1], set(), 3, 2) == [2, 0]
    assert spread([0, 1, 1], set(), 3, 3, among=[1]) == [1, 1, 1]
    assert spread([0, 1, 1, 2], {0}, 3, 3, among=[2, 0]) == [0, 0, 2]


def test_intake_reads_the_new_streams_and_not_the_retired(r, tmp_path):
    from overlord.plan import meta
    from overlord.planner.intake import Intake

    lease = _lease(r)
    intake = Intake(r, KEYS, LAYOUT, lease, 1, timeout_s=5, run_dir=tmp_path)
    record = dataclasses.replace(_core().reshard(0, "web", [0, 1]))
    intake.grow(LAYOUT.grown([record]))
    r.xadd(KEYS.meta("web.0"), meta.encode(chunk(range(3), token=1)))
    r.xadd(KEYS.meta("web.r1p1"), meta.encode(chunk(range(5), token=1)))
    got = intake.read({}, block_ms=100)
    assert [(i, len(c)) for i, c in got] == [(4, 5)]


def test_the_autoscalers_reshard_goes_first_and_is_logged_with_why(r, tmp_path):
    reshards = Reshards(r, KEYS, _lease(r), _job(tmp_path))
    r.hset(KEYS.reshard, "web", "3")
    reshards.next_look = 0.0
    reshards.look()
    core = _core()
    core.plan_step()
    reshards.request("web", 1, 1, "autoscaler: the mixing schedule ...")
    layout = reshards.make(core, LAYOUT, list(LAYOUT.loader_of))
    assert core.reshards[0].partitions == 1 and core.reshards[0].step == 1
    assert [p[1:3] for p in reshards.pending] == [("web", 3)]
    reshards.published()
    (entry,) = log_entries(r.xrange(KEYS.reshards))
    assert entry["reason"].startswith("autoscaler:") and entry["to"] == "1"
    assert r.hget(KEYS.reshard, "web") == b"3"  # not taken yet: still requested
    assert layout.generation == 1


def test_past_the_most_a_plan_counts_a_request_is_refused(r, tmp_path, monkeypatch):
    from overlord.planner import reshard as module

    monkeypatch.setattr(module, "MOST_RESHARDS", 1)
    reshards = Reshards(r, KEYS, _lease(r), _job(tmp_path))
    core = _core()
    core.plan_step()
    reshards.request("web", 1, 1, "autoscaler: one")
    layout = reshards.make(core, LAYOUT, list(LAYOUT.loader_of))
    core.add(3, chunk(range(200)))  # the new stream's first reports
    assert core.plan_step() is not None
    reshards.request("web", 2, 2, "autoscaler: two")
    assert reshards.make(core, layout, list(layout.loader_of)) is layout and len(core.reshards) == 1
    reshards.published()
    assert "the most a plan's header counts" in log_entries(r.xrange(KEYS.reshards))[-1]["reason"], log_entries(
        r.xrange(KEYS.reshards)
    )


def test_a_request_after_the_last_step_is_answered_at_once_and_not_left_behind(r):
    r.delete(KEYS.reshard, KEYS.handoff, KEYS.planner)
    r.hset(KEYS.planner, mapping={"step": 41, "done": 1})
    started = time.monotonic()
    code, message = request_reshard(r, KEYS, "web", 3, timeout_s=30)
    assert code == 1 and "planned its last step" in message, message
    code, message = request_handoff(r, KEYS, "web.0", 1, timeout_s=30)
    assert code == 1 and "planned its last step" in message, message
    assert time.monotonic() - started < 5  # not the 30 s a request waits for a Planner
    assert not r.exists(KEYS.reshard) and not r.exists(KEYS.handoff)  # nothing stays for a later run
