"""The Redis schema: every key, hash field, stream entry field and value encoding Overlord uses.

Key names are built by `overlord.store.keys.Keys`; every hash field, stream entry field
and value encoding is named, built and parsed here, and nowhere else: the fixed names
as constants grouped per key (`PLANNER_STEP`, `RESUME_STEP`, `COUNTER_DROPPED_LAST`,
...), the fields that carry a number or a name (`c<dp>`, `skip:<rank>`, `loader<k>`,
...) by a function per field, the values with a format of their own (JSON records,
replay requests, trainer positions, rewind requests, checkpoints) by an encoder and a
decoder, and each stream's entries by a function that builds one. `catalog.py`
describes every key as data with these same names, for the reference a `redis-cli`
user reads (docs/reference/redis.md).

All keys of a job share the hash tag `{<job>}` so they live in one Redis Cluster slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.store.keys import Keys

if TYPE_CHECKING:  # annotations only: a trainer on one node never loads redis-py
    import redis


def _text(field: bytes | str) -> str:
    return field.decode() if isinstance(field, bytes) else field


def _entry(names: tuple[str, ...], *values: Any) -> dict[str, Any]:
    """A stream entry: `names` (its fields, in the order Redis keeps them) with `values`."""
    return dict(zip(names, values, strict=True))


def _now(now: float | None) -> float:
    return time.time() if now is None else now


# -- the `planner` hash ------------------------------------------------------------------

PLANNER_STEP = "step"  # int: the last step planned
PLANNER_UPDATED = "updated"  # float (unix time): when it was
PLANNER_DONE = "done"  # 1: the last step is planned (or the job ended)
PLANNER_TOKEN = "token"  # int: the leading Planner's generation (fence); loaders tag reports with it
PLANNER_LEASE = "lease"  # int: the leader's lease token
PLANNER_LEADER_SINCE = "leader_since"  # float (unix time): when it took the lead
PLANNER_PRESSURE = "pressure"  # float: transform CPU demand over the loaders' budget
PLANNER_NODE_PRESSURE = "node_pressure"  # JSON {node: float}: the same per node (several nodes)
PLANNER_DURABLE = "durable"  # int: the last step whose plan and checkpoint Redis confirmed durable
PLANNER_DURABLE_MS = "durable_ms"  # float: how long the wait for the step before it took


@dataclass(frozen=True, slots=True)
class PlannerState:
    """The `planner` hash, decoded (`planner_state`)."""

    step: int | None  # None: nothing planned yet
    done: bool
    token: int | None
    pressure: float | None
    node_pressure: dict[str, float]


def planner_state(planner: Mapping[bytes, bytes]) -> PlannerState:
    """The `planner` hash from its HGETALL."""
    fields = {_text(k): _text(v) for k, v in planner.items()}
    return PlannerState(
        step=int(fields[PLANNER_STEP]) if PLANNER_STEP in fields else None,
        done=bool(fields.get(PLANNER_DONE)),
        token=int(fields[PLANNER_TOKEN]) if PLANNER_TOKEN in fields else None,
        pressure=float(fields[PLANNER_PRESSURE]) if PLANNER_PRESSURE in fields else None,
        node_pressure=json.loads(fields.get(PLANNER_NODE_PRESSURE) or "{}"),
    )


def planner_step(r: redis.Redis, keys: Keys) -> int | None:
    """The last step planned; None before the first."""
    raw = r.hget(keys.planner, PLANNER_STEP)
    return int(raw) if raw is not None else None


def planner_done(r: redis.Redis, keys: Keys) -> bool:
    """Whether the job's last step is planned (or the job ended)."""
    return bool(r.hget(keys.planner, PLANNER_DONE))


def encode_node_pressure(pressure: Mapping[str, float]) -> str:
    """A `node_pressure` value: JSON {node: pressure}, sorted by node, to 3 decimals."""
    return json.dumps({n: round(p, 3) for n, p in sorted(pressure.items())})


# -- the `plans` stream ------------------------------------------------------------------

PLANS_FIELDS = ("step", "last")  # int: the step published; 0/1: it is the job's last


def plans_entry(step: int, last: bool) -> dict[str, Any]:
    """The `plans` entry announcing the plan of `step`."""
    return _entry(PLANS_FIELDS, step, int(last))


def plans_entry_id(step: int) -> str:
    """The id of that entry: `<step+1>-0`, so a reader waiting for step t cannot miss it."""
    return f"{step + 1}-0"


def plans_entry_step(entry_id: bytes | str) -> int:
    """The step a `plans` entry announces, from its id (`plans_entry_id`)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0]) - 1


def plans_after(step: int) -> str:
    """The id an XREAD waiting for the plan of `step` reads after: `<step>-0`."""
    return f"{step}-0"


# -- the `demand` hash and the `demanded` stream ----------------------------------------

DEMANDED_MAXLEN = 256  # entries the `demanded` stream keeps, about (a loader reads the hash when it starts)
DEMAND_HOLD_STEPS = 32  # planned steps in a row that took less of a stream than its demand before it is lowered


def demanded_values(fields: Mapping[bytes, bytes]) -> dict[str, int]:
    """stream -> samples it must hold, from a `demand` hash or a `demanded` entry as Redis
    returns them (both carry the same fields)."""
    return {k.decode(): int(v) for k, v in fields.items()}


# -- the `meta:<stream>` streams (overlord.plan.meta) ------------------------------------

META_ARRAYS = {"seq": "<i8", "tokens": "<i4", "patches": "<i4", "nbytes": "<i8"}  # one item per sample
META_EPOCH = "epoch"  # ASCII int: epoch of every sample in the chunk
META_ENDED = "ended"  # ASCII JSON [[epoch, samples delivered in that epoch], ...]: epochs completed
META_FINAL = "final"  # ASCII 0/1: the loader has read every configured epoch
META_TOKEN = "token"  # ASCII int: the Planner generation the loader reported to


def meta_entry(
    arrays: Mapping[str, Any], epoch: int, ended: Iterable[Iterable[int]], final: bool, token: int
) -> dict[str, bytes]:
    """A `meta:<stream>` entry: the per-sample `arrays` (by the names of `META_ARRAYS`,
    as little-endian bytes) and the chunk's scalars."""
    out = {name: np.ascontiguousarray(arrays[name], dtype=dt).tobytes() for name, dt in META_ARRAYS.items()}
    out[META_EPOCH] = str(epoch).encode()
    out[META_ENDED] = json.dumps([list(e) for e in ended]).encode()
    out[META_FINAL] = b"1" if final else b"0"
    out[META_TOKEN] = str(token).encode()
    return out


def meta_fields(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    """Inverse of `meta_entry` (field names as bytes, as redis-py returns them): field -> value.

    Raises:
        ValueError: the arrays disagree in length.
    """
    arrays = {name: np.frombuffer(fields[name.encode()], dtype=dt).astype(dt[1:]) for name, dt in META_ARRAYS.items()}
    if len({len(a) for a in arrays.values()}) != 1:
        raise ValueError(f"meta chunk arrays disagree in length: { {k: len(v) for k, v in arrays.items()} }")
    return {
        **arrays,
        META_EPOCH: int(fields[META_EPOCH.encode()]),
        META_ENDED: [tuple(e) for e in json.loads(fields[META_ENDED.encode()])],
        META_FINAL: fields[META_FINAL.encode()] == b"1",
        META_TOKEN: int(fields.get(META_TOKEN.encode(), b"0")),
    }


# -- the `progress` hash and the `progressed` stream -------------------------------------

BUILT = "c"  # `progress` c<dp>; a `progressed` entry {c: dp, v: step}: Data Constructor dp wrote a step
CONSUMED = "t"  # `progress` t<dp>; a `progressed` entry {t: dp, v: mark}: the trainers' mark of group dp rose
REPLAY = "r"  # `progress` r<dp>: Data Constructor dp, restarted, asks the loaders to resend
OWNER = "o"  # `progress` o<dp>: the Data Constructor of dp that may write its marks now
PROGRESSED_VALUE = "v"  # a `progressed` entry's new value of the field it names


def built_field(dp: int) -> str:
    """`progress` field: the last step Data Constructor `dp` wrote to its clients' rings."""
    return f"{BUILT}{dp}"


def consumed_field(dp: int) -> str:
    """`progress` field: the trainers' mark of DP group `dp` (overlord.constructor.marks)."""
    return f"{CONSUMED}{dp}"


def replay_field(dp: int) -> str:
    """`progress` field: the replay request of Data Constructor `dp`, restarted."""
    return f"{REPLAY}{dp}"


def owner_field(dp: int) -> str:
    """`progress` field: the `<pid>.<time>` of the Data Constructor of `dp` that may
    write its marks (set when it starts; one that finds another there writes nothing more)."""
    return f"{OWNER}{dp}"


def built_entry(dp: int, step: int) -> dict[str, int]:
    """The `progressed` entry of a rise of `c<dp>` to `step`."""
    return {BUILT: dp, PROGRESSED_VALUE: step}


def consumed_entry(dp: int, mark: int) -> dict[str, int]:
    """The `progressed` entry of a rise of `t<dp>` to `mark`."""
    return {CONSUMED: dp, PROGRESSED_VALUE: mark}


def progressed_mark(fields: Mapping[bytes, bytes]) -> tuple[str, int | None]:
    """(the `progress` field, its new value) from a `progressed` entry, as XREAD returns
    it; the value is None in an entry of a writer that did not carry it (read the hash).

    Raises:
        ValueError: the entry names neither a `c<dp>` nor a `t<dp>`.
    """
    for name in (BUILT, CONSUMED):
        dp = fields.get(name.encode())
        if dp is not None:
            value = fields.get(PROGRESSED_VALUE.encode())
            return f"{name}{int(dp)}", None if value is None else int(value)
    raise ValueError(f"a `progressed` entry names neither {BUILT} nor {CONSUMED}: {dict(fields)!r}")


def replay_request(pid: int, step: int) -> str:
    """A `r<dp>` value: `<pid>.<time>:<step>`, unique per request, asking the loaders to resend from `step`."""
    return f"{replay_requester(pid)}:{step}"


def replay_requester(pid: int) -> str:
    """The `<pid>.<time>` a replay request starts with (a script adds `:<step>`)."""
    return f"{pid}.{time.time():.6f}"


def replay_step(request: bytes | str) -> str:
    """The step (as text) a replay request asks for."""
    text = request.decode() if isinstance(request, bytes) else request
    return text.rsplit(":", 1)[1]


def built(progress: Mapping[bytes, bytes], dp: int, default: int) -> int:
    """The last step Data Constructor `dp` wrote, from a `progress` HGETALL; `default` when none yet."""
    return int(progress.get(built_field(dp).encode(), default))


def unread(progress: Mapping[bytes, bytes], dp: int, default: int) -> int:
    """The first step DP group `dp`'s trainers may not have read whole, from a `progress`
    HGETALL: the step of their mark t<dp> (the step after the last one a trainer was
    handed a micro-batch of, which may still have micro-batches to come, so one back);
    `default` when they consumed nothing yet. Everything before it reached every rank."""
    raw = progress.get(consumed_field(dp).encode())
    return max(default, int(raw) - 1) if raw is not None else default


def replay(progress: Mapping[bytes, bytes], dp: int) -> bytes | None:
    """Data Constructor `dp`'s replay request, from a `progress` HGETALL; None when none."""
    return progress.get(replay_field(dp).encode())


def is_built_field(field: bytes | str) -> bool:
    return _text(field).startswith(BUILT)


def is_consumed_field(field: bytes | str) -> bool:
    return _text(field).startswith(CONSUMED)


def is_replay_field(field: bytes | str) -> bool:
    return _text(field).startswith(REPLAY)


def dp_of(field: bytes | str) -> int:
    """The DP group a `c<dp>`, `t<dp>` or `r<dp>` field names."""
    return int(_text(field)[1:])


# -- the `resume` hash -------------------------------------------------------------------

RESUME_STEP = "step"  # int: the step the job resumes at (the sidecar decides it)
RESUME_AWAITING = "awaiting"  # 1 from a resumed run's publish until its step is decided (several nodes)
POSITION = "position:"  # + rank
SKIP = "skip:"  # + rank
REWIND = "rewind:"  # + rank


def resume_step(r: redis.Redis, keys: Keys) -> int | None:
    """The step the sidecar chose to resume the job at; None for a fresh start."""
    raw = r.hget(keys.resume, RESUME_STEP)
    return int(raw) if raw is not None else None


def resume_fields(resume: Mapping[bytes, bytes]) -> dict[str, Any]:
    """Every field of a `resume` HGETALL, decoded (each value is JSON: a number, a list or an object)."""
    return {_text(k): json.loads(v) for k, v in resume.items()}


def position_field(rank: int) -> str:
    """`resume` field: where trainer `rank` resumes (JSON [step, micro-batch])."""
    return f"{POSITION}{rank}"


def skip_field(rank: int) -> str:
    """`resume` field: batches of the resume step trainer `rank` already had."""
    return f"{SKIP}{rank}"


def rewind_field(rank: int) -> str:
    """`resume` field: trainer `rank` asks a spawned sidecar to restart at an earlier state."""
    return f"{REWIND}{rank}"


def is_rewind_field(field: bytes | str) -> bool:
    return _text(field).startswith(REWIND)


def rank_of(field: bytes | str) -> int:
    """The rank a `position:`, `skip:` or `rewind:` field names."""
    return int(_text(field).split(":")[1])


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


def rewinds(resume: Mapping[bytes, bytes]) -> dict[int, int]:
    """rank -> pid of each trainer that asks for a rewind, from a `resume` HGETALL."""
    return {rank_of(k): json.loads(v)["pid"] for k, v in resume.items() if is_rewind_field(k)}


# -- the `rewind` hash (several nodes) ------------------------------------------------

ASKED = "asked:"  # + rank
STOPPED = "stopped:"  # + node
REWIND_PUBLISHED = "published"  # the node whose sidecar published the rewound run


def asked_field(rank: int) -> str:
    """`rewind` field: trainer `rank` loaded an earlier state and asks the job to go back (JSON {pid, at})."""
    return f"{ASKED}{rank}"


def stopped_field(node: str) -> str:
    """`rewind` field: the sidecar of `node` stopped every role it ran for the rewind."""
    return f"{STOPPED}{node}"


def stopped_nodes(rewind: Mapping[bytes, bytes]) -> set[str]:
    """The nodes whose sidecar stopped its roles, from a `rewind` HGETALL."""
    return {_text(k)[len(STOPPED) :] for k in rewind if _text(k).startswith(STOPPED)}


def rewind_published(rewind: Mapping[bytes, bytes]) -> str | None:
    """The node that published the rewound run, or None while none did."""
    raw = rewind.get(REWIND_PUBLISHED.encode())
    return raw.decode() if raw is not None else None


# -- the `stats` hash --------------------------------------------------------------------

LOADER_STATS = "loader"  # + loader process index
TRAINER_STATS = "rank"  # + rank


def loader_stats_field(index: int) -> str:
    """`stats` field: loader process `index`'s running totals (JSON)."""
    return f"{LOADER_STATS}{index}"


def trainer_stats_field(rank: int) -> str:
    """`stats` field: trainer `rank`'s running totals (JSON)."""
    return f"{TRAINER_STATS}{rank}"


def is_loader_stats_field(field: bytes | str) -> bool:
    return _text(field).startswith(LOADER_STATS)


def is_trainer_stats_field(field: bytes | str) -> bool:
    return _text(field).startswith(TRAINER_STATS)


def stats_rank(field: bytes | str) -> int:
    """The rank a `rank<r>` field names."""
    return int(_text(field)[len(TRAINER_STATS) :])


def encode_record(record: Mapping[str, Any]) -> str:
    """A JSON record: a `stats` value (running totals), a `nodes` value (a member)."""
    return json.dumps(record)


def decode_record(raw: bytes | str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(raw)
    return record


def trainer_record(pid: int, totals: Mapping[str, Any]) -> dict[str, Any]:
    """A trainer's `stats` record (rank<r>) but for its node: its pid, the time, its
    running totals."""
    return {"pid": pid, "time": round(time.time(), 3), **totals}


def encode_trainer_note(pid: int, totals: Mapping[str, Any]) -> bytes:
    """A trainer's record as it leaves it in its ring's consumer note (a job on one
    node): compact JSON, under 200 bytes whatever its counts, without the node its Data
    Constructor host adds when it publishes it (`note_record`)."""
    return json.dumps(trainer_record(pid, totals), separators=(",", ":")).encode()


def note_record(note: bytes, node: str) -> str | None:
    """The `stats` record (rank<r>) of a trainer's consumer note read on `node`; None
    where the note is not a JSON object."""
    try:
        record = json.loads(note)
    except ValueError:
        return None
    return encode_record({"node": node, **record}) if isinstance(record, dict) else None


def encode_contact(at: float) -> bytes:
    """A Data Constructor host's note on its rings: when (epoch seconds) it last wrote to
    the job's Redis, which dates an outage for the trainers it serves."""
    return json.dumps({"redis": round(at, 3)}).encode()


def contact_of(note: bytes | None) -> float | None:
    """The time in a host's `encode_contact` note, or None."""
    try:
        value = json.loads(note)["redis"] if note else None
    except (ValueError, TypeError, KeyError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def json_records(raw: Mapping[bytes, bytes]) -> dict[str, dict[str, Any]]:
    """field -> record, from the HGETALL of a hash of JSON records (`stats`, `nodes`)."""
    return {_text(k): json.loads(v) for k, v in raw.items()}


# -- the `counters` hash -----------------------------------------------------------------

COUNTER_DROPPED_LAST = "dropped_last"  # int: samples a finite job's end left undelivered
COUNTER_OVER_BUDGET = "over_budget_intervals"  # int: scaling intervals over the loaders' CPU budget
TRUNCATED = "truncated:c"  # + dp
COPIED = "copied:c"  # + dp
SKIPPED = "skipped:"  # + stream: rows the stream skipped (every cause)
SKIPPED_FILE = "skipped_file:"  # + stream + ":" + uri: 1, the file is skipped whole
SKIPPED_GROUPS = "skipped_groups:"  # + stream + ":" + uri: row groups of the file skipped
SKIPPED_ROWS = "skipped_rows:"  # + stream + ":" + uri: rows of the file skipped
SKIPPED_PER_FILE = {SKIPPED_FILE: "whole", SKIPPED_GROUPS: "groups", SKIPPED_ROWS: "rows"}


def truncated_field(dp: int) -> str:
    """`counters` field: samples Data Constructor `dp` truncated to fit."""
    return f"{TRUNCATED}{dp}"


def copied_field(dp: int) -> str:
    """`counters` field: samples Data Constructor `dp` copied out of a loader ring
    instead of reading them in place (overlord.constructor.inputs)."""
    return f"{COPIED}{dp}"


def skipped_field(stream: str) -> str:
    """`counters` field: rows `stream` skipped (on_error: skip)."""
    return f"{SKIPPED}{stream}"


def skipped_file_field(stream: str, uri: str) -> str:
    """`counters` field: `stream` skips file `uri` whole."""
    return f"{SKIPPED_FILE}{stream}:{uri}"


def skipped_groups_field(stream: str, uri: str) -> str:
    """`counters` field: row groups of file `uri` that `stream` skipped (each unreadable)."""
    return f"{SKIPPED_GROUPS}{stream}:{uri}"


def skipped_rows_field(stream: str, uri: str) -> str:
    """`counters` field: rows of file `uri` that `stream` skipped (those of its skipped row groups too)."""
    return f"{SKIPPED_ROWS}{stream}:{uri}"


def skipped_file_of(field: bytes | str) -> tuple[str, str, str] | None:
    """(what, stream, uri) of a per-file skip field ("whole", "groups" or "rows"); None for another field."""
    text = _text(field)
    prefix = next((p for p in SKIPPED_PER_FILE if text.startswith(p)), None)
    if prefix is None:
        return None
    stream, uri = text[len(prefix) :].split(":", 1)  # source names hold no ':'
    return SKIPPED_PER_FILE[prefix], stream, uri


def counter_values(raw: Mapping[bytes, bytes]) -> dict[str, int]:
    """field -> count, from a `counters` HGETALL."""
    return {_text(k): int(v) for k, v in raw.items()}


# -- the `ckpt` and `ckpt-delta` hashes --------------------------------------------------


def encode_checkpoint(state: Mapping[str, Any]) -> str:
    """A `ckpt` or `ckpt-delta` value: compact JSON."""
    return json.dumps(state, separators=(",", ":"))


def decode_checkpoint(raw: bytes | str) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(raw)
    return state


# -- the `active` hash: loader process index -> the process that delivers its samples ----


def encode_active(pid: int, node: str) -> str:
    """An `active` value: the Source Loader process `pid` on `node` (a pid alone names
    no process on a job of several nodes: each node has pids of its own)."""
    return json.dumps({"pid": pid, "node": node}, separators=(",", ":"))


def decode_active(raw: bytes | str | None) -> tuple[int, str] | None:
    """(pid, node) of an `active` value; None for none."""
    if raw is None:
        return None
    record = json.loads(raw)
    return int(record["pid"]), str(record["node"])


# -- the Planner's logs: `promotions`, `placements`, `scaling`, `handoffs` and `reshards` streams ------

PROMOTION_FIELDS = ("loader", "pid", "node", "previous", "time", "reason")
MOVE_FIELDS = ("unit", "from", "to", "reason", "time")
SCALING_FIELDS = ("step", "source", "workers", "rate", "demand", "cost_ms", "time")
HANDOFF_FIELDS = ("step", "stream", "from", "to", "reason", "time")
RESHARD_FIELDS = ("step", "source", "from", "to", "streams", "reason", "time")


def promotion_entry(
    loader: int, pid: int, node: str, previous: bytes | str, reason: str, now: float | None = None
) -> dict[str, Any]:
    """The `promotions` entry of a Shadow Loader (`pid` on `node`) promoted over `previous`."""
    return _entry(PROMOTION_FIELDS, loader, pid, node, previous, _now(now), reason)


def move_entry(unit: str, before: str, to: str, reason: str, now: float | None = None) -> dict[str, Any]:
    """The `placements` entry of `unit` moved from node `before` ("" when unplaced) to `to`."""
    return _entry(MOVE_FIELDS, unit, before, to, reason, _now(now))


def handoff_entry(
    step: int, stream: str, before: int, to: int, reason: str, now: float | None = None
) -> dict[str, Any]:
    """The `handoffs` entry of `stream` served by loader process `to` from `step` on
    (`before`: the one that served it until then; -1 for a refused request)."""
    return _entry(HANDOFF_FIELDS, step, stream, before, to, reason, _now(now))


def reshard_entry(
    step: int, source: str, before: int, to: int, streams: str, reason: str, now: float | None = None
) -> dict[str, Any]:
    """The `reshards` entry of `source` read by `to` streams (`streams`, comma-separated)
    from `step` on instead of `before`; `to` -1 for a refused request."""
    return _entry(RESHARD_FIELDS, step, source, before, to, streams, reason, _now(now))


def scaling_entry(
    step: int, source: str, workers: int, rate: float, demand: float, cost_ms: float, now: float | None = None
) -> dict[str, Any]:
    """The `scaling` entry of `source`'s transform workers set at `step`."""
    return _entry(SCALING_FIELDS, step, source, workers, rate, demand, cost_ms, _now(now))


def log_entries(entries: Iterable[tuple[bytes, Mapping[bytes, bytes]]]) -> list[dict[str, str]]:
    """The entries of an XRANGE of one of these streams, as text."""
    return [{_text(k): _text(v) for k, v in fields.items()} for _, fields in entries]
