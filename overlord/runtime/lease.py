"""Planner leadership: one Planner per job, by a lease in Redis with a fencing token.

    overlord:{job}:leader   JSON {"token", "pid", "node", "since"}, expires after LEASE_S
    overlord:{job}:fence    counter; every lease taken gets the next value (its token)

A Planner takes the lease with SET NX PX and renews it (only while the value is still
its own) from a thread. Every write of a plan is fenced: WATCH the lease, check it
still holds this Planner's token, then MULTI/EXEC. A Planner that was paused past its
lease (or lost its connection) finds another token, or no lease, and its write is
refused with `Superseded`; it then waits to lead again and restarts from the newest
checkpoint, so two Planners never both publish a step.

A standby Planner (on another sidecar, or the restart of a dead one) blocks in
`acquire` until the lease is free. The sidecar that saw its own Planner die drops the
lease at once (`release_dead`) instead of waiting out the TTL.

A Planner started for one run of the job (`run`: the job's `run` token its sidecar
started or joined with) takes the lease only while that run is the job's: a Planner of
a node cut off while the job was published again without it (a rewind) would lead the
new run from the old run's newest checkpoint. It gets `Superseded` instead, and its
sidecar joins the new run (overlord.sidecar.membership).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import redis

from overlord.store import Keys

LEASE_S = 3.0
RENEW_S = 0.5
RUN_ENV = "OVERLORD_RUN"  # a role's environment: the job's run token its sidecar started or joined with

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


# KEYS: leader, run; ARGV: the lease value, its TTL (ms), the run token this Planner was
# started for. -1: the job runs another run now; 1: taken; 0: held by another.
_TAKE = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""


class Superseded(Exception):
    """This Planner no longer holds the lease: another one leads, or it lapsed."""


class WriteUncertain(Exception):
    """A fenced write was cut short (the lease key was touched, e.g. by this Planner's
    own renewal, or the connection dropped) while the lease is still this Planner's:
    the caller checks whether the write landed and retries it if not."""


class Lease:
    """This process's claim to lead the job's planning."""

    def __init__(
        self, r: redis.Redis, keys: Keys, *, node: str = "", ttl_s: float = LEASE_S, run: bytes | None = None
    ) -> None:
        self.r, self.keys, self.ttl_ms = r, keys, int(ttl_s * 1000)
        self.node = node or socket.gethostname()
        self.run = run  # the job's run this Planner was started for (None: any)
        self.token: int | None = None
        self.value: bytes | None = None
        self._renew = r.register_script(_RENEW)
        self._take = r.register_script(_TAKE)
        self.lost = threading.Event()

    def acquire(self, stop: threading.Event, beat=None) -> int:
        """Block until this process holds the lease; returns its fencing token.

        Raises:
            Superseded: stopped while waiting, or the job runs another run than the
                one this Planner was started for.
        """
        while True:
            current = self.r.get(self.keys.leader)
            if current is not None and current == self.value and self.token is not None:
                self.lost.clear()  # still ours (a write failed on the way): lead on
                return self.token
            if current is None:
                token = int(self.r.incr(self.keys.fence))
                value = json.dumps(
                    {"token": token, "pid": os.getpid(), "node": self.node, "since": time.time()}
                ).encode()
                if self._take_lease(value):
                    self.token, self.value = token, value
                    self.lost.clear()
                    return token
            if beat is not None:
                beat()  # a standby waiting to lead is healthy
            if stop.wait(0.05):
                raise Superseded("stopped while waiting for the lease")

    def _take_lease(self, value: bytes) -> bool:
        if self.run is None:
            return bool(self.r.set(self.keys.leader, value, nx=True, px=self.ttl_ms))
        taken = int(self._take(keys=[self.keys.leader, self.keys.run], args=[value, self.ttl_ms, self.run]))
        if taken < 0:
            raise Superseded(
                "the job was published again for another run than this Planner's (a rewind without its node)"
            )
        return taken == 1

    def renew(self) -> bool:
        """Extend the lease if it is still ours; False (and `lost` set) if not."""
        if self.value is None:
            return False
        ok = bool(self._renew(keys=[self.keys.leader], args=[self.value, self.ttl_ms]))
        if not ok:
            self.lost.set()
        return ok

    def renew_forever(self, stop: threading.Event) -> None:
        while not stop.wait(RENEW_S):
            try:
                self.renew()
            except redis.RedisError:
                pass  # Redis away: the fenced write decides; the lease may still hold when it returns

    def fenced(self, write) -> list:
        """Run `write(pipe)` in one MULTI/EXEC only if this process still leads.

        Raises:
            Superseded: the lease is another's, lapsed, or changed hands during the write.
            WriteUncertain: the write was cut short while the lease is still ours.
        """
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.keys.leader)
                if pipe.get(self.keys.leader) != self.value:
                    self.lost.set()
                    raise Superseded(f"the Planner lease (token {self.token}) is no longer this process's")
                pipe.multi()
                write(pipe)
                return pipe.execute()
            except redis.WatchError:
                if self.r.get(self.keys.leader) == self.value:
                    raise WriteUncertain(f"a write under lease token {self.token} was cut short") from None
                self.lost.set()
                raise Superseded(f"the Planner lease changed while writing (token {self.token})") from None

    def release(self) -> None:
        if self.value is not None:
            release_if(self.r, self.keys, lambda holder: holder == self.value)


def holder(r: redis.Redis, keys: Keys) -> dict | None:
    """Who holds the lease (token, pid, node, since), or None."""
    raw = r.get(keys.leader)
    return json.loads(raw) if raw else None


def release_if(r: redis.Redis, keys: Keys, check) -> bool:
    """Delete the lease if `check(value)` holds for its current value (atomically)."""
    with r.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(keys.leader)
            value = pipe.get(keys.leader)
            if value is None or not check(value):
                return False
            pipe.multi()
            pipe.delete(keys.leader)
            pipe.execute()
            return True
        except redis.WatchError:
            return False


def release_dead(r: redis.Redis, keys: Keys, pid: int, node: str) -> bool:
    """Drop the lease of a Planner this sidecar saw die (pid on this node)."""

    def held_by_dead(value: bytes) -> bool:
        lease = json.loads(value)
        return lease.get("pid") == pid and lease.get("node") == node

    return release_if(r, keys, held_by_dead)
