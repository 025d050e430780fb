"""MarkWatch: the trainers' mark of a DP group, from real rings into a real Redis; and
Owner, the fence on every write of a group's marks."""

import threading
import time
import uuid

import numpy as np
import pytest
import redis

from overlord.config import Job, Mesh, Source
from overlord.constructor.marks import MarkWatch, Owner, Superseded
from overlord.runtime.layout import client_ring
from overlord.shm import Ring, unlink_all, write_batch
from overlord.store import EmbeddedRedis, Keys, connect
from overlord.store.schema import built_entry, progressed_mark


@pytest.fixture
def setup(tmp_path):
    job = Job(
        name=f"m{uuid.uuid4().hex[:8]}",
        sources=(Source(name="x", paths=("/dev/null",)),),
        mesh=Mesh(dp=1, tp=2),
        run_dir=str(tmp_path / "run"),
        timeout_s=5.0,
    )
    server = EmbeddedRedis(tmp_path / "redis").start()
    rings = {rank: Ring.create(client_ring(job, rank), 1 << 16) for rank in (0, 1)}
    try:
        yield job, connect(server.url), Keys(job.name), rings
    finally:
        for ring in rings.values():
            ring.close()
        unlink_all(job.name)
        server.stop()


def owner(r, keys, dp=0):
    """A Data Constructor's claim on group `dp`, as a first start takes it."""
    claim = Owner(r, keys, dp)
    claim.claim()
    return claim


def published(r, keys, until, timeout=5.0):
    """The group's published mark once `until(mark)` holds (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        raw = r.hget(keys.progress, "t0")
        mark = int(raw) if raw is not None else None
        if until(mark) or time.monotonic() > deadline:
            return mark
        time.sleep(0.005)


def test_the_least_mark_of_the_group_is_published_when_it_rises_and_never_goes_down(setup):
    job, r, keys, rings = setup
    outputs, written = dict(rings), {}
    watch = MarkWatch(job, 0, r, keys, outputs, written, owner(r, keys)).start()
    try:
        rings[0].set_consumer_mark(5)  # rank 1 consumed nothing yet: the group has not either
        time.sleep(0.05)
        assert r.hget(keys.progress, "t0") is None and r.xlen(keys.progressed) == 0
        rings[1].set_consumer_mark(3)
        assert published(r, keys, lambda m: m == 3) == 3
        rings[1].set_consumer_mark(7)
        assert published(r, keys, lambda m: m == 5) == 5  # rank 0 is the slower now
        entries = r.xlen(keys.progressed)
        rings[0].set_consumer_mark(2)  # a mark going back (a ring served from elsewhere) is not published
        time.sleep(0.05)
        assert r.hget(keys.progress, "t0") == b"5" and r.xlen(keys.progressed) == entries
        del outputs[0]  # rank 0's trainer left: it no longer holds the group back
        assert published(r, keys, lambda m: m == 7) == 7
    finally:
        watch.stop()


def test_a_ring_read_to_the_end_counts_as_consumed_without_a_mark(setup):
    job, r, keys, rings = setup
    consumer = Ring.attach(client_ring(job, 0), timeout=5)
    watch = MarkWatch(job, 0, r, keys, {0: rings[0]}, written := {}, owner(r, keys)).start()
    try:
        write_batch(rings[0], {"x": np.arange(4)}, meta={"step": 9, "microbatch": 0}, timeout=5)
        written[0] = 9
        time.sleep(0.05)
        assert r.hget(keys.progress, "t0") is None  # written, not read: nothing consumed
        consumer.read(timeout=5)
        consumer.release()  # a client that sets no mark read it: the job goes on step by step
        assert published(r, keys, lambda m: m == 10) == 10
    finally:
        watch.stop()
        consumer.close()


def test_a_restarted_watch_starts_from_what_redis_holds(setup):
    job, r, keys, rings = setup
    r.hset(keys.progress, "t0", 40)
    for ring in rings.values():
        ring.set_consumer_mark(12)  # e.g. rings a moved Data Constructor found on its new node
    watch = MarkWatch(job, 0, r, keys, dict(rings), {}, owner(r, keys)).start()
    try:
        assert watch.published == 40
        time.sleep(0.05)
        assert r.hget(keys.progress, "t0") == b"40"
        for ring in rings.values():
            ring.set_consumer_mark(41)
        assert published(r, keys, lambda m: m == 41) == 41
    finally:
        watch.stop()


def test_a_superseded_constructor_writes_no_mark_and_its_watch_publishes_none(setup):
    """A Data Constructor cut off while its group restarted elsewhere comes back: its
    built mark must not land over its successor's (a c<dp> too high hides the steps the
    successor has yet to build from the loaders' replay), nor its trainers' mark."""
    job, r, keys, rings = setup
    old = owner(r, keys)
    old.write("c0", 6, entry=built_entry(0, 6))
    new = owner(r, keys)  # the group's restart on another node claims it
    new.write("c0", 3, entry=built_entry(0, 3))
    entries = r.xlen(keys.progressed)
    with pytest.raises(Superseded, match="dp=0"):
        old.write("c0", 7, entry=built_entry(0, 7))
    pipe = r.pipeline(transaction=False)
    old.write("c0", 8, entry=built_entry(0, 8), client=pipe)  # queued: refused on the server all the same
    assert pipe.execute() == [0]
    assert r.hget(keys.progress, "c0") == b"3" and r.xlen(keys.progressed) == entries
    assert progressed_mark(r.xrevrange(keys.progressed, count=1)[0][1]) == ("c0", 3)
    for ring in rings.values():
        ring.set_consumer_mark(9)
    stale = MarkWatch(job, 0, r, keys, dict(rings), {}, old).start()
    try:
        assert stale.ended.wait(5)  # it stopped at its first refused write
        assert r.hget(keys.progress, "t0") is None, "a superseded watch published its trainers' mark"
    finally:
        stale.stop()
    watch = MarkWatch(job, 0, r, keys, dict(rings), {}, new).start()
    try:
        assert published(r, keys, lambda m: m == 9) == 9
    finally:
        watch.stop()


def test_a_watch_whose_trainers_read_nothing_still_learns_it_was_superseded(setup):
    """A host cut off while its group moved elsewhere comes back to trainers that read
    from the group's new home: its rings' marks never move, so it writes nothing to be
    refused; its watch reads the group's owner (every OWNER_CHECK_S) and says so, and
    a watch still owning its group says nothing."""
    job, r, keys, rings = setup
    told, kept = threading.Event(), threading.Event()
    stale = MarkWatch(job, 0, r, keys, dict(rings), {}, owner(r, keys), on_superseded=told.set).start()
    try:
        owner(r, keys)  # the group's restart on another node claims it
        assert told.wait(5.0), "a superseded watch never told its host"
        assert stale.ended.is_set() and r.hget(keys.progress, "t0") is None
    finally:
        stale.stop()
    mine = MarkWatch(job, 0, r, keys, dict(rings), {}, owner(r, keys), on_superseded=kept.set).start()
    try:
        assert not kept.wait(2.5) and not mine.ended.is_set()  # two reads of its owner: still its own
    finally:
        mine.stop()


def test_a_queued_mark_costs_no_script_exists_and_a_lost_script_is_told(setup):
    """The built mark rides the constructor's pipeline each step as a bare EVALSHA (a
    script object there made redis-py ask SCRIPT EXISTS before every execute); a server
    that lost its scripts answers NOSCRIPT, and a direct write loads the script again."""
    job, r, keys, rings = setup
    claim = owner(r, keys)
    claim.write("c0", 1, entry=built_entry(0, 1))  # loads the script
    exists = r.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)
    pipe = r.pipeline(transaction=False)
    claim.write("c0", 2, entry=built_entry(0, 2), client=pipe)
    assert pipe.execute() == [1] and r.hget(keys.progress, "c0") == b"2"
    assert r.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0) == exists
    r.script_flush()  # a restarted server, or a promoted replica that never loaded it
    pipe = r.pipeline(transaction=False)
    claim.write("c0", 3, entry=built_entry(0, 3), client=pipe)
    with pytest.raises(redis.exceptions.NoScriptError):
        pipe.execute()
    claim.write("c0", 3, entry=built_entry(0, 3))
    assert r.hget(keys.progress, "c0") == b"3"


def _marks_threads():
    return [t for t in threading.enumerate() if t.name == "marks"]


def test_the_groups_of_a_process_share_one_poller_that_ends_with_the_last(setup):
    """A constructor host runs several groups: one thread looks at all their marks (a
    thread each woke 500 times a second per group); a group stopped or superseded
    leaves the others published, and the thread ends with the last watch."""
    job, r, keys, rings = setup
    group = {dp: MarkWatch(job, dp, r, keys, {dp: rings[dp]}, {}, owner(r, keys, dp)).start() for dp in (0, 1)}
    try:
        assert len(_marks_threads()) == 1
        rings[0].set_consumer_mark(4)
        rings[1].set_consumer_mark(6)
        assert published(r, keys, lambda m: m == 4) == 4
        deadline = time.monotonic() + 5
        while r.hget(keys.progress, "t1") != b"6" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert r.hget(keys.progress, "t1") == b"6"
        owner(r, keys, 1)  # group 1 restarted elsewhere: its watch here ends at its next write
        rings[1].set_consumer_mark(8)
        deadline = time.monotonic() + 5
        while not group[1].ended.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert group[1].ended.is_set() and r.hget(keys.progress, "t1") == b"6"
        rings[0].set_consumer_mark(9)  # the other group is still published
        assert published(r, keys, lambda m: m == 9) == 9
        group[0].stop()
        assert group[0].rings == {}  # its mappings are closed once stopped
        deadline = time.monotonic() + 5
        while _marks_threads() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not _marks_threads(), "the poller outlived every watch"
    finally:
        for watch in group.values():
            watch.stop()
    again = MarkWatch(job, 0, r, keys, {0: rings[0]}, {}, owner(r, keys)).start()
    try:
        assert len(_marks_threads()) == 1  # a later watch starts a thread again
        rings[0].set_consumer_mark(11)
        assert published(r, keys, lambda m: m == 11) == 11
    finally:
        again.stop()
