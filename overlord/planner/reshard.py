"""Live reshards: a source read by another number of streams from a step boundary on.

What a reshard is, and why every sample stays planned once, is in
overlord.runtime.reshard. This controller takes the requests and makes them:

    request     `overlord reshard SOURCE PARTITIONS [--at-step N]` (an HSET of the
                `reshard` hash: PARTITIONS, or PARTITIONS@N for "not before step N", which
                makes a run reproducible), looked at before each turn (at most every LOOK_S)
    made        right after the Planner plans a step (m - 1), before the checkpoint of
                step m is taken: the core retires the source's streams and appends the
                new ones (`PlannerCore.reshard`), so the state before m, written with
                plan m - 1, holds the record and the new streams' cursors
    served      each new stream first by the loader process with the fewest live
                streams (ties: the lowest index; for a source with Shadow Loaders,
                among the processes that have one, whose standby follows the plans
                as the process does and so starts the same streams at the same step:
                a promoted standby holds them); plan m and later carry the job's
                reshard count (`Plan.generation`), and a role that knows fewer reads
                the records from the state before that plan's step (`Layout.grown`)
    logged      once plan m is out: one entry per reshard or refused request in the
                `reshards` stream, and the request deleted, in one fenced write

A Planner deposed before its turn went out logs nothing: the request stays, and its
successor makes it at its own next step boundary.

The autoscaler's reshards (overlord.autoscale.repartition, with `Autoscale.reshards`)
are made the same way, at the step it decides them, ahead of the operators' requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from overlord.config import Job
from overlord.plan.core import PlannerCore
from overlord.planner.handoff import log_decisions
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease
from overlord.runtime.reshard import RETIRED
from overlord.store import Keys
from overlord.store.schema import reshard_entry

log = logging.getLogger("overlord.planner")

LOOK_S = 0.5  # between two looks at the requests
MOST_PARTITIONS = 4096  # streams one reshard may give a source
MOST_RESHARDS = (1 << 16) - 1  # a job's: Plan.generation is a u16 of the plan's header


class Reshards:
    """The requests to reshard a source, and the reshards made for the next plans."""

    def __init__(self, r: redis.Redis, keys: Keys, lease: Lease, job: Job) -> None:
        self.r, self.keys, self.lease, self.job = r, keys, lease, job
        self.index = {s.name: i for i, s in enumerate(job.sources)}
        self.next_look = 0.0
        # (request field or None for the autoscaler's, source, partitions, first step, why)
        self.pending: list[tuple[bytes | None, str, int, int, str]] = []
        self.unlogged: list[dict] = []  # `reshards` entries of what the next plans carry
        self.handled: set[bytes] = set()  # requests taken, deleted once that plan is out

    def look(self) -> None:
        """Read the pending requests (at most every LOOK_S); refuse the ones that cannot be made."""
        if time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + LOOK_S
        taken = self.handled | {field for field, *_ in self.pending if field is not None}
        for field, value in self.r.hgetall(self.keys.reshard).items():
            if field in taken:
                continue
            name, why = field.decode(errors="replace"), ""
            asked, at = parse_request(value.decode(errors="replace"))
            partitions = asked or 0
            if asked is None:
                why = f"{value.decode(errors='replace')!r} is not PARTITIONS or PARTITIONS@STEP"
            elif name not in self.index:
                why = f"no source {name!r} in this job (its sources: {sorted(self.index)})"
            elif not 1 <= partitions <= MOST_PARTITIONS:
                why = f"{partitions} partitions: give 1 to {MOST_PARTITIONS}"
            if why:
                self.unlogged.append(reshard_entry(-1, name, -1, -1, "", f"refused: {why}"))
                self.handled.add(field)
                log.warning("reshard of %r refused: %s", name, why)
            else:
                self.pending.append((field, name, partitions, at, "requested"))

    def request(self, source: str, partitions: int, step: int, why: str) -> None:
        """The autoscaler's reshard of `source` (overlord.autoscale.repartition), made
        before `step`, ahead of the operators' requests."""
        self.pending.insert(0, (None, source, partitions, step, why))

    def make(self, core: PlannerCore, layout: Layout, serving: list[int]) -> Layout:
        """Make the first pending reshard between the step the core just planned and its
        next (`core.step`); returns the layout with its streams (`layout` when none).

        `serving`: the loader process serving each stream now (handoffs applied).
        """
        due = next((p for p in self.pending if p[3] <= core.step), None)
        if due is None or core.done:
            return layout
        self.pending.remove(due)
        field, name, partitions, _, why = due
        if field is not None:
            self.handled.add(field)
        src = self.index[name]
        before = len(core.buffer.by_source[src])
        if partitions == before:
            self.unlogged.append(reshard_entry(core.step, name, before, partitions, "", "read by as many already"))
            return layout
        if len(core.reshards) >= MOST_RESHARDS:
            why = f"refused: the job made {MOST_RESHARDS} reshards, the most a plan's header counts"
            self.unlogged.append(reshard_entry(core.step, name, -1, -1, "", why))
            return layout
        # a source with Shadow Loaders keeps its standbys: its new streams start only on
        # processes that have one, whose Shadow Loader follows them as the process does
        among = layout.shadowed if self.job.sources[src].shadow else None
        homes = spread(serving, set(core.buffer.by_source[src]), layout.loaders, partitions, among)
        record = core.reshard(src, name, homes)
        grown = layout.grown([record])
        log.warning(
            "source %s: %d -> %d streams from step %d (%s; their remainder counts as epoch %d)",
            name,
            before,
            partitions,
            record.step,
            ", ".join(f"{s} on loader process {k}" for s, k in zip(record.streams, record.homes)),
            record.epoch,
        )
        self.unlogged.append(reshard_entry(record.step, name, before, partitions, ",".join(record.streams), why))
        return grown

    def published(self) -> None:
        """The plans carrying what `make` did are out: log them and delete the requests
        taken (fenced). A Planner deposed before its plans went out logs nothing: the
        requests stay, for the next one to take."""
        if log_decisions(self.lease, self.keys.reshards, self.unlogged, self.keys.reshard, self.handled):
            self.unlogged, self.handled = [], set()


def parse_request(value: str) -> tuple[int | None, int]:
    """(partitions, the first step it may take effect at) of a `reshard` hash value
    (PARTITIONS or PARTITIONS@STEP); partitions None when it is neither."""
    parts, _, at = value.partition("@")
    try:
        return int(parts), int(at) if at else 0
    except ValueError:
        return None, 0


def spread(
    serving: list[int], leaving: set[int], loaders: int, partitions: int, among: Sequence[int] | None = None
) -> list[int]:
    """The loader process of each of `partitions` new streams: each in turn where the
    fewest live streams are (ties: the lowest index), not counting those `leaving`;
    only processes of `among` when given (a source with Shadow Loaders: those with one)."""
    count = [0] * loaders
    for i, k in enumerate(serving):
        if k != RETIRED and i not in leaving:
            count[k] += 1
    candidates = sorted(among) if among else range(loaders)
    homes = []
    for _ in range(partitions):
        k = min(candidates, key=lambda k: (count[k], k))
        count[k] += 1
        homes.append(k)
    return homes
