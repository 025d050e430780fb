"""Reading a rank's micro-batches over Arrow Flight from a sidecar at a given location
(`DataLoader(remote="grpc://node0:8815")` or $OVERLORD_REMOTE), instead of from a ring
on this node. The job's token comes from $OVERLORD_FLIGHT_TOKEN (or the run directory
on the sidecar's node); overlord.remote.flight draws the wire format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overlord.config import Job
from overlord.errors import ConfigError, RemoteRoleError
from overlord.shm import Ring

if TYPE_CHECKING:  # typing only: pyarrow.flight loads on the first read
    from overlord.remote.flight import RemoteReader


class FlightReader:
    """Rank `rank`'s records from the sidecar at `location`."""

    def __init__(self, job: Job, rank: int, location: str, *, timeout_s: float) -> None:
        self.job, self.rank, self.location, self.timeout_s = job, rank, location, timeout_s
        self.ring: Ring | None = None  # never a ring on this node
        self.sidecar_pid: int | None = None
        self._stream: RemoteReader | None = None

    def read(self, after: tuple[int, int], *, final: bool = False, resuming: bool = False) -> Any:
        """The next record, or None at the end of the job; the stream opens on the first
        read, after `after` (the last batch delivered). `resuming`: a state was loaded,
        which this reader cannot serve yet."""
        if self._stream is None:
            if resuming:
                raise ConfigError(
                    "load_state_dict() with a remote DataLoader is not supported yet; read from the local ring"
                )
            # deferred: pyarrow.flight is heavy and only a rank reading over Flight needs it
            from overlord.remote.endpoint import job_token
            from overlord.remote.flight import RemoteReader

            self._stream = RemoteReader(
                self.job, self.location, self.rank, token=job_token(self.job), after=after, timeout_s=self.timeout_s
            )
        try:
            return next(self._stream)
        except StopIteration:
            return None
        except Exception as exc:  # noqa: BLE001 - pyarrow.flight errors, with their message
            raise RemoteRoleError(
                f"rank {self.rank} of job {self.job.name!r}: reading from {self.location} over Flight failed: {exc}"
            ) from None

    def drop_ring(self) -> None:
        """Nothing to drop: the stream goes on where it stands."""

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
