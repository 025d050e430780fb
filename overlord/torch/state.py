"""The DataLoader's state: one small, job-wide dict that any rank saves and every rank loads.

Frameworks save the loader state of one rank: Lightning keeps global rank 0's
`state_dict()` in its checkpoint (`loops.fit_loop.combined_loader`), Accelerate's
`save_state` writes the registered objects' states from the main process only. Every
rank then loads that one state. So the state says where *every* rank is:

    {"format": 2, "job": "demo", "mesh": [dp, pp, cp, tp], "micro_batches": M,
     "world_size": W, "rank": r,                  # the rank that saved it (a label)
     "step": s, "microbatch": m, "batches": b,    # the position of every rank ...
     "positions": {"3": [s3, m3, b3]},            # ... except these (only merge() writes it)
     "end": false}                                # true: the job's last batch was consumed

How rank 0 knows the others' positions, exactly. The position is not read from the
other ranks (their ring marks or Redis): at the moment one rank saves, another may be
one batch ahead or behind in wall-clock time, so any read races. It is deduced: every
rank of a job receives the same sequence of (step, micro-batch) positions, M per step
(a plan with samples gives every micro-batch of every bucket at least one sample), and
a synchronous data-parallel job (DDP, FSDP, pipeline schedules: every optimizer step
waits for all ranks) has every rank at the same count of consumed micro-batches
whenever it saves a checkpoint. So the saving rank's own position is every rank's.
A job whose ranks consume at different counts (not data-parallel in lockstep) can
save every rank's `state_dict()` and combine them with `merge()`; or load each rank's
own state on that rank, which is always exact.

The position is what this DataLoader has *yielded*. A framework that fetches a batch
before the model has processed the previous one and saves the state in between must
save the state of the batch it processed; see `prefetch rule` in the DataLoader's
`state_dict` docstring and overlord.lightning.

States of the first format (no "format" key: job, rank, batches, step, microbatch, mesh,
micro_batches) load too, on every rank, by the same rule.

The length of a finite job (`length()`): steps = (samples of every weighted source x
epochs) / global_batch, the last partial step kept when `drop_last` is False and it can
give every micro-batch of every DP group a sample (overlord.plan.dgraph); each rank
gets M micro-batches per step. That count is exact only when the set of samples is known
before the job runs; it is None (no length) for a dynamic or scheduled mixture
(`Job.mixing`: its weights may leave a source unread at the end) and for a source with
`on_error: skip` (skipped rows are found while reading).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlord.config import Job
from overlord.errors import ConfigError, SourceReadError

FORMAT = 2
_BEFORE = (-1, -1)  # the position before the first batch


@dataclass(frozen=True, slots=True)
class Position:
    """Where a rank stands: the last (step, micro-batch) it consumed and how many it has."""

    step: int = -1
    microbatch: int = -1
    batches: int = 0
    end: bool = False  # the job's last batch is consumed: nothing follows

    @property
    def last(self) -> tuple[int, int]:
        return (self.step, self.microbatch)

    def next(self, micro_batches: int) -> tuple[int, int]:
        """The (step, micro-batch) of the batch after this one."""
        if self.last == _BEFORE:
            return (0, 0)
        return next_of(self.last, micro_batches)


def next_of(position: tuple[int, int], micro_batches: int) -> tuple[int, int]:
    step, mb = position[0], position[1] + 1
    return (step + 1, 0) if mb == micro_batches else (step, mb)


def mesh_of(job: Job) -> list[int]:
    m = job.mesh
    return [m.dp, m.pp, m.cp, m.tp]


def make(job: Job, rank: int, position: Position) -> dict[str, Any]:
    """The job-wide state of a job whose ranks stand where `rank` does (see module docstring)."""
    return {
        "format": FORMAT,
        "job": job.name,
        "mesh": mesh_of(job),
        "micro_batches": job.batch.micro_batches,
        "world_size": job.mesh.world_size,
        "rank": rank,
        "step": position.step,
        "microbatch": position.microbatch,
        "batches": position.batches,
        "end": position.end,
    }


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One job-wide state from every rank's own `state_dict()`, exact when ranks stand at
    different positions (a job whose ranks do not consume in lockstep).

    Raises:
        ConfigError: the states are of different jobs or meshes, or none is given.
    """
    if not states:
        raise ConfigError("merge() needs at least one state")
    base = dict(states[0])
    for s in states[1:]:
        if (s.get("job"), s.get("mesh")) != (base.get("job"), base.get("mesh")):
            raise ConfigError(
                f"cannot merge states of job {s.get('job')!r} mesh {s.get('mesh')} with "
                f"job {base.get('job')!r} mesh {base.get('mesh')}"
            )
    base["format"] = FORMAT
    base["positions"] = {
        str(s["rank"]): [s["step"], s["microbatch"], s["batches"]]
        for s in states[1:]
        if (s["step"], s["microbatch"]) != (base["step"], base["microbatch"])
    }
    base["end"] = all(s.get("end", False) for s in states)
    return base


def load(job: Job, rank: int, state: dict[str, Any]) -> Position:
    """The position `rank` resumes after, from a state of `state_dict()` (either format).

    A state from another mesh (another DP size) is accepted at a step boundary: the
    Planner's cursors are per source, not per rank, so the job continues exactly once
    on the new mesh from the step after it.

    Raises:
        ConfigError: the state belongs to another job, is malformed, or is of another mesh
            and not at a step boundary.
    """
    if not isinstance(state, dict) or "job" not in state:
        raise ConfigError(
            f"not an overlord.torch.DataLoader state (a dict with 'job', 'step', 'microbatch', "
            f"'batches'): {str(state)[:200]}"
        )
    if state["job"] != job.name:
        raise ConfigError(f"the state is of job {state['job']!r}, not {job.name!r}; load the state this job saved")
    if state.get("format", 1) > FORMAT:
        raise ConfigError(
            f"the state has format {state['format']}, newer than this Overlord reads ({FORMAT}); upgrade overlord"
        )
    step, mb, batches = int(state["step"]), int(state["microbatch"]), int(state["batches"])
    own = (state.get("positions") or {}).get(str(rank))
    if own is not None:
        step, mb, batches = (int(x) for x in own)
    end = bool(state.get("end", False))
    mesh, micro = mesh_of(job), job.batch.micro_batches
    if state.get("mesh", mesh) != mesh:
        last_mb = micro - 1
        if state.get("micro_batches") != micro or mb != last_mb or state.get("positions"):
            # the Planner's cursors are per source, not per rank: a new mesh can continue
            # from them, but only where every old rank had finished the same step
            raise ConfigError(
                f"resuming job {job.name!r} on mesh dp/pp/cp/tp={mesh} from a state of mesh "
                f"{state.get('mesh')} needs a state taken at a step boundary (after micro-batch {last_mb} of a step, "
                f"with the same micro_batches); this one stopped at step {step} micro-batch "
                f"{mb}. Save the loader state right after a step's last micro-batch"
            )
    if not batches:
        return Position(end=end)
    return Position(step, mb, batches, end)


# -- length of a finite job ---------------------------------------------------------------


def source_rows(job: Job) -> dict[str, int]:
    """Rows of every source, from file metadata (Parquet footers, a JSONL line index,
    Hugging Face Arrow files), the files the Source Loaders will read.

    Raises:
        SourceReadError: a file cannot be listed or opened (naming the source and file).
    """
    # deferred: pyarrow and the file formats (~0.2 s, ~20 MiB mapped) serve len() of a finite job only
    import pyarrow as pa

    from overlord.loader.formats import FORMATS, locations

    rows = {}
    for src in job.sources:
        fmt = FORMATS[src.format]()
        total = 0
        for loc in locations(src.name, src.format, src.paths):
            where = f"source {src.name!r} file {loc.uri!r}"
            try:
                total += sum(fmt.open(loc, where).group_rows())
            except (OSError, pa.ArrowException) as exc:
                raise SourceReadError(
                    f"counting the rows of {where} for len(): {exc}; fix Source.paths or restore the file"
                ) from None
        rows[src.name] = total
    return rows


def unknowable(job: Job) -> str | None:
    """Why the micro-batches of `job` cannot be counted before it runs, or None."""
    if job.epochs is None:
        return "the job runs forever (Job.epochs is None)"
    if job.mixing is not None:
        return "its mixture (Job.mixing) may change which sources are read at the end"
    skipping = [s.name for s in job.sources if s.on_error == "skip"]
    if skipping:
        return f"source(s) {skipping} skip bad rows (on_error: skip), found only while reading"
    return None


def steps_of(job: Job, samples: int) -> int:
    """Steps a finite job of `samples` samples delivers (see overlord.plan.dgraph)."""
    g = job.batch.global_batch
    full, rest = divmod(samples, g)
    if rest and not job.batch.drop_last and rest >= job.mesh.dp * job.batch.micro_batches:
        full += 1  # the final partial step: every micro-batch of every DP group gets a sample
    return full


def length(job: Job, rows: dict[str, int] | None = None) -> int:
    """Micro-batches each rank of a finite `job` receives from its start.

    Raises:
        TypeError: the count is not known before the job runs (see `unknowable`).
    """
    why = unknowable(job)
    if why is not None:
        raise TypeError(f"overlord.torch.DataLoader of job {job.name!r} has no length: {why}")
    if job.epochs is None:  # unknowable() says so first; this keeps the type checker told
        raise TypeError(f"overlord.torch.DataLoader of job {job.name!r} runs forever (Job.epochs is None)")
    rows = source_rows(job) if rows is None else rows
    samples = sum(rows[s.name] for s in job.sources if s.weight > 0) * job.epochs
    return steps_of(job, samples) * job.batch.micro_batches


def remaining(total: int, position: Position, micro_batches: int) -> int:
    """Micro-batches left after `position` of a rank that gets `total` in all."""
    if position.end:
        return 0
    if position.last == _BEFORE:
        return total
    consumed = position.step * micro_batches + position.microbatch + 1
    return max(total - consumed, 0)
