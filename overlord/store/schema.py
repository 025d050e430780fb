"""The Redis schema: every key, hash field, stream entry field and value encoding Overlord uses.

Key names are built by `overlord.store.keys.Keys`; the hash fields whose names carry a
number or a name (`c<dp>`, `skip:<rank>`, `rank<r>`, ...) and the values with a format of
their own (replay requests, trainer positions, rewind requests) are built and parsed
here, and nowhere else. `SCHEMA` describes every key as data: `tools/redis_reference.py`
renders it into docs/reference/redis.md, the table a `redis-cli` user reads, and a test
fails when that file is stale.

All keys of a job share the hash tag `{<job>}` so they live in one Redis Cluster slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# -- the `progress` hash ---------------------------------------------------------------


def built_field(dp: int) -> str:
    """`progress` field: the last step Data Constructor `dp` wrote to its clients' rings."""
    return f"c{dp}"


def consumed_field(dp: int) -> str:
    """`progress` field: the trainers' mark of DP group `dp` (overlord.constructor.marks)."""
    return f"t{dp}"


def replay_field(dp: int) -> str:
    """`progress` field: the replay request of Data Constructor `dp`, restarted."""
    return f"r{dp}"


def replay_request(pid: int, step: int) -> str:
    """A `r<dp>` value: `<pid>.<time>:<step>`, unique per request, asking the loaders to resend from `step`."""
    return f"{pid}.{time.time():.6f}:{step}"


def replay_step(request: bytes | str) -> str:
    """The step (as text) a replay request asks for."""
    text = request.decode() if isinstance(request, bytes) else request
    return text.rsplit(":", 1)[1]


def built(progress: Mapping[bytes, bytes], dp: int, default: int) -> int:
    """The last step Data Constructor `dp` wrote, from a `progress` HGETALL; `default` when none yet."""
    return int(progress.get(built_field(dp).encode(), default))


def replay(progress: Mapping[bytes, bytes], dp: int) -> bytes | None:
    """Data Constructor `dp`'s replay request, from a `progress` HGETALL; None when none."""
    return progress.get(replay_field(dp).encode())


def is_built_field(field: bytes) -> bool:
    return field.startswith(b"c")


def is_replay_field(field: bytes) -> bool:
    return field.startswith(b"r")


# -- the `resume` hash -------------------------------------------------------------------


def position_field(rank: int) -> str:
    """`resume` field: where trainer `rank` resumes (JSON [step, micro-batch])."""
    return f"position:{rank}"


def skip_field(rank: int) -> str:
    """`resume` field: batches of the resume step trainer `rank` already had."""
    return f"skip:{rank}"


def rewind_field(rank: int) -> str:
    """`resume` field: trainer `rank` asks a spawned sidecar to restart at an earlier state."""
    return f"rewind:{rank}"


def is_rewind_field(field: bytes) -> bool:
    return field.startswith(b"rewind:")


def rank_of(field: bytes) -> int:
    """The rank a `position:`, `skip:` or `rewind:` field names."""
    return int(field.split(b":")[1])


def encode_position(at: tuple[int, int] | list[int]) -> str:
    return json.dumps(list(at))


def positions(resume: Mapping[bytes, bytes], world: int) -> dict[int, list[int]]:
    """rank -> [step, micro-batch] of every trainer that stored a position, from a `resume` HGETALL."""
    return {
        r: json.loads(resume[position_field(r).encode()]) for r in range(world) if position_field(r).encode() in resume
    }


def skips(resume: Mapping[bytes, bytes], ranks: Iterable[int]) -> dict[int, int]:
    """rank -> batches to skip, from a `resume` HGETALL."""
    return {rank: int(resume.get(skip_field(rank).encode(), 0)) for rank in ranks}


def encode_rewind(pid: int, at: tuple[int, int] | list[int]) -> str:
    return json.dumps({"pid": pid, "at": list(at)})


# -- the `stats` hash and counters -------------------------------------------------------


def trainer_stats_field(rank: int) -> str:
    """`stats` field: trainer `rank`'s running totals (JSON)."""
    return f"rank{rank}"


def is_trainer_stats_field(field: bytes) -> bool:
    return field.startswith(b"rank")


def truncated_field(dp: int) -> str:
    """`counters` field: samples Data Constructor `dp` truncated to fit."""
    return f"truncated:c{dp}"


# -- the schema as data, for the reference ----------------------------------------------


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
        "planner",
        "planner",
        "hash",
        "the Planner's state",
        "Planner, sidecar (done)",
        "loaders, sidecar, status",
        fields=(
            Field("step", "int", "last step planned"),
            Field("updated", "float (unix time)", "when it was"),
            Field("done", "1", "the last step is planned (or the job ended)"),
            Field("token", "int", "fencing token of the leading Planner"),
            Field("lease", "str", "the leader's lease value"),
            Field("leader_since", "float (unix time)", "when it took the lead"),
            Field("pressure", "float", "transform CPU demand over budget"),
            Field("node_pressure", "JSON {node: float}", "per node, several nodes"),
        ),
        example="HGETALL",
    ),
    Key(
        "plan",
        "plan:<step>",
        "string",
        "the step's plan (JSON: per DP group, per micro-batch, [stream, epoch, seq])",
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
        fields=(Field("step", "int", "the step published"),),
        example="XREVRANGE {k} + - COUNT 5",
    ),
    Key(
        "meta",
        "meta:<stream>",
        "stream",
        "buffer metadata of one Source Loader stream (overlord.plan.meta)",
        "Source Loader",
        "Planner",
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
            Field("c<dp>", "int", "last step Data Constructor dp wrote to its clients' rings"),
            Field("t<dp>", "int", "trainers' mark: 1 + the step of the last batch every rank of the group was handed"),
            Field("r<dp>", "<pid>.<time>:<step>", "replay request of a restarted Data Constructor"),
        ),
        example="HGETALL",
    ),
    Key(
        "progressed",
        "progressed",
        "stream",
        "one entry per rise of a c<dp> or t<dp>; the Planner blocks on it",
        "Data Constructors, marks",
        "Planner",
        fields=(Field("c | t", "int (dp)", "which field rose"),),
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
            Field("skipped:<stream>", "int", "samples skipped (on_error)"),
            Field("truncated:c<dp>", "int", "samples Data Constructor dp truncated"),
            Field("dropped_last", "int", "samples a finite job's end left undelivered"),
            Field("over_budget_intervals", "int", "scaling intervals over budget"),
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
        "samples the Planner needs each stream to hold (when a step takes more than buffer_samples)",
        "Planner",
        "loaders",
        fields=(Field("<stream>", "int", ""),),
        example="HGETALL",
    ),
    Key(
        "ckpt",
        "ckpt",
        "hash",
        "full planner state (cursors, round robin, deferred, RNG, schedule) before a step's plan, every 64 steps (and the first), back to 1024 steps",
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
        "active Source Loader process per loader index",
        "sidecar, Planner",
        "loaders, status",
        fields=(Field("<index>", "int (pid)", ""),),
        example="HGETALL",
    ),
    Key(
        "promotions",
        "promotions",
        "stream",
        "one entry per Shadow Loader promoted",
        "Planner",
        "status",
        fields=(Field("loader, pid, node, previous, reason, time", "str", ""),),
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
        "JSON {partitions per source, loader processes, costs_ms} chosen at start with autoscale",
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
        fields=(Field("step, source, workers, share, rate, cost_ms, time", "str", ""),),
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
            Field("step", "int", "the step the job resumes at (sidecar)"),
            Field("position:<rank>", "JSON [step, micro-batch]", "where trainer rank resumes (trainer)"),
            Field("skip:<rank>", "int", "batches of that step trainer rank already had (sidecar)"),
            Field("rewind:<rank>", "JSON {pid, at}", "a trainer asking a spawned sidecar to restart earlier"),
        ),
        example="HGETALL",
    ),
    Key(
        "placement",
        "placement",
        "hash",
        "which node runs each unit (several nodes)",
        "Planner, sidecar",
        "sidecars, bridges, trainers",
        fields=(Field("loader<k> | constructor<h>", "str (node)", ""),),
        example="HGETALL",
    ),
    Key(
        "placements",
        "placements",
        "stream",
        "one entry per unit the Planner moved",
        "Planner",
        "status",
        fields=(Field("unit, from, to, reason, time", "str", ""),),
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
        "loaders, trainers",
        "top, status, metrics",
        fields=(
            Field(
                "loader<k>",
                "JSON {node, pid, time, step, kept_bytes, arrow_bytes, streams}",
                "totals of loader process k, once a second",
            ),
            Field(
                "rank<r>",
                "JSON {node, pid, time, batches, wait_s, dropped, step, done}",
                "totals of trainer rank r, once a second",
            ),
        ),
        example="HGETALL",
    ),
)
