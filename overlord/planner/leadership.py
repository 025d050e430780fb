"""Leadership: taking over the job's planning under the lease (see lease.py).

A Planner that holds the lease continues from the newest checkpoint (checkpoint.py):
it restores the pure core from it, or writes the first one (step 0) if there is none.
Every (re)start of planning, even under the same lease after a Redis blip, gets a new
generation from the fence counter and publishes it as the `token` of the `planner`
hash: each Source Loader then reports its read buffer again, tagged with it (the new
Planner knows only cursors; chunks of an older generation are dropped, see meta.py).

A job whose last step is planned carries `done` in the `planner` hash: a Planner that
takes the lease after that has nothing to plan, and a standby leaves (`wait_done`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from overlord.plan.checkpoint import Checkpoints
from overlord.plan.core import PlannerCore
from overlord.runtime.lease import Lease, Superseded, WriteUncertain
from overlord.store import Keys
from overlord.store.schema import PLANNER_DONE, PLANNER_LEADER_SINCE, PLANNER_LEASE, PLANNER_TOKEN, planner_done

log = logging.getLogger("overlord.planner")

DONE_POLL_S = 0.5  # how often a standby looks whether the job's last step is planned


class Leadership:
    """One term of leading: take over from the newest checkpoint, then `check` each turn
    that the lease still holds."""

    def __init__(self, r: redis.Redis, keys: Keys, lease: Lease, token: int) -> None:
        self.r, self.keys, self.lease, self.token = r, keys, lease, token

    def take_over(self, core: PlannerCore, ckpts: Checkpoints) -> int | None:
        """Restore `core` from the newest checkpoint and announce this Planner.

        Returns:
            The generation loaders tag their reports with, or None when the job's last
            step is already planned (nothing to lead; `done` is set).
        """
        r, keys = self.r, self.keys
        if planner_done(r, keys):
            return None  # took the lease after the last step was planned
        newest = ckpts.newest(r)
        if newest is not None:
            core.restore(ckpts.load(r, newest))
            if core.done:  # the checkpoint is after the job's last step: nothing to plan, never wait
                r.hset(keys.planner, PLANNER_DONE, 1)
                log.info("the newest checkpoint (step %d) is after the job's last step; planner done", core.step)
                return None
        generation = int(r.incr(keys.fence))

        def announce(pipe) -> None:
            pipe.hset(
                keys.planner,
                mapping={PLANNER_TOKEN: generation, PLANNER_LEASE: self.token, PLANNER_LEADER_SINCE: time.time()},
            )
            if newest is None:
                ckpts.write(pipe, 0, None, core.state)

        while True:
            try:
                self.lease.fenced(announce)  # idempotent: retried if cut short
                break
            except WriteUncertain:
                continue
        log.info(
            "leading with lease token %d (generation %d) from step %d%s",
            self.token,
            generation,
            core.step,
            " (from the newest checkpoint)" if newest is not None else "",
        )
        return generation

    def check(self) -> None:
        """Raises:
        Superseded: the lease lapsed (the renewing thread saw another holder, or none)."""
        if self.lease.lost.is_set():
            raise Superseded(f"the Planner lease (token {self.token}) lapsed")


def wait_done(r: redis.Redis, keys: Keys, stop: threading.Event, standing_by: Callable[[], bool]) -> None:
    """Set `stop` once the job's last step is planned while this Planner stands by
    (`standing_by()`): on several nodes every node runs a Planner, and those that do not
    lead leave with the job."""
    while not stop.wait(DONE_POLL_S):
        try:
            if standing_by() and planner_done(r, keys):
                stop.set()
        except redis.RedisError:
            pass
