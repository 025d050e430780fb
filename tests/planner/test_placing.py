"""Placing against a real redis-server: a node whose sidecar dies hands its units to a
live node and gets them back when it returns; a node over its budget for a few looks
hands a loader process off."""

from __future__ import annotations

import json
import threading

from overlord.planner.placing import PATIENCE, Placer
from overlord.runtime.lease import Lease
from overlord.store import Keys

KEYS = Keys("j")
HOME = {"loader0": "a", "loader1": "b", "loader2": "a", "constructor0": "a", "constructor1": "b"}


def placer(r) -> Placer:
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    return Placer(r, KEYS, lease, HOME, ("a", "b"), check_s=0, capacity_s=0)


def register(r, node: str, **budget) -> None:
    r.hset(KEYS.nodes, node, json.dumps({"cpus": 4, **budget}))
    r.set(KEYS.heartbeat("sidecar", node), json.dumps({"pid": 1, "node": node}), ex=5)


def placement(r) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(KEYS.placement).items()}


def moves(r) -> list[tuple[str, str, str, str]]:
    return [tuple(f[x].decode() for x in (b"unit", b"from", b"to", b"reason")) for _, f in r.xrange(KEYS.placements)]


def test_a_dead_nodes_units_move_and_come_home(r):
    p = placer(r)
    register(r, "a")
    register(r, "b")
    assert p.check() is None  # no demand given: the membership alone, no look at the load
    assert placement(r) == HOME
    r.delete(KEYS.heartbeat("sidecar", "b"))  # b's sidecar died
    p.check()
    assert placement(r) == {**HOME, "loader1": "a", "constructor1": "a"}
    assert moves(r)[-2:] == [("loader1", "b", "a", "node b down"), ("constructor1", "b", "a", "node b down")]
    register(r, "b")  # back
    p.check()
    assert placement(r) == HOME and moves(r)[-1][3] == "home"


def test_a_node_over_its_budget_hands_a_loader_off(r):
    p = placer(r)
    register(r, "a", loader_cpus=2)
    register(r, "b", loader_cpus=8)
    demand = {"loader0": 2.0, "loader1": 1.0, "loader2": 2.0}  # a: 4 CPUs of 2, b: 1 of 8
    for look in range(PATIENCE):
        assert p.check(demand) == 10.0  # the live nodes' loader CPUs
        assert json.loads(r.hget(KEYS.planner, "node_pressure")) == {"a": 2.0, "b": 0.125}
        moved = placement(r) != HOME
        assert moved == (look == PATIENCE - 1), "a loader moves only after PATIENCE looks over budget"
    after = placement(r)
    (unit,) = [u for u in HOME if after[u] != HOME[u]]
    assert unit in ("loader0", "loader2") and after[unit] == "b"
    assert moves(r)[-1][3].startswith("a over budget")
