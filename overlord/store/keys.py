"""Every Redis key Overlord uses is built here; nobody formats a key elsewhere.

All keys of a job share the hash tag `{<job>}` so they live in one Redis Cluster slot
and multi-key transactions work on a managed cluster as on one server.

    overlord:{job}:planner              hash   step last planned, updated (time)
    overlord:{job}:plan:<step>          string plan of one step (JSON), expires
    overlord:{job}:plans                stream one entry per published plan (step)
    overlord:{job}:meta:<stream>        stream buffer metadata of one Source Loader
    overlord:{job}:progress             hash   c<dp> -> last step written; t<dp> -> trainers' mark (1 + the step of
                                               the last batch every rank of the group was handed; absent: none yet);
                                               r<dp> -> replay request of a restarted Data Constructor
    overlord:{job}:progressed           stream one entry per rise of a c<dp> or t<dp>: the Planner blocks on it
    overlord:{job}:hb:<role>:<id>       string heartbeat JSON (pid, node, time), TTL
    overlord:{job}:nodes                hash   node -> JSON (pid, host, ranks, flight address, cpus, memory_mb, started)
    overlord:{job}:layout               string JSON: which loader process hosts which stream
    overlord:{job}:errors               list   JSON error records (role, pid, node, message)
    overlord:{job}:counters             hash   skipped:<source>, truncated, ...
    overlord:{job}:metrics              hash   rank -> JSON {step, metrics} the trainer reported
    overlord:{job}:demand               hash   stream -> samples the Planner needs it to hold
    overlord:{job}:ckpt                 hash   step -> full planner state (JSON) before that step's plan
    overlord:{job}:ckpt-delta           hash   step -> change of that state since the step before
    overlord:{job}:leader               string the Planner's lease (JSON token, pid, node), PX TTL
    overlord:{job}:fence                string fencing-token counter (INCR per lease taken)
    overlord:{job}:active               hash   loader process index -> pid of its active Source Loader process
    overlord:{job}:promotions           stream one entry per Shadow Loader promoted (loader, pid, reason)
    overlord:{job}:restarts             hash   role<index> -> times the sidecar restarted it
    overlord:{job}:profile              hash   stream -> JSON cost profile (samples, seconds, bytes, state), kept across runs
    overlord:{job}:autoscale            string JSON partitions per source and loader processes chosen at start
    overlord:{job}:workers              hash   stream -> transform workers (threads) the Planner's scaler set
    overlord:{job}:scaling              stream one entry per scaling decision (step, source, workers, share, cost)
    overlord:{job}:ckpt-layout          string the streams (JSON) those checkpoints belong to
    overlord:{job}:resume               hash   position:<rank> (trainer), step and skip:<rank> (sidecar), rewind:<rank> (a
                                               trainer asking a spawned sidecar to restart for an earlier state)
    overlord:{job}:job                  string the job's config (JSON)
    overlord:{job}:placement            hash   unit (loader<k>, constructor<h>) -> node that runs it (several nodes)
    overlord:{job}:placements           stream one entry per unit the Planner moved (unit, from, to, reason)
    overlord:{job}:flight-token         string the job's Flight token when $OVERLORD_FLIGHT_TOKEN is not set (several nodes)
    overlord:{job}:boot                 string PX lock: one sidecar at a time decides fresh start or join
    overlord:{job}:stats                hash   loader<k> / rank<r> -> JSON running totals for `overlord top` and /metrics
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "overlord"


def built_field(dp: int) -> str:
    """`progress` field: the last step Data Constructor `dp` wrote to its clients' rings."""
    return f"c{dp}"


def consumed_field(dp: int) -> str:
    """`progress` field: the trainers' mark of DP group `dp` (overlord.constructor.marks)."""
    return f"t{dp}"


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
    def demand(self) -> str:
        return f"{self.base}:demand"

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
