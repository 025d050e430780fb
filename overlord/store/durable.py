"""Acknowledging writes only once they are durable: on disk, on the replicas, or both.

Redis answers a write once it is in memory. With `appendfsync everysec` (the
embedded server's setting) up to a second of answered writes is lost when the server
crashes, and a primary that dies before its replica copied a write loses it at failover.
For the Planner's plan and checkpoint of a step that is a resume point gone: a trainer
may hold a `state_dict` for a step Redis no longer knows.

`Durability.acknowledge` makes one marker write and blocks until it, and so everything
the process wrote before it, is durable, as far as the server can tell:

- `WAITAOF 1 0 timeout` (Redis and Valkey 7.2 and later) when the server keeps an
  append-only file: the primary has fsynced it;
- `WAIT numreplicas timeout`, numreplicas the replicas connected now: each has received
  it (whether a replica fsyncs its own file is its configuration, which the primary
  cannot see, so WAITAOF's replica count is not asked for);
- nothing, said once in the log, when the server has neither an append-only file nor a
  replica: no acknowledgement can mean more than "in memory".

WAIT and WAITAOF cover the writes of the connection that sends them, so the marker write
and the wait go on one connection in one pipeline. The marker comes after the caller's
MULTI has answered, so its offset is past every write the caller made: waiting for it
waits for them too.

The replicas wanted are read again every `REFRESH_S` and whenever a wait falls short, so
a failover (a replica fewer) does not block the writer; a wait that stays short for
`timeout_s` is a StoreError naming what is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from overlord.errors import StoreError
from overlord.store.lane import Batch, Lane

log = logging.getLogger("overlord.store")

REFRESH_S = 5.0  # how often the replicas connected are read again
WAIT_MS = 1000  # one WAIT/WAITAOF round; a wait falling short is tried again until timeout_s


@dataclass(frozen=True)
class Wanted:
    """What an acknowledgement waits for on this server."""

    local: int  # 1: the primary's append-only file fsynced (WAITAOF, 7.2 and later)
    replicas: int  # replicas that must have received the write (WAIT)
    server: str  # what the server said it is, for the log


def wanted(r: redis.Redis) -> Wanted:
    """Read from INFO what a write can wait for on the server `r` talks to; an ACL user
    without INFO (it is in `@dangerous`) probes with the waits themselves instead."""
    try:
        info: dict[str, Any] = r.info("server") | r.info("persistence") | r.info("replication")
    except redis.exceptions.NoPermissionError:
        return _probed(r)
    major, minor = (int(x) for x in str(info.get("redis_version", "0.0")).split(".")[:2])
    return Wanted(
        local=1 if int(info.get("aof_enabled", 0)) and (major, minor) >= (7, 2) else 0,
        replicas=int(info.get("connected_slaves", 0)),
        server=f"version {info.get('redis_version')}, aof_enabled={info.get('aof_enabled')}",
    )


def _probed(r: redis.Redis) -> Wanted:
    """What to wait for, found without INFO: WAITAOF refuses numlocal 1 when the server
    keeps no append-only file (and is unknown before 7.2); `WAIT 0 0` answers at once
    with the replicas that have acknowledged anything, i.e. those connected."""
    try:
        r.execute_command("WAITAOF", 1, 0, 1)
        local = 1
    except redis.ResponseError:
        local = 0
    try:
        replicas = int(r.execute_command("WAIT", 0, 0))
    except redis.exceptions.NoPermissionError:
        replicas = 0
    return Wanted(
        local=local, replicas=replicas, server=f"no INFO for this user; WAITAOF {'works' if local else 'refused'}"
    )


class Durability:
    """Durable acknowledgements of one process's writes (see the module docstring).

    Args:
        r: the client the writes went through.
        timeout_s: how long a wait may stay short before it is an error (a failover
            needs the time to promote a replica).
    """

    def __init__(self, r: redis.Redis, *, timeout_s: float, lane: Lane | None = None) -> None:
        """Args:
        lane: where `acknowledge` sends its round trips (a hot loop's, overlord.store.lane);
            a pipeline of `r` when None.
        """
        self.r, self.timeout_s, self.lane = r, timeout_s, lane
        self.want = wanted(r)
        self.read_at = time.monotonic()
        self.warned = False

    def acknowledge(
        self,
        marker: Callable[[Any], object],
        *,
        local: bool = True,
        check: Callable[[Any], None] | None = None,
    ) -> float:
        """Queue the marker write (`marker(pipe)`, e.g. a fenced HSET of the step made
        durable), then wait until it, and every earlier write of this process, is durable:
        on the replicas, and with `local` also in the primary's fsynced append-only file.
        Returns the milliseconds the wait took. `check`, if given, sees the marker's reply
        each time it is sent (before the wait is judged) and may raise to stop.

        WAITAOF returns at the server's next fsync: with `appendfsync everysec` that is
        ~100 ms on average (measured on the embedded server), so a caller writing many
        times a second asks for `local` about once a second, not on every write.

        Raises:
            StoreError: the server did not confirm within `timeout_s`.
        """
        start = time.monotonic()
        if start - self.read_at > REFRESH_S:
            self.want, self.read_at = wanted(self.r), start
        want_local = self.want.local if local else 0
        if not want_local and not self.want.replicas:
            if local:
                self._warn_once()
            reply = self._round_trip(marker, [])[0]
            if check is not None:
                check(reply)
            return 0.0
        while True:
            waits: list[tuple[Any, ...]] = [("WAITAOF", 1, 0, WAIT_MS)] if want_local else []
            if self.want.replicas:
                waits.append(("WAIT", self.want.replicas, WAIT_MS))
            reply, *replies = self._round_trip(marker, waits)
            if check is not None:
                check(reply)
            fsynced = int(replies[0][0]) if want_local else 0
            replicas = int(replies[-1]) if self.want.replicas else 0
            if fsynced >= want_local and replicas >= self.want.replicas:
                return (time.monotonic() - start) * 1000
            if time.monotonic() - start > self.timeout_s:
                raise StoreError(
                    f"Redis did not confirm a write durable within {self.timeout_s:.0f}s: wanted the append-only "
                    f"file fsynced {want_local}x and {self.want.replicas} replica(s), got {fsynced} and "
                    f"{replicas}; check the server's disk and its replicas (INFO persistence, INFO replication)"
                )
            self.want, self.read_at = wanted(self.r), time.monotonic()  # a replica may be gone for good
            want_local = self.want.local if local else 0

    def _round_trip(self, marker: Callable[[Any], object], waits: list[tuple[Any, ...]]) -> list[Any]:
        """The marker's commands, then `waits`, on one connection in one round trip."""
        if self.lane is not None:
            batch = Batch()
            marker(batch)
            return self.lane.execute([*batch.commands, *waits])
        with self.r.pipeline(transaction=False) as pipe:
            marker(pipe)
            for wait in waits:
                pipe.execute_command(*wait)
            return list(pipe.execute())

    def execute(self, pipe: Any) -> list[Any]:
        """Execute a non-transactional pipeline of idempotent writes (or writes whose
        repeats the reader drops) with a WAIT for the replicas appended; returns the
        replies of the caller's commands. Replicas only: what a failover would lose is
        what no replica has, and an fsync per pipeline would cost ~100 ms (see
        `acknowledge`). A wait that falls short is not retried (the next pipeline's wait
        covers these writes too, on the same connection as a rule): this is for writes
        that are sent again anyway, such as a Source Loader's reports.
        """
        now = time.monotonic()
        if now - self.read_at > REFRESH_S:
            self.want, self.read_at = wanted(self.r), now
        if not self.want.replicas:
            return list(pipe.execute())
        pipe.execute_command("WAIT", self.want.replicas, WAIT_MS)
        replies = list(pipe.execute())
        if int(replies[-1]) < self.want.replicas:
            self.want, self.read_at = wanted(self.r), time.monotonic()  # a replica gone: ask for fewer
        return replies[:-1]

    def _warn_once(self) -> None:
        if not self.warned:
            self.warned = True
            log.warning(
                "Redis (%s) can confirm neither an fsync of its append-only file (WAITAOF: appendonly yes on "
                "7.2 or later) nor a replica: checkpoints are acknowledged in memory only, and a crash of the "
                "server can lose the newest; use a server with appendonly yes, or add a replica",
                self.want.server,
            )
