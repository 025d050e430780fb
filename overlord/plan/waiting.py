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
from overlord.store.schema import plans_after, resume_step


def fetch_plan(r: redis.Redis, keys: Keys, step: int) -> Plan | None:
    raw = r.get(keys.plan(step))
    return Plan.decode(raw) if raw is not None else None


def wait_plan(
    r: redis.Redis,
    keys: Keys,
    step: int,
    stop: threading.Event,
    timeout_s: float,
    block_ms: int = 200,
    beat: Beat | None = None,
) -> Plan:
    """Block until the plan of `step` is published (XREAD on the plans stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        plan = fetch_plan(r, keys, step)
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
        r.xread({keys.plans: plans_after(step)}, block=block_ms, count=1)


def resume_point(r: redis.Redis, keys: Keys) -> tuple[int, dict[str, Any]] | None:
    """(step, planner state) the sidecar chose to resume at, or None for a fresh start."""
    step = resume_step(r, keys)
    if step is None:
        return None
    return step, Checkpoints(keys).load(r, step)
