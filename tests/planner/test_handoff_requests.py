"""The Planner's handoffs against a real redis-server: requests taken at a step boundary
(or refused, with why), stamped on the plans, and recovered by the next Planner from
the last published plan."""

from __future__ import annotations

import threading

import numpy as np

from overlord.plan.step_plan import Plan
from overlord.planner.handoff import Handoffs
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease
from overlord.store import Keys
from overlord.store.schema import log_entries

KEYS = Keys("j")
LAYOUT = Layout(
    streams=["web.0", "web.1", "img.0", "img.1"],
    stream_source=[0, 0, 1, 1],
    loader_of=[0, 1, 2, 2],
    loaders=3,
    constructor_hosts=1,
    constructor_of=[0],
    shadowed=[2],  # img has Shadow Loaders, on process 2 only
)


def handoffs(r) -> Handoffs:
    """A Planner's handoffs under a lease of its own (a previous one's lease lapsed)."""
    r.delete(KEYS.leader)
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    h = Handoffs(r, KEYS, lease, LAYOUT)
    h.next_look = 0.0
    return h


def test_requests_are_taken_at_a_step_boundary_or_refused_with_why(r):
    h = handoffs(r)
    r.hset(KEYS.handoff, mapping={"web.0": 1, "img.0": 0, "nosuch.0": 1, "web.1": 7})
    h.look(step=5, first=5)  # the Planner's first step: the checkpoint before it may not be its own
    assert h.serving == [0, 1, 2, 2] and r.hlen(KEYS.handoff) == 4
    h.look(step=6, first=5)
    assert h.serving == [1, 1, 2, 2]  # plan 6 carries it
    assert r.hlen(KEYS.handoff) == 4 and not r.exists(KEYS.handoffs)  # logged once plan 6 is out
    h.next_look = 0.0
    h.look(step=6, first=5)  # a request taken is not taken twice
    h.published()
    assert r.hlen(KEYS.handoff) == 0 and r.xlen(KEYS.handoffs) == 4
    log = {e["stream"]: e for e in log_entries(r.xrange(KEYS.handoffs))}
    assert (log["web.0"]["step"], log["web.0"]["from"], log["web.0"]["to"]) == ("6", "0", "1")
    assert "Shadow Loaders and loader process 0 has none" in log["img.0"]["reason"]
    assert "no stream 'nosuch.0'" in log["nosuch.0"]["reason"] and "no loader process 7" in log["web.1"]["reason"]
    plan = h.stamp(Plan(step=6))
    assert plan.owners is not None and plan.owners.tolist() == [[0, 1]]
    assert h.stamp(Plan(step=6)).loader_of(LAYOUT.loader_of) == [1, 1, 2, 2]


def test_a_planner_taking_over_serves_streams_where_the_last_plan_did(r):
    h = handoffs(r)
    r.hset(KEYS.handoff, "web.1", 0)
    h.look(step=3, first=0)
    r.set(KEYS.plan(3), h.stamp(Plan(step=3)).encode())
    h.published()
    after = handoffs(r)
    after.recover(4)
    assert after.serving == [0, 0, 2, 2]
    # a plan whose handoffs this layout cannot hold (a resume with fewer processes): they lapse
    r.set(KEYS.plan(3), Plan(step=3, owners=np.asarray([[1, 9], [2, 0]])).encode())
    lapsed = handoffs(r)
    lapsed.recover(4)
    assert lapsed.serving == LAYOUT.loader_of
