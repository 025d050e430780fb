"""A sidecar started with `--resume`: the job continues where its trainers' states say,
from the planner checkpoints kept in Redis, instead of at step 0.

The sidecar publishes the job keeping its checkpoints (if its sources' partitions did
not change: the checkpoints' cursors are per partition), creates its rings, then waits
for every trainer's `load_state_dict` position (the `resume` hash). The earliest
rank's step is where the job resumes; each rank skips the micro-batches it already
consumed past it. A resume after the last step of a finite job starts no role: every
trainer's iteration ends at once.
"""

from __future__ import annotations

import json
import logging
import time

from overlord.config import Job
from overlord.errors import OverlordError
from overlord.plan.checkpoint import Checkpoints
from overlord.runtime.layout import Layout
from overlord.shm import Ring
from overlord.sidecar import mode
from overlord.store import Keys
from overlord.store.schema import PLANNER_DONE, PLANNER_UPDATED, RESUME_STEP, skip_field
from overlord.store.schema import positions as read_positions

log = logging.getLogger("overlord.sidecar")

POLL_S = 0.02


def streams_of(layout: Layout) -> dict:
    """What planner checkpoints depend on: the streams (source partitions), not which
    process hosts them or how many DP groups there are."""
    return {"streams": layout.streams, "stream_source": layout.stream_source}


def check_layout(job: Job, r, keys: Keys, layout: Layout) -> None:
    """Raise OverlordError when the checkpoints were written for other streams."""
    previous = r.get(keys.ckpt_layout)
    if previous is not None and json.loads(previous) != streams_of(layout):
        raise OverlordError(
            f"cannot resume job {job.name!r}: its sources or partitions changed since the "
            "checkpoints were written (their cursors are per source partition); start it fresh "
            "(without --resume)"
        )


def await_positions(job: Job, r, keys: Keys) -> bool:
    """Wait for every trainer's `load_state_dict` position, then fix the resume step
    (the earliest) and how many micro-batches each rank already consumed past it.
    Returns whether every rank is past the last step of a finite job (nothing to run)."""
    world, mb = job.mesh.world_size, job.batch.micro_batches
    deadline = time.monotonic() + job.timeout_s
    while True:
        raw = r.hgetall(keys.resume)
        positions = read_positions(raw, world)
        if len(positions) == world:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(positions))
            raise OverlordError(
                f"resuming job {job.name!r}: rank(s) {missing} did not report a position within "
                f"{job.timeout_s:g}s; every trainer must call DataLoader.load_state_dict() before iterating"
            )
        time.sleep(POLL_S)
    step = min(p[0] for p in positions.values())
    kept = Checkpoints(keys).steps(r)
    if step not in kept:
        raise OverlordError(
            f"resuming job {job.name!r} at step {step}: no planner checkpoint for it "
            f"(kept: steps {kept[:1]}..{kept[-1:]}); the trainers' state is older than what Redis kept"
        )
    later = [s for s in kept if s > step]  # the old run's future: the resumed run writes its own
    if later:
        r.hdel(keys.ckpt, *later)
        r.hdel(keys.ckpt_delta, *later)
    mapping = {RESUME_STEP: step, **{skip_field(rank): (p[0] - step) * mb + p[1] for rank, p in positions.items()}}
    r.hset(keys.resume, mapping=mapping)
    mode.write(job, resume=True, decided=True, spawned=mode.spawned_here())
    log.info(
        "resuming job %r at step %d (micro-batches already consumed per rank: %s)",
        job.name,
        step,
        {rank: mapping[skip_field(rank)] for rank in positions},
    )
    # the state before `step` says the job's last step came before it
    return bool(Checkpoints(keys).load(r, step).get("done"))


def end_at_once(job: Job, r, keys: Keys, client_rings: list[Ring]) -> None:
    """A resume after the last step of a finite job: start no role, mark the job done
    and close every client ring, so each trainer's iteration ends at once (the ring
    drains, then says closed) instead of waiting for batches no step will bring."""
    log.info("resuming job %r after its last step: nothing left to deliver; the trainers' iteration ends", job.name)
    r.hset(keys.planner, mapping={PLANNER_DONE: 1, PLANNER_UPDATED: time.time()})
    for ring in client_rings:
        ring.close_writer()
