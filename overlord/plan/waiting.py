"""How a role waits for the plan of a step the Planner publishes, and where it resumes.

The wait is bounded like every wait on another role (overlord.runtime.flow): it fails
only when the Planner's own loop has not turned for the job's timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from overlord.errors import PlanError
from overlord.plan.checkpoint import Checkpoints
from overlord.plan.step_plan import Plan
from overlord.runtime.flow import Beat, Stopped, alive_within
from overlord.store import Keys
from overlord.store.schema import plans_after, plans_entry_step, resume_step


def fetch_plan(r: redis.Redis, keys: Keys, step: int) -> Plan | None:
    raw = r.get(keys.plan(step))
    return Plan.decode(raw) if raw is not None else None


class SharedPlans:
    """The plans a process's threads wait for, each read from Redis and decoded once for
    all of them: the Data Constructors a host runs for its DP groups build the same
    steps, and each asked Redis for every step's plan (a GET and a decode per group).

    A plan is handed to `users` threads, then dropped; at most KEEP plans are held (the
    oldest go first), so a thread that stopped taking (its group superseded) leaves
    nothing behind for long. A thread that finds another fetching waits for it up to
    LOCK_S, then reads Redis itself: no thread waits on another without a bound.

    The groups mostly wait ahead of the Planner: a step one of them found unpublished
    (and every later one: plans are published in step order) is not asked of Redis again
    by the others until a read of the plans stream returns (`woke`); they go straight to
    that blocking read, which returns at once if the plan came meanwhile."""

    KEEP = 8  # a lagging group past these reads its own from Redis: a plan at 64k samples is 1.5 MB
    LOCK_S = 1.0

    def __init__(self, users: int) -> None:
        self.users = users
        self._lock = threading.Lock()
        self._plans: dict[int, tuple[Plan, int]] = {}  # step -> (its plan, threads that took it)
        self._absent_from: int | None = None  # the lowest step found unpublished since the last wake
        self.fetched = 0  # plans read from Redis (for tests and benches)

    def fetch(self, r: redis.Redis, keys: Keys, step: int) -> Plan | None:
        """The plan of `step`, or None while it is not published."""
        if not self._lock.acquire(timeout=self.LOCK_S):
            return fetch_plan(r, keys, step)  # another thread's read is stuck (Redis away): our own
        try:
            held = self._plans.get(step)
            if held is None:
                if self._absent_from is not None and step >= self._absent_from:
                    return None
                plan = fetch_plan(r, keys, step)
                if plan is None:
                    self._absent_from = step if self._absent_from is None else min(step, self._absent_from)
                    return None
                self.fetched += 1
                held = (plan, 0)
                while len(self._plans) >= self.KEEP:
                    del self._plans[min(self._plans)]
            plan, taken = held[0], held[1] + 1
            if taken >= self.users:
                self._plans.pop(step, None)
            else:
                self._plans[step] = (plan, taken)
            return plan
        finally:
            self._lock.release()

    def woke(self, published: int) -> None:
        """A read of the plans stream found the plan of step `published` announced (and so
        every earlier one: plans are published in step order). A step found unpublished
        before it may be there now; one found unpublished after it is still awaited, even
        when this read returns late: clearing that too sent every waking group to Redis
        for a plan no one had published yet (a GET miss per group and step)."""
        if self._absent_from is not None and self._absent_from <= published:
            self._absent_from = None


def wait_plan(
    r: redis.Redis,
    keys: Keys,
    step: int,
    stop: threading.Event,
    timeout_s: float,
    block_ms: int = 200,
    beat: Beat | None = None,
    shared: SharedPlans | None = None,
) -> Plan:
    """Block until the plan of `step` is published (XREAD on the plans stream); with
    `shared`, read through it (one read and decode for the process's threads)."""
    deadline = time.monotonic() + timeout_s
    while True:
        plan = shared.fetch(r, keys, step) if shared is not None else fetch_plan(r, keys, step)
        if plan is not None:
            return plan
        if stop.is_set():
            raise Stopped()
        if beat is not None:
            beat()
        if time.monotonic() > deadline:
            if alive_within(r, keys, "planner", 0, timeout_s):
                deadline = time.monotonic() + timeout_s  # planning waits on trainers: healthy
                continue
            raise PlanError(
                f"no plan for step {step} after {timeout_s:g}s and the Planner's loop has not turned "
                f"for as long: it is hung or dead (see `overlord status` and the planner log), or raise Job.timeout_s"
            )
        # the entry of `step` has id <step+1>-0: read what comes after <step>-0, so nothing is missed
        read = r.xread({keys.plans: plans_after(step)}, block=block_ms, count=1)
        if read and shared is not None:
            shared.woke(plans_entry_step(read[0][1][0][0]))


def resume_point(r: redis.Redis, keys: Keys) -> tuple[int, dict[str, Any]] | None:
    """(step, planner state) the sidecar chose to resume at, or None for a fresh start."""
    step = resume_step(r, keys)
    if step is None:
        return None
    return step, Checkpoints(keys).load(r, step)
