"""Every Redis key Overlord uses is built here; nobody formats a key elsewhere.

All keys of a job share the hash tag `{<job>}` so they live in one Redis Cluster slot
and multi-key transactions work on a managed cluster as on one server. What each key
holds (type, fields, encodings, writer, reader, TTL) is described in
`overlord.store.schema.SCHEMA`, rendered into docs/reference/redis.md.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "overlord"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one job."""

    job: str

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.job}}}"

    @property
    def planner(self) -> str:
        return f"{self.base}:planner"

    def plan(self, step: int) -> str:
        return f"{self.base}:plan:{step}"

    @property
    def plans(self) -> str:
        return f"{self.base}:plans"

    def meta(self, stream: str) -> str:
        return f"{self.base}:meta:{stream}"

    @property
    def progress(self) -> str:
        return f"{self.base}:progress"

    @property
    def progressed(self) -> str:
        return f"{self.base}:progressed"

    def heartbeat(self, role: str, ident: str) -> str:
        return f"{self.base}:hb:{role}:{ident}"

    @property
    def heartbeat_pattern(self) -> str:
        return f"{self.base}:hb:*"

    @property
    def nodes(self) -> str:
        return f"{self.base}:nodes"

    @property
    def layout(self) -> str:
        return f"{self.base}:layout"

    @property
    def run(self) -> str:
        return f"{self.base}:run"

    @property
    def errors(self) -> str:
        return f"{self.base}:errors"

    @property
    def counters(self) -> str:
        return f"{self.base}:counters"

    @property
    def ckpt(self) -> str:
        return f"{self.base}:ckpt"

    @property
    def ckpt_delta(self) -> str:
        return f"{self.base}:ckpt-delta"

    @property
    def leader(self) -> str:
        return f"{self.base}:leader"

    @property
    def fence(self) -> str:
        return f"{self.base}:fence"

    @property
    def active(self) -> str:
        return f"{self.base}:active"

    @property
    def promotions(self) -> str:
        return f"{self.base}:promotions"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    @property
    def scaling(self) -> str:
        return f"{self.base}:scaling"

    @property
    def autoscale(self) -> str:
        return f"{self.base}:autoscale"

    @property
    def profile(self) -> str:
        return f"{self.base}:profile"

    @property
    def restarts(self) -> str:
        return f"{self.base}:restarts"

    @property
    def ckpt_layout(self) -> str:
        """The streams (source partitions) the checkpoints' cursors belong to."""
        return f"{self.base}:ckpt-layout"

    @property
    def resume(self) -> str:
        return f"{self.base}:resume"

    @property
    def rewind(self) -> str:
        """A rewind of a job on several nodes under way (overlord.sidecar.rewind)."""
        return f"{self.base}:rewind"

    @property
    def demand(self) -> str:
        return f"{self.base}:demand"

    @property
    def demanded(self) -> str:
        """One entry per write of `demand`: wakes the Source Loaders blocked on it."""
        return f"{self.base}:demanded"

    @property
    def metrics(self) -> str:
        return f"{self.base}:metrics"

    @property
    def job_config(self) -> str:
        return f"{self.base}:job"

    @property
    def placement(self) -> str:
        return f"{self.base}:placement"

    @property
    def placements(self) -> str:
        return f"{self.base}:placements"

    @property
    def handoff(self) -> str:
        """Requests to hand a stream to another loader process (stream -> loader index)."""
        return f"{self.base}:handoff"

    @property
    def handoffs(self) -> str:
        """The Planner's log of live stream handoffs between loader processes."""
        return f"{self.base}:handoffs"

    @property
    def reshard(self) -> str:
        """Requests to read a source with another number of streams (source -> partitions)."""
        return f"{self.base}:reshard"

    @property
    def reshards(self) -> str:
        """The Planner's log of live reshards (a source's partition count changed)."""
        return f"{self.base}:reshards"

    @property
    def flight_token(self) -> str:
        return f"{self.base}:flight-token"

    @property
    def boot(self) -> str:
        return f"{self.base}:boot"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def pattern(self) -> str:
        """Glob matching every key of this job (for SCAN and cleanup)."""
        return f"{self.base}:*"
