"""The Redis schema as data: every key of a job, what it holds, who writes and reads it.

`SCHEMA` spells each field with the names `overlord.store.schema` defines, so the table
cannot drift from what runs: `tools/redis_reference.py` renders it into
docs/reference/redis.md, and a test fails when that file is stale.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlord.store.schema import (
    ASKED,
    BUILT,
    CONSUMED,
    COPIED,
    COUNTER_DROPPED_LAST,
    COUNTER_OVER_BUDGET,
    DEMAND_HOLD_STEPS,
    DEMANDED_MAXLEN,
    HANDOFF_FIELDS,
    LOADER_STATS,
    META_ARRAYS,
    META_ENDED,
    META_EPOCH,
    META_FINAL,
    META_TOKEN,
    MOVE_FIELDS,
    OWNER,
    PLANNER_DONE,
    PLANNER_DURABLE,
    PLANNER_DURABLE_MS,
    PLANNER_LEADER_SINCE,
    PLANNER_LEASE,
    PLANNER_NODE_PRESSURE,
    PLANNER_PRESSURE,
    PLANNER_STEP,
    PLANNER_TOKEN,
    PLANNER_UPDATED,
    PLANS_FIELDS,
    POSITION,
    PROGRESSED_VALUE,
    PROMOTION_FIELDS,
    REPLAY,
    RESHARD_FIELDS,
    RESUME_AWAITING,
    RESUME_STEP,
    REWIND,
    REWIND_PUBLISHED,
    SCALING_FIELDS,
    SKIP,
    SKIPPED,
    SKIPPED_FILE,
    SKIPPED_GROUPS,
    SKIPPED_ROWS,
    STOPPED,
    TRAINER_STATS,
    TRUNCATED,
)


@dataclass(frozen=True, slots=True)
class Field:
    """One hash field or stream entry field and its encoding."""

    name: str
    encoding: str
    doc: str


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a job: its `Keys` attribute, pattern, type, fields, writer, reader, TTL."""

    attr: str
    suffix: str
    type: str
    doc: str
    writer: str
    reader: str
    ttl: str = "none"
    fields: tuple[Field, ...] = ()
    example: str = ""


SCHEMA: tuple[Key, ...] = (
    Key(
        "job_config",
        "job",
        "string",
        "the job's config (JSON of `Job.to_dict()`)",
        "sidecar",
        "sidecars, trainers",
        example="GET",
    ),
    Key(
        "layout",
        "layout",
        "string",
        "JSON: which loader process hosts which stream",
        "sidecar",
        "every role",
        example="GET",
    ),
    Key(
        "run",
        "run",
        "string",
        "a token each publish of the job writes anew (a start, a resume, a rewind): a sidecar that finds "
        "another than the one it started or joined with was left out of that publish (its node cut off "
        "meanwhile), and joins the job again",
        "sidecar",
        "sidecars",
        example="GET",
    ),
    Key(
        "planner",
        "planner",
        "hash",
        "the Planner's state",
        "Planner, sidecar (done)",
        "loaders, sidecar, status",
        fields=(
            Field(PLANNER_STEP, "int", "last step planned"),
            Field(PLANNER_UPDATED, "float (unix time)", "when it was"),
            Field(PLANNER_DONE, "1", "the last step is planned (or the job ended)"),
            Field(
                PLANNER_TOKEN, "int", "planning generation of the leading Planner (fence); loaders tag reports with it"
            ),
            Field(PLANNER_LEASE, "int", "the leader's lease token"),
            Field(PLANNER_LEADER_SINCE, "float (unix time)", "when it took the lead"),
            Field(PLANNER_PRESSURE, "float", "transform CPU demand over budget"),
            Field(PLANNER_NODE_PRESSURE, "JSON {node: float}", "per node, several nodes"),
            Field(PLANNER_DURABLE, "int", "last step whose plan and checkpoint are durable (WAITAOF / WAIT)"),
            Field(PLANNER_DURABLE_MS, "float", "how long the previous step's durable wait took, ms"),
        ),
        example="HGETALL",
    ),
    Key(
        "plan",
        "plan:<step>",
        "string",
        "the step's plan, binary: a 64-byte header (magic OVPL, format version 1), per bucket and micro-batch "
        "its sample count, then the (stream, epoch, seq) columns; layout in overlord/plan/step_plan.py",
        "Planner",
        "loaders, constructors",
        ttl="1 h (PLAN_TTL_S)",
        example="GET {k}",
    ),
    Key(
        "plans",
        "plans",
        "stream",
        "one entry per plan, id <step+1>-0",
        "Planner",
        "loaders (XREAD to wake)",
        fields=(Field(", ".join(PLANS_FIELDS), "int, 0 | 1", "the step published; whether it is the job's last"),),
        example="XREVRANGE {k} + - COUNT 5",
    ),
    Key(
        "meta",
        "meta:<stream>",
        "stream",
        "buffer metadata of one Source Loader stream (overlord.plan.meta): one entry per chunk of samples "
        "that entered its read buffer, in its order",
        "Source Loader",
        "Planner",
        fields=(
            *(Field(name, f"bytes ({dt[1:]} little-endian, one per sample)", "") for name, dt in META_ARRAYS.items()),
            Field(META_EPOCH, "ASCII int", "epoch of every sample in the chunk"),
            Field(META_ENDED, "ASCII JSON [[epoch, samples delivered], ...]", "epochs completed"),
            Field(META_FINAL, "0 | 1", "the loader has read every configured epoch"),
            Field(META_TOKEN, "ASCII int", "the Planner generation (planner token) the loader reported to"),
        ),
        example="XLEN",
    ),
    Key(
        "progress",
        "progress",
        "hash",
        "how far each DP group got",
        "Data Constructors, trainers' marks",
        "Planner, loaders, status",
        fields=(
            Field(f"{BUILT}<dp>", "int", "last step Data Constructor dp wrote to its clients' rings"),
            Field(
                f"{CONSUMED}<dp>",
                "int",
                "trainers' mark: 1 + the step of the last batch every rank of the group was handed",
            ),
            Field(f"{REPLAY}<dp>", "<pid>.<time>:<step>", "replay request of a restarted Data Constructor"),
            Field(
                f"{OWNER}<dp>",
                "<pid>.<time>",
                "the Data Constructor of dp that may write c<dp>, t<dp> and r<dp> now (set at its start; one "
                "superseded while out of reach writes nothing more)",
            ),
        ),
        example="HGETALL",
    ),
    Key(
        "progressed",
        "progressed",
        "stream",
        f"one entry per rise of a {BUILT}<dp> or {CONSUMED}<dp>, with its new value; the Planner blocks on it "
        "and keeps the marks from the entries (the hash only when it starts, and after a second without one)",
        "Data Constructors, marks",
        "Planner",
        fields=(
            Field(f"{BUILT} | {CONSUMED}", "int (dp)", "which field rose"),
            Field(PROGRESSED_VALUE, "int", "its new value"),
        ),
        example="XLEN",
    ),
    Key(
        "heartbeat",
        "hb:<role>:<id>",
        "string",
        "heartbeat JSON {pid, node, time, loop_age (s since the main loop last turned), attempt, rss_mb}; roles planner, loader, shadow, constructor, sidecar",
        "every role process, sidecar",
        "sidecar, Planner, status",
        ttl="5 s (HEARTBEAT_TTL_S)",
        example="GET {k}",
    ),
    Key(
        "nodes",
        "nodes",
        "hash",
        "members of the job",
        "sidecars",
        "Planner, bridges, trainers",
        fields=(
            Field(
                "<node>",
                "JSON {pid, host, ranks, flight address, cpus, loader_cpus, memory_mb, started}",
                "one per sidecar; its liveness is hb:sidecar:<node>",
            ),
        ),
        example="HGETALL",
    ),
    Key(
        "errors",
        "errors",
        "list",
        "JSON error records {role, index, node, pid, message}",
        "roles, sidecar",
        "sidecar, status",
        example="LRANGE {k} 0 -1",
    ),
    Key(
        "counters",
        "counters",
        "hash",
        "job-wide counts",
        "loaders, constructors, Planner",
        "status, metrics",
        fields=(
            Field(f"{SKIPPED}<stream>", "int", "rows the stream skipped, every cause (on_error: skip)"),
            Field(f"{SKIPPED_FILE}<stream>:<uri>", "1", "the stream skips the file whole"),
            Field(f"{SKIPPED_GROUPS}<stream>:<uri>", "int", "row groups of the file skipped (each unreadable)"),
            Field(f"{SKIPPED_ROWS}<stream>:<uri>", "int", "rows of the file skipped"),
            Field(f"{TRUNCATED}<dp>", "int", "samples Data Constructor dp truncated"),
            Field(
                f"{COPIED}<dp>",
                "int",
                "samples Data Constructor dp copied out of a loader ring instead of packed in place (its "
                "leases held the ring full, or it took the ring over from this node's Flight endpoint)",
            ),
            Field(COUNTER_DROPPED_LAST, "int", "samples a finite job's end left undelivered"),
            Field(COUNTER_OVER_BUDGET, "int", "scaling intervals over budget"),
        ),
        example="HGETALL",
    ),
    Key(
        "metrics",
        "metrics",
        "hash",
        "what the trainers reported",
        "trainers",
        "Planner (mixing feedback)",
        fields=(Field("<rank>", "JSON {step, metrics}", "one per rank"),),
        example="HGETALL",
    ),
    Key(
        "demand",
        "demand",
        "hash",
        "samples the Planner needs each stream to hold (when a step takes more than its read buffer "
        f"holds); lowered to the most a step took once {DEMAND_HOLD_STEPS} planned steps in a row took less "
        "(0: none)",
        "Planner",
        "loaders",
        fields=(Field("<stream>", "int", ""),),
        example="HGETALL",
    ),
    Key(
        "demanded",
        "demanded",
        "stream",
        f"one entry per write of `demand` (in the same fenced script), carrying what it set; the Source "
        f"Loaders block on it with the plans stream, so a shortage wakes them at once (capped at "
        f"~{DEMANDED_MAXLEN} entries; a loader reads the hash once when it starts, then the entries after)",
        "Planner",
        "loaders",
        fields=(Field("<stream>", "int", "the samples the stream must hold, as set in `demand`"),),
        example="XLEN",
    ),
    Key(
        "ckpt",
        "ckpt",
        "hash",
        "full planner state (cursors, round robin, deferred, RNG, schedule, reshards) before a step's plan, every 64 steps (and the first), back to 1024 steps",
        "Planner",
        "Planner, sidecar",
        fields=(Field("<step>", "JSON", ""),),
        example="HKEYS",
    ),
    Key(
        "ckpt_delta",
        "ckpt-delta",
        "hash",
        "change of that state since the step before",
        "Planner",
        "Planner, sidecar",
        fields=(Field("<step>", "JSON", ""),),
        example="HKEYS",
    ),
    Key(
        "ckpt_layout",
        "ckpt-layout",
        "string",
        "the streams (JSON) the checkpoints belong to",
        "sidecar",
        "sidecar",
        example="GET",
    ),
    Key(
        "leader",
        "leader",
        "string",
        "the Planner's lease (JSON {token, pid, node, since})",
        "Planner",
        "Planner, sidecar",
        ttl="PX 3 s (LEASE_S)",
        example="GET",
    ),
    Key(
        "fence", "fence", "string", "fencing-token counter (INCR per lease taken)", "Planner", "Planner", example="GET"
    ),
    Key(
        "active",
        "active",
        "hash",
        "the Source Loader process that delivers each loader process index's samples (a Shadow Loader "
        "stops standing by, and a superseded one stops delivering, when this changes)",
        "sidecar, Planner",
        "loaders, sidecars, status",
        fields=(Field("<index>", "JSON {pid, node}", "a pid alone names no process on several nodes"),),
        example="HGETALL",
    ),
    Key(
        "promotions",
        "promotions",
        "stream",
        "one entry per Shadow Loader promoted",
        "Planner",
        "status",
        fields=(Field(", ".join(PROMOTION_FIELDS), "str", ""),),
        example="XRANGE {k} - +",
    ),
    Key(
        "restarts",
        "restarts",
        "hash",
        "times the sidecar restarted a role",
        "sidecar",
        "status, metrics",
        fields=(Field("<role><index>", "int", ""),),
        example="HGETALL",
    ),
    Key(
        "profile",
        "profile",
        "hash",
        "cost profile per stream, kept across runs",
        "loaders",
        "autoscale, cli",
        fields=(
            Field("<stream>", "JSON {samples, seconds, out_bytes, state_bytes, updated}", "what its samples cost"),
        ),
        example="HGETALL",
    ),
    Key(
        "autoscale",
        "autoscale",
        "string",
        "JSON {partitions per source, loader processes, costs_ms; the costs and budget the live reshards size with} chosen at start with autoscale",
        "sidecar",
        "Planner, status",
        example="GET",
    ),
    Key(
        "workers",
        "workers",
        "hash",
        "transform workers the Planner's scaler set",
        "Planner",
        "loaders, status",
        fields=(Field("<stream>", "int", ""),),
        example="HGETALL",
    ),
    Key(
        "scaling",
        "scaling",
        "stream",
        "one entry per scaling decision",
        "Planner",
        "status",
        fields=(Field(", ".join(SCALING_FIELDS), "str", ""),),
        example="XREVRANGE {k} + - COUNT 10",
    ),
    Key(
        "resume",
        "resume",
        "hash",
        "where a resumed job starts",
        "trainers, sidecar",
        "sidecar, constructors, Planner",
        fields=(
            Field(RESUME_STEP, "int", "the step the job resumes at (sidecar)"),
            Field(f"{POSITION}<rank>", "JSON [step, micro-batch]", "where trainer rank resumes (trainer)"),
            Field(f"{SKIP}<rank>", "int", "batches of that step trainer rank already had (sidecar)"),
            Field(f"{REWIND}<rank>", "JSON {pid, at}", "a trainer asking a spawned sidecar to restart earlier"),
            Field(
                RESUME_AWAITING,
                "1",
                "several nodes: a resumed run waits for positions (a sidecar joining then waits too); "
                "gone once the step is decided",
            ),
        ),
        example="HGETALL",
    ),
    Key(
        "rewind",
        "rewind",
        "hash",
        "several nodes: trainers loaded an earlier state; every sidecar stops its roles and resumes in place",
        "trainers (asked), sidecars",
        "sidecars",
        fields=(
            Field(f"{ASKED}<rank>", "JSON {pid, at}", "trainer rank loaded a state at (step, micro-batch) `at`"),
            Field(f"{STOPPED}<node>", "float (unix time)", "the node's sidecar stopped every role it ran"),
            Field(REWIND_PUBLISHED, "str (node)", "the sidecar that published the rewound run"),
        ),
        example="HGETALL",
    ),
    Key(
        "placement",
        "placement",
        "hash",
        "which node runs each unit (several nodes); a Shadow Loader on a node other than its loader's, "
        "absent while no such node is live",
        "Planner, sidecar",
        "sidecars, bridges, trainers",
        fields=(Field("loader<k> | shadow<k> | constructor<h>", "str (node)", ""),),
        example="HGETALL",
    ),
    Key(
        "placements",
        "placements",
        "stream",
        "one entry per unit the Planner moved",
        "Planner",
        "status",
        fields=(Field(", ".join(MOVE_FIELDS), "str", ""),),
        example="XREVRANGE {k} + - COUNT 10",
    ),
    Key(
        "handoff",
        "handoff",
        "hash",
        "requests to serve a stream from another loader process from the next step on (`overlord handoff`); "
        "the Planner takes each at a step boundary and deletes it",
        "operators, `overlord handoff`",
        "Planner",
        fields=(Field("<stream>", "int", "the loader process index to serve it"),),
        example="HGETALL",
    ),
    Key(
        "handoffs",
        "handoffs",
        "stream",
        "one entry per stream handed to another loader process (a live handoff, by request or by the "
        "autoscaler), or per request refused (from -1)",
        "Planner",
        "status, `overlord handoff`",
        fields=(Field(", ".join(HANDOFF_FIELDS), "str", ""),),
        example="XREVRANGE {k} + - COUNT 10",
    ),
    Key(
        "reshard",
        "reshard",
        "hash",
        "requests to read a source with another number of streams (loader partitions) from the next step on "
        "(`overlord reshard`); the Planner takes each at a step boundary and deletes it",
        "operators, `overlord reshard`",
        "Planner",
        fields=(Field("<source>", "int", "how many streams read it from then on"),),
        example="HGETALL",
    ),
    Key(
        "reshards",
        "reshards",
        "stream",
        "one entry per reshard (the source's streams retired and new ones reading what they had not planned), "
        "or per request refused (to -1)",
        "Planner",
        "`overlord reshard`",
        fields=(Field(", ".join(RESHARD_FIELDS), "str", ""),),
        example="XREVRANGE {k} + - COUNT 10",
    ),
    Key(
        "flight_token",
        "flight-token",
        "string",
        "the Flight token when $OVERLORD_FLIGHT_TOKEN is not set",
        "first sidecar",
        "sidecars",
        example="EXISTS",
    ),
    Key(
        "boot",
        "boot",
        "string",
        "lock: one sidecar at a time decides fresh start or join",
        "sidecar",
        "sidecar",
        ttl="PX 30 s (BOOT_LOCK_MS)",
        example="GET",
    ),
    Key(
        "stats",
        "stats",
        "hash",
        "running totals for `overlord top` and /metrics",
        "loaders, constructors (a job on one node), trainers (several nodes)",
        "top, status, metrics, trainers",
        fields=(
            Field(
                f"{LOADER_STATS}<k>",
                "JSON {node, pid, time, step, kept_bytes, arrow_bytes, streams}",
                "totals of loader process k, once a second",
            ),
            Field(
                f"{TRAINER_STATS}<r>",
                "JSON {node, pid, time, batches, wait_s, dropped, copies, step, done}",
                "totals of trainer rank r, once a second (a job on one node: from its ring's consumer note, "
                "by its Data Constructor host)",
            ),
        ),
        example="HGETALL",
    ),
)
