"""A trainer's running totals for operators: batches read and seconds spent waiting.

A daemon thread writes them once a second to the job's `stats` hash (`rank<r>`), with
its own Redis connection: never on the data path, and a Redis that is away only
delays the figures. `overlord top` and the sidecar's metrics endpoint turn them into
batches per second and the share of time a trainer stalls on data.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from overlord.store import Keys, connect
from overlord.store.schema import encode_record, trainer_stats_field
from overlord.store.server import redis_url_of

PUBLISH_S = 1.0


class StatsPublisher:
    """Publishes `totals()` (a dict of plain values) for `rank` until stopped or until
    `totals()` returns None."""

    def __init__(self, job, rank: int, totals: Callable[[], dict | None]) -> None:
        self.job, self.rank, self.totals = job, rank, totals
        self._stop = threading.Event()
        self.reached: float | None = None  # monotonic: the last write Redis took
        self.missed: float | None = None  # monotonic: the last write Redis did not take
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"overlord-stats-{rank}")
        self._thread.start()

    def _run(self) -> None:
        key, field = Keys(self.job.name).stats, trainer_stats_field(self.rank)
        r = None
        stopping = False
        while True:  # at once, then every PUBLISH_S: `reached` dates the trainer's last contact
            totals = self.totals()
            if totals is None:
                return  # its DataLoader is gone
            try:
                r = r or connect(redis_url_of(self.job), timeout_s=2, ride_through_s=0)
                record = {
                    "node": self.job.node_of_rank(self.rank) if self.job.multi_node else self.job.node,
                    "pid": os.getpid(),
                    "time": time.time(),
                    **totals,
                }
                r.hset(key, field, encode_record(record))
                self.reached = time.monotonic()
            except Exception:  # noqa: BLE001 - figures for operators must never fail training
                r = None
                self.missed = time.monotonic()
            if stopping:
                return
            stopping = self._stop.wait(PUBLISH_S)

    def stop(self) -> None:
        """Write the final totals and end the thread (bounded wait)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=3)


def totals_of(ref) -> Callable[[], dict | None]:
    """A trainer's running totals, read through a weak reference (None once it is gone):
    the stats thread must not keep an abandoned DataLoader alive."""

    def totals() -> dict | None:
        loader = ref()
        if loader is None:
            return None
        return {
            "batches": loader.batches,
            "wait_s": round(loader.wait_s, 4),
            "dropped": loader.dropped,
            "copies": loader.copies,
            "step": loader.last_meta.get("step", -1),
            "done": loader._done,
        }

    return totals
