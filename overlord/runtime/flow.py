"""Waits shared by the roles: back-pressured ring writes and heartbeats of a main loop.

A back-pressured write waits as long as the consumer is alive (a trainer may pause for
minutes to checkpoint); the ring raises `PeerDied` when it is not. Waiting on another
role is bounded by the job's timeout *of silence*: every role's main loop beats, its
heartbeat publishes how long ago (`loop_age`), and a wait that runs past the timeout
fails only if the role it waits on has not turned its loop for that long (hung or
dead), not merely because it is itself waiting on trainers that paused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from overlord.errors import RingTimeout
from overlord.shm import Ring, SampleMeta, write_batch
from overlord.store import Keys

if TYPE_CHECKING:  # annotations only: a trainer on one node never loads redis-py
    import redis

SLICE_S = 0.5
HEARTBEAT_S = 1.0  # how often a role publishes its heartbeat (and loop age)


def set_on_signal(event: threading.Event):
    """A signal handler that sets `event` from another thread. Setting it in the handler
    itself deadlocks when the signal lands while the main thread is inside
    `event.wait()` holding the event's lock (seen: a sidecar that never stopped)."""

    def handler(*_) -> None:
        threading.Thread(target=event.set, daemon=True, name="on-signal").start()

    return handler


class Stopped(Exception):
    """The role was asked to stop while waiting."""


class Beat:
    """When this role's main loop last made a turn (a wait that is healthy counts)."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def __call__(self) -> None:
        self.at = time.monotonic()

    def age(self) -> float:
        return time.monotonic() - self.at


def loop_age(r: redis.Redis, keys: Keys, role: str, index: int) -> float | None:
    """Seconds since `role` `index` last turned its loop, from its heartbeat; None if
    it has no live heartbeat (dead, or never started)."""
    raw = r.get(keys.heartbeat(role, str(index)))
    if raw is None:
        return None
    hb = json.loads(raw)
    return float(hb.get("loop_age", 0.0)) + max(0.0, time.time() - hb["time"])


def alive_within(r: redis.Redis, keys: Keys, role: str, index: int, timeout_s: float) -> bool:
    """Whether the role turned its loop within `timeout_s` (never judged finer than a
    few heartbeats, since the heartbeat itself is that coarse). Within `timeout_s` of a
    Redis outage it is: a heartbeat that could not be written says nothing of its role."""
    # deferred: a trainer imports this module without loading redis-py; `r` loaded it
    from overlord.store import outage_within

    if outage_within(r, max(timeout_s, 3 * HEARTBEAT_S)):
        return True
    age = loop_age(r, keys, role, index)
    return age is not None and age < max(timeout_s, 3 * HEARTBEAT_S)


def push(
    ring: Ring,
    arrays: Mapping[str, np.ndarray],
    meta: dict | SampleMeta,
    stop: threading.Event,
    beat: Beat | None = None,
    *,
    wake: bool = True,
) -> None:
    """Write one batch record, waiting on back-pressure while the consumer lives;
    `wake=False`: without waking the consumer (`Ring.commit`), for a run of records."""
    while True:
        try:
            write_batch(ring, arrays, meta=meta, timeout=SLICE_S, wake=wake)
            return
        except RingTimeout:
            if stop.is_set():
                raise Stopped() from None
            if beat is not None:
                beat()  # waiting on a live consumer is healthy
