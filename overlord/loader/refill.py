"""Refill turns that give way to a published plan (the loader process's main thread).

A refill turn tops up every stream below its low-water mark by one chunk, transforms
inline. With 150 streams in one process a turn lasted over 100 ms in most turns (seconds
while the buffers first fill) and usually ended with the next plan already waiting:
serving came only between turns. A turn now looks whether that plan is out every
`LOOK_S` (one Redis EXISTS per look, not one per stream) and stops between two streams
when it is; the next turn starts at the stream after the last one topped up, so no
stream waits behind the others turn after turn. What is read does not change: each
stream's samples and their order are its own (source_loader.py), whichever stream a
turn starts at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

LOOK_S = 0.02  # during a refill turn, how often to look whether the next plan is out


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
