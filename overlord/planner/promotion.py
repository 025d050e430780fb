"""Promotion: a Shadow Loader takes over when its active loader's heartbeat is gone.

A loader process with a shadow (a source with `shadow: true`) has a second process on
standby that follows the same plans without delivering. When the active one's
heartbeat lapses and the shadow beats, the Planner records the shadow's pid in the
`active` hash (fenced under its lease) and a `promotions` entry; the shadow sees it
and starts delivering. A loader this Planner never saw beat is starting, not lapsed
(its shadow, forked after it, may beat first on a loaded machine): it is promoted only
after a grace. A promoted shadow is given a few heartbeats to beat as the loader
before the same loader can be promoted again.

On several nodes a shadow runs on a node other than its loader's (placement.py), so
a dead or cut-off node's loaders are taken over hot by shadows elsewhere. The same
fenced write then moves the loader's unit to its shadow's node in `placement` (where
the Data Constructors' bridges look for its samples) and takes the shadow's unit off
(the Placer gives the loader a new shadow on another live node). `active` names the
process by pid and node: pids repeat across nodes. A cut-off loader that comes back
finds another process in `active` and stops delivering (overlord.loader.process).
"""

from __future__ import annotations

import json
import logging
import time

import redis

from overlord.runtime.flow import HEARTBEAT_S
from overlord.runtime.lease import Lease, WriteUncertain
from overlord.runtime.placement import shadow_unit
from overlord.store import Keys
from overlord.store.schema import decode_active, encode_active, move_entry, promotion_entry

log = logging.getLogger("overlord.planner")

CHECK_S = 0.1  # between two looks at the heartbeats: a lapse shows HEARTBEAT_TTL_S after the
# last beat, so looking every 10 ms instead saved at most 0.1 s of it for 100 polls/s
UNSEEN_GRACE_S = 10 * HEARTBEAT_S  # how long a loader may take to beat first before its shadow takes over


class Promoter:
    """Watches the shadowed loader processes' heartbeats and promotes shadows."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        lease: Lease,
        shadowed: list[int],
        *,
        grace_s: float = UNSEEN_GRACE_S,
        check_s: float = CHECK_S,
        placed: bool = False,
    ) -> None:
        """Args:
        shadowed: the loader processes that have a shadow.
        grace_s: how long a loader never seen beating may take to beat first.
        check_s: between two looks at the heartbeats.
        placed: several nodes: a promotion moves the loader's unit in `placement` too.
        """
        self.r, self.keys, self.lease, self.grace_s, self.check_s = r, keys, lease, grace_s, check_s
        self.placed = placed
        self.shadowed = list(shadowed)
        self.next_check = 0.0
        # loader -> (its `active` value promoted, when), until it beats as the loader
        self.promoted: dict[int, tuple[str, float]] = {}
        self.beaten: set[int] = set()  # loaders seen beating
        self.watching_since = time.monotonic()

    @property
    def watching(self) -> bool:
        """Whether any loader has a shadow."""
        return bool(self.shadowed)

    def check(self) -> dict[int, int]:
        """Look at the heartbeats (at most every CHECK_S) and promote where the active
        loader lapsed.

        Returns:
            loader process -> pid of the shadow promoted now (empty most calls).
        """
        if not self.shadowed or time.monotonic() < self.next_check:
            return {}
        self.next_check = time.monotonic() + self.check_s
        keys = self.keys
        pipe = self.r.pipeline(transaction=False)
        for k in self.shadowed:
            pipe.get(keys.heartbeat("loader", str(k)))
            pipe.get(keys.heartbeat("shadow", str(k)))
        pipe.hgetall(keys.active)
        pipe.hgetall(keys.placement)
        *beats, active, placement = pipe.execute()
        done: dict[int, int] = {}
        for n, k in enumerate(self.shadowed):
            loader_hb, shadow_hb = beats[2 * n], beats[2 * n + 1]
            if loader_hb is not None:
                self.beaten.add(k)
                beat = json.loads(loader_hb)
                if k in self.promoted and encode_active(beat["pid"], beat["node"]) == self.promoted[k][0]:
                    del self.promoted[k]  # the promoted one leads: a later lapse is a new failure
                continue
            if shadow_hb is None:
                continue
            if k not in self.beaten and time.monotonic() - self.watching_since < self.grace_s:
                continue
            if k in self.promoted and time.monotonic() - self.promoted[k][1] < 3 * HEARTBEAT_S:
                continue  # the promoted one has not beaten as a loader yet (and a new shadow may be up)
            shadow = json.loads(shadow_hb)
            chosen = encode_active(shadow["pid"], shadow["node"])
            raw_previous = active.get(str(k).encode())
            if raw_previous is not None and raw_previous.decode() == chosen:
                continue
            before = decode_active(raw_previous)
            previous = f"{before[0]}@{before[1]}" if before else ""

            def promote(pipe, k=k, shadow=shadow, chosen=chosen, previous=previous, placement=placement) -> None:
                pipe.hset(keys.active, k, chosen)
                pipe.xadd(
                    keys.promotions,
                    promotion_entry(k, shadow["pid"], shadow["node"], previous, "active heartbeat lapsed"),
                    maxlen=1000,
                    approximate=True,
                )
                if self.placed:  # its samples are served from the shadow's node now
                    unit = f"loader{k}"
                    pipe.hset(keys.placement, unit, shadow["node"])
                    pipe.hdel(keys.placement, shadow_unit(k))
                    reason = "its shadow was promoted"
                    before = (placement.get(unit.encode()) or b"").decode()
                    pipe.xadd(
                        keys.placements, move_entry(unit, before, shadow["node"], reason), maxlen=1000, approximate=True
                    )

            try:
                self.lease.fenced(promote)
            except WriteUncertain:
                self.next_check = 0.0  # look again at once; promoting twice writes the same
                continue
            self.promoted[k] = (chosen, time.monotonic())
            done[k] = shadow["pid"]
            log.warning("loader process %d: active heartbeat lapsed; promoted its shadow (pid %d)", k, shadow["pid"])
        return done
