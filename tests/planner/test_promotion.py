"""Promotion against a real redis-server: a loader whose heartbeat lapsed hands its
partitions to its shadow (recorded in `active` and `promotions`); a loader that beats,
or one still starting, keeps them."""

from __future__ import annotations

import json
import threading
import time

from overlord.planner.promotion import Promoter
from overlord.runtime.lease import Lease
from overlord.store import Keys
from overlord.store.schema import decode_active, encode_active

KEYS = Keys("j")


def beat(r, role: str, k: int, pid: int, node: str = "a") -> None:
    r.set(KEYS.heartbeat(role, str(k)), json.dumps({"pid": pid, "node": node, "time": time.time()}), ex=5)


def promoter(r, shadowed=(0, 1), **kw) -> Promoter:
    lease = Lease(r, KEYS, node="a", ttl_s=5)
    lease.acquire(threading.Event())
    return Promoter(r, KEYS, lease, list(shadowed), check_s=0, **kw)


def promotions(r) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(KEYS.promotions)]


def test_a_dead_loaders_partitions_move_to_its_shadow(r):
    p = promoter(r)
    for k in (0, 1):
        beat(r, "loader", k, pid=100 + k)
        beat(r, "shadow", k, pid=200 + k, node="b")
    assert p.check() == {} and p.watching
    r.delete(KEYS.heartbeat("loader", "1"))  # loader process 1 died: its heartbeat is gone
    assert p.check() == {1: 201}
    assert r.hgetall(KEYS.active) == {b"1": encode_active(201, "b").encode()}
    (entry,) = promotions(r)
    assert entry["loader"] == "1" and entry["pid"] == "201" and entry["node"] == "b" and entry["previous"] == ""
    assert p.check() == {}  # once: the promoted shadow is given time to beat as the loader
    beat(r, "loader", 1, pid=201, node="b")  # it does; a later lapse is a new failure
    assert p.check() == {} and 1 not in p.promoted


def test_a_loader_never_seen_beating_gets_a_grace_before_its_shadow_takes_over(r):
    p = promoter(r, shadowed=[0], grace_s=30)
    beat(r, "shadow", 0, pid=300)  # the shadow beat first: the loader may still be starting
    assert p.check() == {}
    p.watching_since -= 30.05  # the grace has passed (set back, not slept: a busy machine could outlive a short one)
    assert p.check() == {0: 300} and decode_active(r.hget(KEYS.active, "0")) == (300, "a")


def test_no_shadow_no_promotion(r):
    p = promoter(r, shadowed=[0], grace_s=0)
    assert p.check() == {}  # neither beats: nothing to promote to
    assert not Promoter(r, KEYS, p.lease, [], check_s=0).watching  # (a lease of its own waited 5 s for this one's)
    assert r.hgetall(KEYS.active) == {} and promotions(r) == []


def test_on_several_nodes_a_promotion_moves_the_loader_to_its_shadow_s_node_and_pids_name_no_process(r):
    p = promoter(r, shadowed=[1], placed=True)
    r.hset(KEYS.placement, mapping={"loader1": "n1", "shadow1": "n0", "constructor1": "n1"})
    r.hset(KEYS.active, "1", encode_active(57, "n1"))
    beat(r, "loader", 1, pid=57, node="n1")
    beat(r, "shadow", 1, pid=57, node="n0")  # the same pid on another node: another process
    assert p.check() == {}
    r.delete(KEYS.heartbeat("loader", "1"))  # n1 died (or was cut off: its heartbeat lapsed)
    assert p.check() == {1: 57}
    assert decode_active(r.hget(KEYS.active, "1")) == (57, "n0")
    # in the same write: its samples are served from n0 now, and the shadow's unit is free
    assert r.hgetall(KEYS.placement) == {b"loader1": b"n0", b"constructor1": b"n1"}
    (entry,) = promotions(r)
    assert entry["previous"] == "57@n1" and entry["node"] == "n0"
    (move,) = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(KEYS.placements)]
    assert (move["unit"], move["from"], move["to"]) == ("loader1", "n1", "n0")
