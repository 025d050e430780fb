"""Publishing: each plan, with the checkpoint after it, written once under the lease.

One fenced script (step_write.py: the lease checked, then every write, atomically)
writes the plans of a turn (consecutive steps planned together, see process.py): per
step the plan (`plan:<step>`, expiring), its notice (`plans` stream, entry id
`<step+1>-0` so a reader waiting for step t asks for ids after `t-0` and cannot miss
it) and the differential checkpoint of the state before the next step (see
checkpoint.py) — so the state in Redis never refers to a plan that was not written,
and a resume may start at any step of a turn. The durability marker and the wait for
the replicas (and, about once a second, the primary's fsync) go in the same round
trip. A script sent again (a lost reply, a wait that fell short) writes the turn only
if the `planner` hash does not have its last step yet: a step is published once.

It plans step s only while s <= (the trainers' consumed step) + plan_ahead and
s <= (the slowest Data Constructor's last step) + plan_ahead (`Bound`): the trainers'
step is the least `progress` t<dp> - 1 (see overlord.constructor.marks), or the job's
first step (0, or the resume step) while a group has consumed nothing, so the first
plan_ahead + 1 steps are planned before any trainer consumes and a metric reported at
step t shapes the plan of step t + plan_ahead + 1 at the latest. While ahead the
Planner blocks on the `progressed` stream (an entry per rise of a c<dp> or t<dp>,
carrying its new value) instead of polling (`Publisher.wait`), and keeps the marks
from the entries: the `progress` hash is read when it starts leading and, as a
backstop, after MARKS_REFRESH_S without an entry, not once per step.

Redis holds a bounded window of plans: those far behind the slowest Data Constructor
are deleted, a few per published step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

from overlord.plan.checkpoint import Checkpoints
from overlord.plan.step_plan import Plan
from overlord.planner.step_write import StepScript, StepWrite, noscript
from overlord.runtime.lease import Lease, Superseded
from overlord.store import Keys
from overlord.store.durable import Durability
from overlord.store.lane import Lane
from overlord.store.schema import (
    COUNTER_DROPPED_LAST,
    PLANNER_DONE,
    PLANNER_DURABLE,
    PLANNER_DURABLE_MS,
    PLANNER_STEP,
    PLANNER_UPDATED,
    built_field,
    consumed_field,
    is_built_field,
    is_consumed_field,
    plans_entry,
    plans_entry_id,
    progressed_mark,
    resume_step,
)

PLAN_TTL_S = 3600  # a backstop: plans are deleted once far behind the slowest constructor
PLAN_KEEP_STEPS = 1024  # plans kept behind the slowest Data Constructor: a restarted loader or
# constructor, or a shadow, reads from its step on (as far back as a trainer may resume)
PRUNE_MAX = 64  # old plans deleted per published step, at most
PUBLISH_TRIES = 5
FSYNC_EVERY_S = 1.0  # how often a step waits for the primary's fsync (WAITAOF)
MARKS_REFRESH_S = 1.0  # the `progress` hash is read again after this long without a `progressed` entry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Bound:
    """How far the job has gone: the slowest Data Constructor's last built step and the
    trainers' consumed step."""

    slowest: int
    consumed: int

    def room(self, step: int, plan_ahead: int) -> int:
        """How many steps from `step` on may be planned now (0 while ahead)."""
        return max(0, min(self.slowest, self.consumed) + plan_ahead - step + 1)


class Pace:
    """How fast the job's bound moves (an average of its recent steps), from the bounds
    the Planner reads: a Planner short of a turn sleeps until the bound is due to have
    moved the steps the turn lacks, then reads `progressed` once, rather than waking on
    each mark. A step's marks (every group's trainers, then its constructors) come in a
    burst at the demo's pace and spread over the step at a training step's: a fixed 2 ms
    wait took 2.3 wakes a step at 30 steps/s, and a quarter of a step after each wake
    short of a turn still 2.6 wakes a turn at 40 steps/s (each wake costs ~0.2 ms of CPU
    on a VM: the kernel's wake-up, the XREAD and the loop's checks)."""

    LEAST_S = 0.002
    MOST_S = 0.05  # the plans in front of the trainers cover steps, not this; the loop's
    # checks (lease, promotion) run between two sleeps
    WEIGHT = 0.2  # of the newest step in the average

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.step_s: float | None = None
        self._seen: tuple[float, int] | None = None  # (when, bound) as last seen moving

    def saw(self, bound: Bound) -> None:
        now, at = self.clock(), min(bound.slowest, bound.consumed)
        if self._seen is not None and at > self._seen[1]:
            step_s = (now - self._seen[0]) / (at - self._seen[1])
            self.step_s = step_s if self.step_s is None else (1 - self.WEIGHT) * self.step_s + self.WEIGHT * step_s
        if self._seen is None or at != self._seen[1]:  # a bound that went back (a rewind) starts over from there
            self._seen = (now, at)

    def settle_s(self, missing: int = 1) -> float:
        """How long to sleep before reading `progressed` while the bound lacks `missing`
        steps of a turn: until, at the recent pace, the bound is due to have moved them
        since it last moved (the least once that time is past, or while no pace is known)."""
        if self.step_s is None or self._seen is None:
            return self.LEAST_S
        due = self._seen[0] + missing * self.step_s - self.clock()
        return min(self.MOST_S, max(self.LEAST_S, due))


class Publisher:
    """Writes plans and checkpoints under the lease, within the job's bound."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        lease: Lease,
        ckpts: Checkpoints,
        *,
        first: int,
        dp: int,
        durable_s: float = 60.0,
        lane: Lane | None = None,
    ) -> None:
        """Args:
        first: the step this Planner starts planning at (0, or its checkpoint's).
        dp: the job's DP groups (each has a constructor mark and a trainer mark).
        durable_s: how long a write may wait to be confirmed durable (Job.redis_outage_s:
            a failover promotes a replica within it).
        lane: the connection its blocking reads and publishing round trips go on (see
            overlord.store.lane); one of its own when None.
        """
        self.lane = lane if lane is not None else Lane(r)
        self.durable = Durability(r, timeout_s=durable_s, lane=self.lane)
        self.script = StepScript(r)
        self.durable_ms = 0.0  # the last wait for a durable write
        self.fsynced_at = 0.0  # monotonic: when the last step was confirmed in the fsynced append-only file
        self.r, self.keys, self.lease, self.ckpts, self.dp = r, keys, lease, ckpts, dp
        self._built = [built_field(d) for d in range(dp)]  # the marks' fields, named once (read each wake)
        self._consumed = [consumed_field(d) for d in range(dp)]
        self.first = first
        # the job's first step: where trainers that consumed nothing yet stand
        self.start = resume_step(r, keys) or 0
        self.pruned = max(0, first - PLAN_KEEP_STEPS - PRUNE_MAX)  # plans below were deleted (older ones expire)
        self.progressed: str | bytes = "0-0"  # the last `progressed` entry seen
        self.marks: dict[str, int] | None = None  # `progress` c<dp> and t<dp>, as the entries tell
        self.marks_read = 0.0  # monotonic: when an entry or the hash last told them

    def bound(self) -> Bound:
        """The bound from the marks as last known (see `wait`); reads the `progress` hash
        (one HGETALL) only when they are unknown or stale."""
        if self.marks is None or time.monotonic() - self.marks_read > MARKS_REFRESH_S:
            self._read_marks()
        marks, first, start = self.marks or {}, self.first, self.start
        slowest = min((marks.get(f, first - 1) for f in self._built), default=first - 1)
        consumed = max(start, min((marks.get(f, start + 1) - 1 for f in self._consumed), default=start))
        return Bound(slowest=slowest, consumed=consumed)

    def _read_marks(self) -> None:
        """The `progress` hash, and where in `progressed` it stands: the entries after the
        newest one seen here are applied on top (an entry read twice sets what it set)."""
        newest = self.r.xrevrange(self.keys.progressed, count=1)
        progress = self.r.hgetall(self.keys.progress)
        self.marks = {
            field.decode(): int(v) for field, v in progress.items() if is_built_field(field) or is_consumed_field(field)
        }
        if self.progressed == "0-0" and newest:
            self.progressed = newest[0][0]  # older entries are in the hash already
        self.marks_read = time.monotonic()

    def wait(self, block_ms: int) -> None:
        """Block until a constructor or a trainer moves, at most `block_ms` (the entry may
        have come since the last `bound`: then it returns at once). Each entry carries the
        field's new value: the marks follow the entries, in the order they were written,
        without reading the hash."""
        reply = self.lane.xread({self.keys.progressed: self.progressed}, block_ms=block_ms, count=1000)
        if not reply:
            return
        entries = reply[0][1]
        self.progressed = entries[-1][0]
        if self.marks is None:
            return
        for _, fields in entries:
            field, value = progressed_mark(fields)
            if value is None:  # a writer that does not carry the value: read the hash
                self.marks = None
                return
            self.marks[field] = value
        self.marks_read = time.monotonic()

    def publish_turn(self, turn: Sequence[tuple[Plan, dict]], state: Callable[[], dict], bound: Bound) -> None:
        """Write the plans of a turn (consecutive steps) and the checkpoint after each,
        once: one fenced script (see step_write.py) with the durability wait behind it on
        the same connection, for the whole turn.

        Args:
            turn: each step's plan with the core's change since the last checkpoint
                (the state before plan.step + 1), in step order.
            state: gives the core's full state as it stands (after the turn's last step):
                only the last step's checkpoint may be a snapshot (`Checkpoints.snapshot_at`).
            bound: the marks read before planning (plans far behind the slowest go).

        Raises:
            ValueError: the turn is empty, or a step other than the last needs a snapshot.
            Superseded: another Planner leads (nothing was written), or the server kept
                losing the script.
        """
        if not turn:
            raise ValueError("a turn publishes at least one step")
        if any(self.ckpts.snapshot_at(plan.step + 1) for plan, _ in turn[:-1]):
            raise ValueError(
                f"the turn of steps {turn[0][0].step}..{turn[-1][0].step} has a snapshot checkpoint "
                "before its last step; end the turn at the step the snapshot follows (Checkpoints.snapshot_at): "
                "the snapshot is the core's state when the turn is published"
            )
        keys, plan = self.keys, turn[-1][0]
        old = range(self.pruned, min(self.pruned + PRUNE_MAX, bound.slowest - PLAN_KEEP_STEPS + 1))
        write = StepWrite()
        if old:  # Redis holds a bounded window of plans, not every step of the job
            write.delete(*[keys.plan(s) for s in old])
        for step_plan, delta in turn:
            write.set(keys.plan(step_plan.step), step_plan.encode(), ex=PLAN_TTL_S)
            write.xadd(
                keys.plans,
                plans_entry(step_plan.step, step_plan.last),
                id=plans_entry_id(step_plan.step),
                maxlen=1000,
                approximate=True,
            )
            self.ckpts.write(write, step_plan.step + 1, delta, state)  # where a resume at the next step starts
        write.hset(
            keys.planner,
            mapping={PLANNER_STEP: plan.step, PLANNER_UPDATED: time.time(), **({PLANNER_DONE: 1} if plan.last else {})},
        )
        if plan.dropped:  # only a finite job's last step drops samples
            write.hset(keys.counters, COUNTER_DROPPED_LAST, plan.dropped)

        def fenced(reply: Any) -> None:
            if reply == -1:
                self.lease.lost.set()
                raise Superseded(f"the Planner lease (token {self.lease.token}) is no longer this process's")

        for _ in range(PUBLISH_TRIES):
            # the replicas every step (a failover loses what none has); the primary's
            # fsync about once a second (WAITAOF waits for the server's next fsync,
            # ~100 ms under appendfsync everysec) and on the last step. A wait that
            # falls short sends the script again: it writes the step again only if a
            # failover lost it.
            now = time.monotonic()
            fsync = plan.last or now - self.fsynced_at >= FSYNC_EVERY_S or not self.durable.want.local
            mark: dict[str, Any] = (
                {PLANNER_DURABLE: plan.step, PLANNER_DURABLE_MS: f"{self.durable_ms:.3f}"}
                if fsync
                else {PLANNER_UPDATED: time.time()}
            )
            queue = partial(
                self.script.queue,
                keys=keys,
                lease_value=self.lease.value or b"",
                step=plan.step,
                write=write,
                marker=mark,
            )
            try:
                ms = self.durable.acknowledge(queue, local=fsync, check=fenced)
            except redis.ResponseError as exc:
                if not noscript(exc):
                    raise
                log.info("Redis lost the publishing script (restarted or failed over); loading it again")
                self.script.load()
                continue
            if fsync:
                self.durable_ms, self.fsynced_at = ms, now
            break
        else:
            raise Superseded(f"could not publish step {plan.step}: Redis kept losing the publishing script")
        self.pruned = max(self.pruned, old.stop)
