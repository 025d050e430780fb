"""A sidecar started with `--resume`: the job continues where its trainers' states say,
from the planner checkpoints kept in Redis, instead of at step 0.

The sidecar publishes the job keeping its checkpoints (if its sources' partitions did
not change: the checkpoints' cursors are per partition), creates its rings, then waits
for every trainer's `load_state_dict` position (the `resume` hash). The earliest
rank's step is where the job resumes; each rank skips the micro-batches it already
consumed past it. On several nodes every node's sidecar waits, and the first to see
every position decides for all (a sidecar that joins a resumed run meanwhile waits
too: `awaiting` in the `resume` hash); a rewind (overlord.sidecar.rewind) ends the same way. A resume after the last step of a finite job starts no role: every
trainer's iteration ends at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis

from overlord.config import Job
from overlord.errors import OverlordError
from overlord.plan.checkpoint import Checkpoints
from overlord.runtime.layout import Layout
from overlord.shm import Ring
from overlord.sidecar import mode
from overlord.store import Keys
from overlord.store.schema import (
    PLANNER_DONE,
    PLANNER_UPDATED,
    RESUME_AWAITING,
    RESUME_STEP,
    position_field,
    skip_field,
)
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


def await_positions(job: Job, r, keys: Keys, run: int = 1, beat: Callable[[], None] | None = None) -> bool:
    """Wait for every trainer's `load_state_dict` position, then fix the resume step
    (the earliest) and how many micro-batches each rank already consumed past it.
    On several nodes every node's sidecar waits; the first to see every position
    decides (atomically, see `_decide`) and the others take its decision.
    `run`: the sidecar's run, for its mode file (overlord.sidecar.mode); `beat`: keeps
    the node's heartbeat while it waits (on several nodes a sidecar that starts later
    must see this one live, or it would publish the job again). Returns whether every
    rank is past the last step of a finite job (nothing to run)."""
    world = job.mesh.world_size
    deadline = time.monotonic() + job.timeout_s
    while True:
        if beat is not None:
            beat()
        raw = r.hgetall(keys.resume)
        decided = raw.get(RESUME_STEP.encode())
        if decided is not None:  # another node's sidecar decided
            step = int(decided)
            log.info("job %r resumes at step %d (decided by another node's sidecar)", job.name, step)
            break
        positions = read_positions(raw, world)
        if len(positions) == world:
            chosen = _decide(job, r, keys)
            if chosen is not None:
                step = chosen
                break
            continue  # the hash changed while deciding: look again
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(positions))
            raise OverlordError(
                f"resuming job {job.name!r}: rank(s) {missing} did not report a position within "
                f"{job.timeout_s:g}s; every trainer must call DataLoader.load_state_dict() before iterating"
            )
        time.sleep(POLL_S)
    mode.write(job, resume=True, decided=True, spawned=mode.spawned_here(), run=run)
    # the state before `step` says the job's last step came before it
    return bool(Checkpoints(keys).load(r, step).get("done"))


def _decide(job: Job, r, keys: Keys) -> int | None:
    """Fix the resume step from every rank's position, once for the job: in one
    transaction on the `resume` hash (None: it changed meanwhile, look again). The
    positions and a rewind go with the decision, so a later rewind waits for new ones."""
    world, mb = job.mesh.world_size, job.batch.micro_batches
    with r.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(keys.resume)
            raw = pipe.hgetall(keys.resume)
            if RESUME_STEP.encode() in raw:
                return int(raw[RESUME_STEP.encode()])
            positions = read_positions(raw, world)
            step = min(p[0] for p in positions.values())
            kept = Checkpoints(keys).steps(r)
            if step not in kept:
                raise OverlordError(
                    f"resuming job {job.name!r} at step {step}: no planner checkpoint for it "
                    f"(kept: steps {kept[:1]}..{kept[-1:]}); the trainers' state is older than what Redis kept"
                )
            later = [s for s in kept if s > step]  # the old run's future: the resumed run writes its own
            skips = {rank: (p[0] - step) * mb + p[1] for rank, p in positions.items()}
            pipe.multi()
            if later:
                pipe.hdel(keys.ckpt, *later)
                pipe.hdel(keys.ckpt_delta, *later)
            pipe.hset(keys.resume, mapping={RESUME_STEP: step, **{skip_field(rank): n for rank, n in skips.items()}})
            pipe.hdel(keys.resume, RESUME_AWAITING, *[position_field(rank) for rank in positions])
            pipe.delete(keys.rewind)
            pipe.execute()
        except redis.WatchError:
            return None
    log.info("resuming job %r at step %d (micro-batches already consumed per rank: %s)", job.name, step, skips)
    return step


def end_at_once(job: Job, r, keys: Keys, client_rings: list[Ring]) -> None:
    """A resume after the last step of a finite job: start no role, mark the job done
    and close every client ring, so each trainer's iteration ends at once (the ring
    drains, then says closed) instead of waiting for batches no step will bring."""
    log.info("resuming job %r after its last step: nothing left to deliver; the trainers' iteration ends", job.name)
    r.hset(keys.planner, mapping={PLANNER_DONE: 1, PLANNER_UPDATED: time.time()})
    for ring in client_rings:
        ring.close_writer()
