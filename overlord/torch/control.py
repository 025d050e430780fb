"""The job's Redis as one trainer rank reaches it: opened on first use, never on the
data path of a job on one node (a rank there reads only its ring, and leaves its running
totals in the ring's consumer note for its Data Constructor host to publish:
overlord.torch.stats), so redis-py loads in such a rank only when it resumes, reports
metrics or finds its pipeline stalled.

Two clients: the control client (positions for a resuming sidecar, metrics for the
mixing, the placement on several nodes) rides through outages like every role's;
the probe answers within a second, so a stalled rank says itself how long Redis has
been away (overlord.torch.watchdog).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlord import store
from overlord.config import Job
from overlord.sidecar.mode import sidecar_running
from overlord.store.server import redis_url_of

if TYPE_CHECKING:
    import redis


class Control:
    """The job's Redis clients of one rank, opened lazily."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._client: redis.Redis | None = None
        self._probe: redis.Redis | None = None

    def client(self) -> redis.Redis:
        """The job's Redis, opened on first use. While a sidecar of the job runs on this
        node, that sidecar reached the server: a first connection made while it is away
        (the node's link cut, a failover) waits for it up to `Job.redis_outage_s`, as
        every command does; with no sidecar here, an unreachable server is an error at
        once (a wrong URL)."""
        if self._client is None:
            self._client = store.connect(
                redis_url_of(self.job),
                timeout_s=5,
                ride_through_s=self.job.redis_outage_s,
                name="trainer",
                known=sidecar_running(self.job),
            )
        return self._client

    def probe(self) -> redis.Redis:
        """A client of the job's Redis that answers within 1 s (no ride-through)."""
        if self._probe is None:
            self._probe = store.connect(redis_url_of(self.job), timeout_s=1, ride_through_s=0)
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
        return store.redact(redis_url_of(self.job))
