"""A trainer's stats thread outlives what fails under it: a rank whose thread ended
would stand still in `stats`, and the other ranks' watchdogs would name it dead."""

from __future__ import annotations

import time

from overlord.torch.stats import StatsPublisher


def test_a_failure_in_the_ring_path_does_not_end_the_thread():
    calls = []

    def ring():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("the reader's ring could not be read")
        return None  # no ring yet: the thread looks again soon

    stats = StatsPublisher(job=None, rank=0, totals=lambda: {"batches": 0}, ring=ring)
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) >= 3 and stats._thread.is_alive()
        assert stats.missed is None and stats.reached is None  # a ring's failure says nothing of Redis
    finally:
        stats.stop()
    assert not stats._thread.is_alive()
