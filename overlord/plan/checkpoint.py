"""Differential planner checkpoints in Redis.

A resume at step t needs the Planner's state before step t's plan: cursors of every
stream, round-robin positions, deferred samples, schedule state. Writing that whole
state every step costs O(streams) (25 KB at 1,000 sources); a step changes the cursors
of only the streams it took samples from. So each step stores a delta and every
`every` steps a full snapshot:

    overlord:{job}:ckpt        hash  step -> full state (JSON), steps 0, every, 2*every, ...
                                     (and wherever a Planner took over)
    overlord:{job}:ckpt-delta  hash  step -> delta (JSON): the state before `step` is the
                                     state before `step - 1` with this delta applied

A delta holds the step, the cursors and round-robin positions that changed, and the
small parts whole (deferred samples, schedule state, done; the reshards, where the step
made one). The delta of step t is
written in the same MULTI as the plan of step t - 1, so a checkpoint never refers to a
plan (or a loader position) that was not written. Loaders keep no checkpoint of their
own: their order is a pure function of (seed, epoch, partition), so they rebuild their
read buffers by replay from these cursors.

Snapshots older than `keep` steps behind the newest are trimmed with the deltas that
lead to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import redis.client

from overlord.errors import PlanError
from overlord.store import Keys
from overlord.store.schema import decode_checkpoint, encode_checkpoint

SNAPSHOT_EVERY = 64
KEEP_STEPS = 1024  # how far behind the newest step a trainer may resume


def apply(state: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The state after `delta` (pure)."""
    rr = list(state["round_robin"])
    for src, value in delta["round_robin"].items():
        rr[int(src)] = value
    reshards = {"reshards": delta["reshards"]} if "reshards" in delta else {}  # only in a reshard step's delta
    return {
        **state,
        "step": delta["step"],
        "cursors": {**state["cursors"], **delta["cursors"]},
        "round_robin": rr,
        "deferred": delta["deferred"],
        "schedule": delta["schedule"],
        "done": delta["done"],
        **reshards,
    }


class Checkpoints:
    """Writes and reads one job's planner checkpoints."""

    def __init__(self, keys: Keys, *, every: int = SNAPSHOT_EVERY, keep: int = KEEP_STEPS) -> None:
        self.keys, self.every, self.keep = keys, every, max(keep, every)

    def snapshot_at(self, step: int) -> bool:
        """Whether the checkpoint of `step` (after a delta) is a full snapshot too."""
        return step % self.every == 0

    def write(
        self, pipe: redis.client.Pipeline, step: int, delta: dict[str, Any] | None, full: Callable[[], dict[str, Any]]
    ) -> None:
        """Queue the checkpoint of `step` (the state before its plan) on `pipe`.

        Args:
            pipe: a Redis pipeline (the caller's MULTI with the plan).
            step: the step this state precedes.
            delta: the change since the state before `step - 1`.
            full: a callable giving the full state; called on snapshot steps only, or
                always when `delta` is None (the first state a Planner writes).
        """
        if delta is not None:
            pipe.hset(self.keys.ckpt_delta, step, encode_checkpoint(delta))
        if delta is None or self.snapshot_at(step):
            pipe.hset(self.keys.ckpt, step, encode_checkpoint(full()))
            if self.snapshot_at(step):
                old = step - self.keep - self.every
                if old >= 0:  # the snapshot and the deltas leading up to the next one
                    pipe.hdel(self.keys.ckpt, *range(old - self.every + 1, old + 1))
                    pipe.hdel(self.keys.ckpt_delta, *range(old - self.every + 1, old + 1))

    def steps(self, r: redis.Redis) -> list[int]:
        """Steps a resume can start at (sorted): every step from the oldest snapshot on."""
        snaps = sorted(int(s) for s in r.hkeys(self.keys.ckpt))
        if not snaps:
            return []
        deltas = {int(s) for s in r.hkeys(self.keys.ckpt_delta)}
        out = [snaps[0]]
        while out[-1] + 1 in deltas or out[-1] + 1 in snaps:
            out.append(out[-1] + 1)
        return out

    def newest(self, r: redis.Redis) -> int | None:
        steps = self.steps(r)
        return steps[-1] if steps else None

    def load(self, r: redis.Redis, step: int) -> dict[str, Any]:
        """The planner state before `step`.

        Raises:
            PlanError: no snapshot at or before `step`, or a delta is missing.
        """
        snaps = [int(s) for s in r.hkeys(self.keys.ckpt)]
        base = max((s for s in snaps if s <= step), default=None)
        if base is None:
            raise PlanError(
                f"no planner checkpoint at or before step {step} (snapshots kept: {sorted(snaps)[:1]}..{sorted(snaps)[-1:]}); "
                "the state to resume from is older than what Redis kept"
            )
        state = decode_checkpoint(r.hget(self.keys.ckpt, base))
        if step == base:
            return state
        raw = r.hmget(self.keys.ckpt_delta, list(range(base + 1, step + 1)))
        for s, delta in zip(range(base + 1, step + 1), raw):
            if delta is None:
                raise PlanError(
                    f"planner checkpoint delta of step {s} is missing (snapshot {base}), so step {step} cannot be "
                    "rebuilt; resume from a trainer state at or after the next snapshot, or start the job fresh"
                )
            state = apply(state, decode_checkpoint(delta))
        return state
