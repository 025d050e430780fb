"""Refill turns that give way to a published plan (the loader process's main thread).

A refill turn tops up every stream below its low-water mark by one chunk, transforms
inline. With 150 streams in one process a turn lasted over 100 ms in most turns (seconds
while the buffers first fill) and usually ended with the next plan already waiting:
serving came only between turns. A turn now looks whether that plan is out every
`LOOK_S` and stops between two streams when it is; the next turn starts at the stream
after the last one topped up, so no stream waits behind the others turn after turn. What
is read does not change: each stream's samples and their order are its own
(source_loader.py), whichever stream a turn starts at.

A look costs no Redis round trip: `PlanWatch` follows the `plans` stream in a thread of
its own (a blocking XREAD, one wake per plan) and a look reads the step it last saw. An
EXISTS per look instead took 6% of the main thread's time on a loaded machine.

With no plan to serve and no stream to top up, the process blocks on the plans stream
and the `demanded` stream for at most `idle_ms()` (a shadow, SHADOW_BLOCK_MS).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import redis

from overlord.errors import ConfigError
from overlord.store import Keys
from overlord.store.client import SOCKET_TIMEOUT_S
from overlord.store.schema import plans_after, plans_entry_step

log = logging.getLogger(__name__)

LOOK_S = 0.02  # during a refill turn, how often to look whether the next plan is out
WATCH_BLOCK_MS = 500  # the watch thread's XREAD wait, so that it sees `stop` within that

IDLE_BLOCK_MS = 200  # an idle active loader's wait on the plans and `demanded` streams
SHADOW_BLOCK_MS = 20  # a shadow's: its promotion must not wait for a plan to arrive
IDLE_ENV = "OVERLORD_LOADER_IDLE_MS"  # overrides IDLE_BLOCK_MS (tests: a demand must not wait for it)


class PlanWatch:
    """The last step whose plan the `plans` stream announced, followed by a thread.

    An announcement can only say a plan is out early by a step a new Planner publishes
    again; a turn that stops for it costs one loop turn, never a sample.

    Args:
        r: The process's Redis client (thread-safe: the XREAD takes a connection of its own).
        keys: The job's keys.
        stop: Ends the thread.
    """

    def __init__(self, r: redis.Redis, keys: Keys, stop: threading.Event) -> None:
        self.r, self.keys, self.stop = r, keys, stop
        self.latest = -1  # the highest step whose plan was announced

    def start(self, step: int) -> None:
        """Follow the announcements of the plans of `step` and later."""
        threading.Thread(target=self._run, args=(step,), daemon=True, name="plan-watch").start()

    def published(self, step: int) -> bool:
        """Whether the plan of `step` (or a later one) was announced."""
        return self.latest >= step

    def _run(self, step: int) -> None:
        last: bytes | str = plans_after(step)  # an entry's id is <step+1>-0 (planner/publishing.py)
        try:
            while not self.stop.is_set():
                for _, entries in self.r.xread({self.keys.plans: last}, block=WATCH_BLOCK_MS, count=64) or []:
                    for entry_id, _ in entries:
                        last = entry_id
                        self.latest = max(self.latest, plans_entry_step(entry_id))
        except redis.RedisError as exc:  # the main loop meets the outage too, and fails by it
            log.warning("plan watch stopped (%s): refill turns no longer give way to a published plan", exc)


class RefillTurns:
    """Where each refill turn starts, and when one stops early for a plan.

    Args:
        look_s: Seconds of topping up between two looks at the plans.
        clock: Monotonic seconds (a test passes its own).
    """

    def __init__(self, look_s: float = LOOK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.look_s = look_s
        self.clock = clock
        self.start = 0  # index into the turn's streams where the next turn begins
        self.yielded = 0  # turns stopped early because a plan was out

    def turn(self, streams: Sequence[int], top_up: Callable[[int], bool], plan_out: Callable[[], bool]) -> bool:
        """Offer each stream one top-up, from where the last turn stopped, until a look
        finds a plan out.

        Args:
            streams: The streams this process hosts, in a stable order.
            top_up: Tops up one stream if it is below its mark; True if it read.
            plan_out: Whether the plan the process serves next is published.

        Returns:
            True if any stream was topped up.
        """
        count = len(streams)
        if count == 0:
            return False
        first = self.start % count
        looked = self.clock()
        filled = False
        for n in range(count):
            if not top_up(streams[(first + n) % count]):
                continue
            filled = True
            now = self.clock()
            if n + 1 < count and now - looked >= self.look_s:
                looked = now
                if plan_out():
                    self.start = (first + n + 1) % count
                    self.yielded += 1
                    return True
        return filled


class Pace:
    """How long a refill turn takes and how far apart the plans come, as moving averages:
    together the refill latency in steps that a stream's read buffer must cover
    (runtime/readbuffer.py, `ReadBudget.pace`).

    The plans of the first `plan_ahead` + 1 steps a process serves were published ahead
    of the trainers (at a start, a restart, a resume) and it serves them as fast as it
    reads: their spacing is its own speed, not the job's steps, so it is not folded in.
    Folded in, that burst read as steps of a few ms, the refill latency as the most
    steps, and every stream filled to twice what it needed while the trainers were still
    starting: the loading processes' peak memory. Nor are the refill turns made until
    that burst is served: they are every stream's first fill from empty (seconds, where
    a turn that tops streams up takes milliseconds). Folded in, the first one alone,
    decaying by `alpha` a turn, set the refill latency to the most steps for the first
    tens of the job's steps, and every stream filled to twice its need then.

    Args:
        plan_ahead: Job.plan_ahead.
        alpha: Weight of one observation in the averages.
    """

    def __init__(self, plan_ahead: int, alpha: float = 0.2) -> None:
        self.plan_ahead, self.alpha = plan_ahead, alpha
        self.refill_s: float | None = None  # seconds a refill turn takes
        self.step_s: float | None = None  # seconds between two plans
        self._served_at: float | None = None
        self._burst_end: int | None = None  # the last step of the plans published ahead of its first

    def _fold(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def served(self, step: int, now: float) -> None:
        """The plan of `step` was served at `now` (monotonic seconds)."""
        if self._burst_end is None:
            self._burst_end = step + self.plan_ahead
        if self._served_at is not None and step > self._burst_end:
            self.step_s = self._fold(self.step_s, now - self._served_at)
        self._served_at = now

    def refilled(self, seconds: float) -> None:
        """A refill turn that read took `seconds`; not counted until a plan after the
        burst was served (`step_s` is measured from then on)."""
        if self.step_s is not None:
            self.refill_s = self._fold(self.refill_s, seconds)

    def known(self) -> tuple[float, float] | None:
        """(refill_s, step_s) once both were measured, else None."""
        if self.refill_s is None or self.step_s is None:
            return None
        return self.refill_s, self.step_s


def idle_ms() -> int:
    """The idle block: IDLE_BLOCK_MS, or `$OVERLORD_LOADER_IDLE_MS`."""
    raw = os.environ.get(IDLE_ENV)
    if raw is None:
        return IDLE_BLOCK_MS
    try:
        ms = int(raw)
    except ValueError:
        ms = 0
    if not 1 <= ms < SOCKET_TIMEOUT_S * 1000:
        raise ConfigError(
            f"${IDLE_ENV}={raw!r} is not a number of milliseconds from 1 to below the Redis socket timeout "
            f"({SOCKET_TIMEOUT_S * 1000:g}: a longer block reads as an outage); unset it for {IDLE_BLOCK_MS}"
        )
    return ms
