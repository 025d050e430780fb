"""Waits shared by the roles: back-pressured ring writes and waiting for a step's plan.

A back-pressured write waits as long as the consumer is alive (a trainer may pause for
minutes to checkpoint); the ring raises `PeerDied` when it is not. Waiting for a plan
is bounded by the job's timeout, since a Planner that stops planning is a failure.
"""

from __future__ import annotations

import threading
import time
from typing import Mapping

import numpy as np
import redis

from overlord.errors import PlanError, RingTimeout
from overlord.planner.dgraph import Plan
from overlord.shm import Ring, write_batch
from overlord.store import Keys

SLICE_S = 0.5


class Stopped(Exception):
    """The role was asked to stop while waiting."""


def push(ring: Ring, arrays: Mapping[str, np.ndarray], meta: dict, stop: threading.Event) -> None:
    """Write one batch record, waiting on back-pressure while the consumer lives."""
    while True:
        try:
            write_batch(ring, arrays, meta=meta, timeout=SLICE_S)
            return
        except RingTimeout:
            if stop.is_set():
                raise Stopped() from None


def fetch_plan(r: redis.Redis, keys: Keys, step: int) -> Plan | None:
    raw = r.get(keys.plan(step))
    return Plan.from_json(raw) if raw is not None else None


def wait_plan(r: redis.Redis, keys: Keys, step: int, stop: threading.Event, timeout_s: float, block_ms: int = 200) -> Plan:
    """Block until the plan of `step` is published (XREAD on the plans stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        plan = fetch_plan(r, keys, step)
        if plan is not None:
            return plan
        if stop.is_set():
            raise Stopped()
        if time.monotonic() > deadline:
            raise PlanError(
                f"no plan for step {step} after {timeout_s:.0f}s; the Planner is stalled or dead "
                "(see `overlord status` and the planner log), or raise Job.timeout_s"
            )
        # entry ids are <step+1>-0: ask for anything after <step>-0, so nothing is missed
        r.xread({keys.plans: f"{step}-0"}, block=block_ms, count=1)
