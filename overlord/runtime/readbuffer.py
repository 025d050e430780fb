"""How much a Source Loader's read buffer holds: bytes that follow need.

A stream (one partition of a source) must hold what the Planner can draw from it
before its loader refills, no more:

    draw     = global_batch x (source weight / all weights) / partitions of the source,
               or what the plans served took from the stream a step (a moving average),
               whichever is larger: a mixing schedule that turns to a source is followed
    horizon  = plan_ahead + refill steps (the steps that pass while the loader process
               turns once over its streams; measured, at least 1, and 1 until the
               job's steps are: overlord.loader.refill.Pace)
    need     = draw x horizon + 3 sqrt(draw x horizon)   (what the Planner may take before
               a refill: the mixer draws each step's counts at random (multinomial), so
               the mean plus three standard deviations)
    target   = (1 + TOP_UP) x need x mean sample bytes   (running mean of prepared
                                                          samples, seeded from the
                                                          first chunk read)

so that at low water (`need`, in bytes) the buffer still holds what the Planner may
draw before the refill lands: a step rarely finds a stream short and waits for the
Planner's demand to reach the loader. A refill then tops the buffer up by TOP_UP x need
(half of it): the buffer's peak is 1.5 x need, where topping up by a whole need held
2 x need for no fewer stalls (bench/peers.py: each Source Loader process 6-11 MiB of
PSS less, samples/s the same within the noise). The
target is bounded below by `floor_samples` (one step's draw and as much again, at least
MIN_SAMPLES) and above by the byte cap (`Source.buffer_bytes`, else `Job.buffer_bytes`)
and the sample cap (`Job.buffer_samples`, when set). The cap wins over the floor. Low
water is the target / (1 + TOP_UP), in bytes. What the Planner asks for (`demand`: one step needs
more of a stream than its buffer holds) wins over both, so a buffer that runs dry asks
and is refilled, never stalls.

The budget decides how far ahead of the plans a loader reads, never which sample goes
where: a stream's order is a pure function of (seed, epoch, partition) and its shuffle
window (`Source.shuffle_window`), and the Planner takes the heads of the streams by the
mixing schedule; a smaller buffer only makes the Planner wait for metadata sooner.

Pure: numbers in, numbers out; the loader process and the autoscaler's memory budget
(overlord.autoscale.partition) share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MIN_SAMPLES = 8  # the smallest floor: a rare stream refills every few samples, not every one
MAX_REFILL_STEPS = 8  # a burst of plans (the Planner's first plan_ahead steps) is not a pace
SIGMAS = 3.0  # standard deviations of the random draw a buffer holds beyond its mean
TOP_UP = 0.5  # what a refill adds past low water, as a share of need
DRAW_ALPHA = 0.1  # weight of one plan in the measured draw (about the last 10 steps)


def draw_per_step(global_batch: int, weights: Iterable[float], source: int, partitions: int) -> float:
    """Samples one step takes from one partition of source `source`, on average.

    Args:
        global_batch: samples per step (BatchSpec.global_batch).
        weights: every source's mixing weight, in job order.
        source: the index of the stream's source.
        partitions: how many streams split that source.
    """
    weights = [max(float(w), 0.0) for w in weights]
    total = sum(weights)
    if total <= 0 or partitions < 1:
        return 0.0
    return global_batch * weights[source] / total / partitions


def floor_samples(draw: float) -> int:
    """The fewest samples a stream aims to hold: one step's draw and as much again."""
    return max(MIN_SAMPLES, 2 * math.ceil(draw))


def target_bytes(draw: float, plan_ahead: int, refill_steps: int, mean_nbytes: float, cap_bytes: int) -> int:
    """The bytes a stream aims to hold (module docstring): derived, floored, capped."""
    drawn = draw * (plan_ahead + max(1, refill_steps))
    derived = (1 + TOP_UP) * (drawn + SIGMAS * math.sqrt(drawn)) * mean_nbytes
    floor = floor_samples(draw) * mean_nbytes
    return int(min(max(derived, floor), cap_bytes))


@dataclass(slots=True)
class ReadBudget:
    """One stream's read-buffer budget, following its measured sample sizes.

    Attributes:
        draw: samples per step the weights give the stream (`draw_per_step`).
        plan_ahead: Job.plan_ahead.
        cap_bytes: the byte cap (Source.buffer_bytes, else Job.buffer_bytes).
        cap_samples: the sample cap (Job.buffer_samples), None for none.
        refill_steps: steps that pass while the loader turns once over its streams.
        mean_nbytes: running mean of the prepared samples' bytes (0: none seen yet).
        seen: samples the mean covers.
        drawn: moving average of the samples a plan took from the stream (`took`).
    """

    draw: float
    plan_ahead: int
    cap_bytes: int
    cap_samples: int | None = None
    refill_steps: int = 1
    mean_nbytes: float = 0.0
    seen: int = 0
    drawn: float = 0.0

    def took(self, n: int) -> None:
        """A plan took `n` samples of the stream: fold them into the measured draw."""
        self.drawn += DRAW_ALPHA * (n - self.drawn)

    def step_draw(self) -> float:
        """Samples a step takes: the weights' share, or the measured one when larger."""
        return max(self.draw, self.drawn)

    def observe(self, nbytes: Iterable[int]) -> None:
        """Fold prepared samples' sizes into the running mean."""
        for n in nbytes:
            self.seen += 1
            self.mean_nbytes += (n - self.mean_nbytes) / self.seen

    def pace(self, refill_s: float, step_s: float) -> None:
        """Set the refill latency in steps from one turn over the streams (`refill_s`)
        and the time between two plans (`step_s`)."""
        if step_s > 0:
            self.refill_steps = max(1, min(MAX_REFILL_STEPS, math.ceil(refill_s / step_s)))

    def target_bytes(self) -> int:
        draw = self.step_draw()
        return target_bytes(draw, self.plan_ahead, self.refill_steps, max(self.mean_nbytes, 1.0), self.cap_bytes)

    def target_samples(self) -> int:
        """The samples the buffer aims to hold (at least 1); before any sample is seen,
        the floor (the first read seeds the mean)."""
        if not self.seen:
            n = floor_samples(self.step_draw())
        else:
            n = max(1, math.ceil(self.target_bytes() / max(self.mean_nbytes, 1.0)))
        return max(1, min(n, self.cap_samples)) if self.cap_samples is not None else n

    def low_water_bytes(self) -> int:
        return int(self.target_samples() * self.mean_nbytes / (1 + TOP_UP))

    def room(self, held: int, held_bytes: int, wanted: int = 0) -> int:
        """Samples to prepare now: 0 while the buffer is above low water and holds what
        the Planner asked for (`wanted`).

        Args:
            held: samples in the buffer.
            held_bytes: their bytes.
            wanted: samples the Planner asked the stream to hold (its demand), 0 if none.
        """
        target = self.target_samples()
        if wanted > held:
            return max(target, wanted) - held
        if held >= target or (self.seen and held_bytes >= self.low_water_bytes()):
            return 0
        return target - held
