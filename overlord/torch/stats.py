"""A trainer's running totals for operators: batches read and seconds spent waiting.

A daemon thread writes them once a second, never on the data path, to one of two
places, both ending as the job's `stats` hash (`rank<r>`), which `overlord top`, the
sidecar's metrics endpoint and the other ranks' watchdogs read:

- a rank that reads a ring on its node (a job on one node) leaves them in the ring's
  consumer note, through a mapping of the thread's own (no Ring object is shared with
  the reading thread), and its Data Constructor host publishes the notes of all its
  rings in one write a second (overlord.constructor.marks), then says when in the
  ring's producer note: that is the rank's last contact with Redis (`reached`, or
  `missed` when it is older than MISSED_S), which dates an outage for its watchdog.
  The rank needs no Redis connection, and never loads redis-py, unless it resumes,
  reports metrics or finds its pipeline stalled: one connection and one write a second
  per node, not per rank;
- any other rank (several nodes, or reading over Flight) writes them to the job's
  Redis with a connection of its own; a Redis that is away only delays the figures.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from overlord import store
from overlord.errors import RingError
from overlord.runtime.layout import client_ring
from overlord.shm import Ring
from overlord.store import Keys
from overlord.store.schema import contact_of, encode_record, encode_trainer_note, trainer_record, trainer_stats_field
from overlord.store.server import redis_url_of

PUBLISH_S = 1.0
_ATTACH_S = 0.2  # the thread's look interval until the rank's ring is mapped, and its wait to map it
MISSED_S = 2.5 * PUBLISH_S  # a host's last contact with Redis older than this: it missed a write


class StatsPublisher:
    """Publishes `totals()` (a dict of plain values) for `rank` until stopped or until
    `totals()` returns None: to the consumer note of the ring `ring()` returns (the
    rank's ring now, None while it has none) when `ring` is given, else to Redis."""

    def __init__(
        self,
        job,
        rank: int,
        totals: Callable[[], dict | None],
        ring: Callable[[], Ring | None] | None = None,
    ) -> None:
        self.job, self.rank, self.totals, self.ring = job, rank, totals, ring
        self._stop = threading.Event()
        self.reached: float | None = None  # monotonic: the last write Redis took
        self.missed: float | None = None  # monotonic: the last write Redis did not take
        self._theirs: Ring | None = None  # the reader's ring the thread's own mapping follows
        self._mine: Ring | None = None
        self._redis: Any = None  # the thread's connection, where it writes to Redis itself
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"overlord-stats-{rank}")
        self._thread.start()

    def _run(self) -> None:
        stopping = False
        try:
            while True:  # at once, then every PUBLISH_S: `reached` dates the trainer's last contact
                totals = self.totals()
                if totals is None:
                    return  # its DataLoader is gone
                # figures for operators never fail training, nor end the thread (a silent
                # thread would have the other ranks name this rank dead): next turn
                if self.ring is not None:
                    try:
                        self._note(totals)
                    except Exception:  # noqa: BLE001 - see above
                        self._theirs = None  # map the ring again
                else:
                    try:
                        self._write(totals)
                    except Exception:  # noqa: BLE001 - see above
                        self._redis = None
                        self.missed = time.monotonic()
                if stopping:
                    return
                # until the rank's ring is mapped, look again soon: its host publishes a
                # first note at once, and the contact it stamps back dates an outage
                waiting = self.ring is not None and self._mine is None
                stopping = self._stop.wait(_ATTACH_S if waiting else PUBLISH_S)
        finally:
            if self._mine is not None:
                self._mine.close()

    def _write(self, totals: dict) -> None:
        """Write `totals` to the job's Redis with the thread's own connection."""
        self._redis = self._redis or store.connect(redis_url_of(self.job), timeout_s=2, ride_through_s=0)
        node = self.job.node_of_rank(self.rank) if self.job.multi_node else self.job.node
        record = {"node": node, **trainer_record(os.getpid(), totals)}
        self._redis.hset(Keys(self.job.name).stats, trainer_stats_field(self.rank), encode_record(record))
        self.reached = time.monotonic()

    def _note(self, totals: dict) -> None:
        """Leave `totals` in the rank's ring's consumer note, mapping the ring again when
        the reader's ring changed (attached, or replaced after a sidecar restart)."""
        assert self.ring is not None
        theirs = self.ring()
        if theirs is not self._theirs:
            if self._mine is not None:
                self._mine.close()
            self._theirs, self._mine = theirs, None
            if theirs is not None:
                try:
                    self._mine = Ring.attach(client_ring(self.job, self.rank), timeout=_ATTACH_S)
                except RingError:
                    self._theirs = None  # gone again (a sidecar on its way out): next time
        if self._mine is not None:
            try:
                self._mine.set_consumer_note(encode_trainer_note(os.getpid(), totals))
                contact = contact_of(self._mine.producer_note())
            except RingError:
                self._theirs = None  # closed under it: map it again next time
                return
            if contact is not None:  # the host's last write to Redis, on this node's clock
                now, age = time.monotonic(), max(0.0, time.time() - contact)
                self.reached = now - age
                if age > MISSED_S:
                    self.missed = now

    def stop(self) -> None:
        """Write the final totals and end the thread (bounded wait)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=3)


def totals_of(ref) -> Callable[[], dict | None]:
    """A trainer's running totals, read through a weak reference (None once it is gone):
    the stats thread must not keep an abandoned DataLoader alive."""

    def totals() -> dict | None:
        loader = ref()
        if loader is None:
            return None
        return {
            "batches": loader.batches,
            "wait_s": round(loader.wait_s, 4),
            "dropped": loader.dropped,
            "copies": loader.copies,
            "step": loader.last_meta.get("step", -1),
            "done": loader._done,
        }

    return totals


def ring_of(ref) -> Callable[[], Ring | None]:
    """The ring a trainer's reader holds now, read through a weak reference (None once
    the DataLoader is gone, or while it holds none)."""

    def ring() -> Ring | None:
        loader = ref()
        return None if loader is None else loader._reader.ring

    return ring
