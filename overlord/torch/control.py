"""The job's Redis as one trainer rank reaches it: opened on first use, never on the
data path of a job on one node (a rank there reads only its ring).

Two clients: the control client (positions for a resuming sidecar, metrics for the
mixing, the placement on several nodes) rides through short outages like every role's;
the probe answers within a second, so a stalled rank says itself how long Redis has
been away (overlord.torch.watchdog).
"""

from __future__ import annotations

import redis

from overlord.config import Job
from overlord.store import connect, redact
from overlord.store.server import redis_url_of


class Control:
    """The job's Redis clients of one rank, opened lazily."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._client: redis.Redis | None = None
        self._probe: redis.Redis | None = None

    def client(self) -> redis.Redis:
        """The job's Redis, opened on first use."""
        if self._client is None:
            self._client = connect(redis_url_of(self.job), timeout_s=5, name="trainer")
        return self._client

    def probe(self) -> redis.Redis:
        """A client of the job's Redis that answers within 1 s (no ride-through)."""
        if self._probe is None:
            self._probe = connect(redis_url_of(self.job), timeout_s=1, ride_through_s=0)
        return self._probe

    def drop_probe(self) -> None:
        """A fresh probe client, and a fresh ping, next time."""
        self._probe = None

    def reset(self) -> None:
        """Both clients fresh next time: the Redis they reached (a sidecar's embedded
        one) stopped."""
        self._client = self._probe = None

    def url(self) -> str:
        """The job's Redis URL without its password, for messages."""
        return redact(redis_url_of(self.job))
