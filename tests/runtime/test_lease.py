"""Planner leadership against a real redis-server: one leader, fenced writes, takeover,
and differential checkpoints read back through Redis."""

from __future__ import annotations

import threading
import time

import pytest

from overlord.plan.checkpoint import Checkpoints
from overlord.runtime.lease import Lease, Superseded, holder, release_dead
from overlord.store import Keys


def test_a_paused_leader_whose_lease_lapsed_cannot_write(r):
    keys, stop = Keys("j"), threading.Event()
    old = Lease(r, keys, node="a", ttl_s=30)
    first = old.acquire(stop)
    old.fenced(lambda pipe: pipe.set("overlord:{j}:x", "old"))
    r.pexpire(keys.leader, 1)  # paused past its lease (a long GC pause, a stopped VM): it runs out
    deadline = time.monotonic() + 5  # (a lease of 0.2 s could run out before the first write on a busy machine)
    while r.exists(keys.leader):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    new = Lease(r, keys, node="b", ttl_s=5)
    second = new.acquire(stop)
    assert second > first
    with pytest.raises(Superseded):
        old.fenced(lambda pipe: pipe.set("overlord:{j}:x", "stale"))
    new.fenced(lambda pipe: pipe.set("overlord:{j}:x", "new"))
    assert r.get("overlord:{j}:x") == b"new"
    assert not old.renew() and old.lost.is_set()
    assert new.renew()


def test_a_standby_waits_until_the_lease_is_free(r):
    keys, stop = Keys("j"), threading.Event()
    leader = Lease(r, keys, ttl_s=5)
    leader.acquire(stop)
    got = []
    standby = Lease(r, keys, ttl_s=5)
    t = threading.Thread(target=lambda: got.append(standby.acquire(stop)))
    t.start()
    time.sleep(0.3)
    assert not got, "the standby must not lead while the leader's lease holds"
    import os

    assert release_dead(r, keys, os.getpid(), leader.node)  # the sidecar saw it die
    t.join(timeout=5)
    assert got and holder(r, keys)["token"] == got[0]


def test_checkpoints_rebuild_any_kept_step_from_snapshots_and_deltas(r):
    keys = Keys("j")
    ckpts = Checkpoints(keys, every=4, keep=8)
    state = {
        "step": 0,
        "cursors": {"a.0": [0, -1], "b.0": [0, -1]},
        "round_robin": [0, 0],
        "deferred": [],
        "schedule": None,
        "done": False,
    }
    states = [state]
    pipe = r.pipeline()
    ckpts.write(pipe, 0, None, lambda: state)
    for step in range(1, 30):
        delta = {
            "step": step,
            "cursors": {"a.0": [0, step]} if step % 2 else {"b.0": [0, step]},
            "round_robin": {"0": step},
            "deferred": [],
            "schedule": None,
            "done": False,
        }
        state = {**state, "step": step, "cursors": {**state["cursors"], **delta["cursors"]}, "round_robin": [step, 0]}
        states.append(state)
        ckpts.write(pipe, step, delta, lambda s=state: s)
    pipe.execute()
    kept = ckpts.steps(r)
    assert kept[-1] == 29 and kept[0] >= 29 - 8 - 4  # old snapshots and their deltas trimmed
    for step in kept:
        assert ckpts.load(r, step) == states[step]


def test_a_planner_started_for_another_run_of_the_job_never_takes_the_lease(r):
    """A Planner of a node cut off while the job was published again without it (a
    rewind) would lead the new run from the old run's newest checkpoint: the lease is
    taken only while the job's `run` token is the one the Planner was started for."""
    keys, stop = Keys("j"), threading.Event()
    r.set(keys.run, b"new-run")
    stale = Lease(r, keys, node="n1", ttl_s=5, run=b"old-run")
    with pytest.raises(Superseded, match="published again"):
        stale.acquire(stop)
    assert r.get(keys.leader) is None
    current = Lease(r, keys, node="n0", ttl_s=5, run=b"new-run")
    assert current.acquire(stop) == holder(r, keys)["token"]
