"""Telling a slow pipeline from a hung one, for a rank that waited `timeout_s` without
a batch.

Slow: the Data Constructor host feeding the rank turned its loop within that time (it
waits on roles that answer for themselves the same way, so a hang upstream still
reaches the trainer as an error); the rank waits on. Hung: RemoteRoleError naming what
serves the rank. The job's Redis away: the roles wait for it too, so the rank waits on
up to `Job.redis_outage_s`, then RemoteRoleError naming Redis; Redis back without the
job's state: RemoteRoleError at once.

A dead peer: the Planner keeps within `plan_ahead` steps of the slowest trainer, so a
rank whose process died (or froze) without leaving holds every other rank back while
the roles turn their loops. A peer whose running totals (`stats` rank<r>, which its
trainer's stats thread refreshes every second: overlord.torch.stats) have not changed
for longer than a trainer rides out (`timeout_s` plus `Job.redis_outage_s`: a peer cut
off from Redis is silent that long, and may come back) is named in a RemoteRoleError instead of waited on for ever as "slow".
Staleness is judged on this process's own clock (when it first saw the record as it
is), never against another node's.
"""

from __future__ import annotations

import time
import warnings

from overlord.config import Job
from overlord.errors import OverlordError, RemoteRoleError
from overlord.runtime.flow import alive_within
from overlord.store import Keys
from overlord.store.schema import decode_record, is_trainer_stats_field, stats_rank
from overlord.torch.control import Control
from overlord.torch.stats import StatsPublisher


class Watchdog:
    """Judges one rank's waits on the Data Constructor host `host` (its index)."""

    def __init__(self, job: Job, control: Control, *, host: int, timeout_s: float, rank: int = -1) -> None:
        self.job, self.control, self.host, self.timeout_s, self.rank = job, control, host, timeout_s, rank
        # the rank's running totals' publisher (set while it runs): its Redis contacts
        # date an outage this rank's own probes did not see
        self.stats: StatsPublisher | None = None
        self._redis_gone: float | None = None  # monotonic: when this rank found the job's Redis unreachable
        self._outage_grace = False  # whether the roles had their extra timeout_s after the last outage
        self._peers: dict[int, tuple[bytes, float]] = {}  # rank -> (its stats record, monotonic: first seen so)

    def slow_or_hung(self, origin: str, serving: str, look: str) -> float:
        """After `timeout_s` without a batch: a new deadline when the Data Constructor host
        feeding this rank turned its loop within that time (slow, not hung), else
        RemoteRoleError naming what serves the rank (`serving`) and where to look
        (`look`). When the job's Redis does not answer, waits on up to
        `Job.redis_outage_s` (the roles wait for it too), then RemoteRoleError naming
        Redis; back without the job's state, at once."""
        # deferred: redis-py loads in a trainer on one node only when its pipeline stalls
        import redis

        keys = Keys(self.job.name)
        try:
            r = self.control.probe()
            turning = alive_within(r, keys, "constructor", self.host, self.timeout_s)
            job_known = r.exists(keys.job_config)
            silent = self._silent_peers(r.hgetall(keys.stats)) if turning else []
        except (OverlordError, redis.RedisError) as exc:
            self.control.drop_probe()
            return self._redis_away(origin, exc)
        was_away = self._redis_gone is not None or self._missed_redis_lately()
        self._redis_gone = None
        if not job_known:
            raise RemoteRoleError(
                f"{origin}: the job's Redis at {self.control.url()} no longer holds the state of job "
                f"{self.job.name!r} (its key {keys.job_config!r} is gone: Redis restarted without persistence, "
                "or was flushed); plans, cursors and checkpoints are lost. Restart the job (its trainers resume "
                "from their state_dict), and give Redis an append-only file (appendonly yes) or a replica"
            ) from None
        if silent:
            raise RemoteRoleError(
                f"{origin}: no batch for {self.timeout_s:g}s while constructor{self.host} turns its loop: the job "
                f"waits on {'; '.join(silent)}, whose trainer has not reported for {self._silent_s():g}s or more "
                "(dead or frozen without leaving; the Planner keeps within plan_ahead steps of the slowest trainer). "
                "Restart every rank, as torchrun does when one fails: they resume from their state_dict"
            ) from None
        if turning:
            self._outage_grace = False
            warnings.warn(f"{origin}: no batch for {self.timeout_s:g}s; the pipeline is slow, not hung", stacklevel=2)
            return time.monotonic() + self.timeout_s
        if was_away and not self._outage_grace:
            # Redis just came back: the roles could not beat while it was away, so their
            # heartbeats are as old as the outage. One more timeout_s for them to turn
            # their loops (once per outage: a role that stays silent is then an error).
            self._outage_grace = True
            warnings.warn(
                f"{origin}: no batch for {self.timeout_s:g}s: the job's Redis at {self.control.url()} answers "
                f"again after an outage; waiting up to {self.timeout_s:g}s more for constructor{self.host} "
                "to turn its loop",
                stacklevel=2,
            )
            return time.monotonic() + self.timeout_s
        raise RemoteRoleError(
            f"{origin}: no batch within {self.timeout_s:g}s ({serving}) and its Data Constructor host "
            f"(constructor{self.host}) has not turned its loop for as long: run `overlord status` and {look}"
        ) from None

    def _silent_peers(self, stats: dict[bytes, bytes]) -> list[str]:
        """The other ranks whose stats record is unchanged since this process first saw
        it `_silent_s()` ago or more ("rank r (pid p on node n)")."""
        now, silent = time.monotonic(), []
        for field, raw in stats.items():
            if not is_trainer_stats_field(field) or (rank := stats_rank(field)) == self.rank:
                continue
            seen = self._peers.get(rank)
            if seen is None or seen[0] != raw:
                self._peers[rank] = (raw, now)
            elif now - seen[1] >= self._silent_s():
                record = decode_record(raw)
                silent.append(f"rank {rank} (pid {record.get('pid')} on node {record.get('node')!r})")
        return silent

    def _silent_s(self) -> float:
        """How long a peer's record may stand still: what a trainer rides out."""
        return max(2 * self.timeout_s, self.timeout_s + self.job.redis_outage_s)

    def _missed_redis_lately(self) -> bool:
        """Whether this trainer's stats thread failed to reach Redis within the last
        timeout_s (an outage this rank's probes did not see: it was reading batches)."""
        missed = self.stats.missed if self.stats is not None else None
        return missed is not None and time.monotonic() - missed < 2 * self.timeout_s

    def _redis_away(self, origin: str, exc: BaseException) -> float:
        """No batch, and the job's Redis does not answer: wait on (the roles wait for it too)
        up to `Job.redis_outage_s` since it was last reached, then RemoteRoleError naming it."""
        now = time.monotonic()
        if self._redis_gone is None:
            reached = self.stats.reached if self.stats is not None else None  # written once a second
            self._redis_gone = reached if reached is not None else now
        gone, budget = now - self._redis_gone, self.job.redis_outage_s
        if gone >= budget:
            raise RemoteRoleError(
                f"{origin}: the job's Redis at {self.control.url()} has been unreachable for {gone:.0f}s, past "
                f"Job.redis_outage_s={budget:g} ({type(exc).__name__}: {exc}); no batch within {self.timeout_s:g}s "
                "since the roles wait on it. Bring Redis back (or fail it over), or raise Job.redis_outage_s"
            ) from None
        warnings.warn(
            f"{origin}: no batch for {self.timeout_s:g}s: the job's Redis at {self.control.url()} is "
            f"unreachable ({gone:.0f}s so far); waiting for it up to Job.redis_outage_s={budget:g}",
            stacklevel=2,
        )
        return now + min(self.timeout_s, max(0.5, budget - gone))
