"""Handoffs: a stream served by another loader process from a step boundary on.

A stream (one partition of a source) is read by one loader process at a time, but its
order is a function of (seed, source, epoch, partition) and of nothing about the
process that reads it. So a stream can change hands between two steps, live, without a
sample lost or repeated:

    Planner       before planning step m, moves stream s to loader process B: plan m
                  and every plan after it lists s -> B (`Plan.owners`, the streams
                  served by a process other than the layout's)
    process A     serves s through plan m-1 (its samples of those steps stay kept for
                  replays), then, at plan m, drops s: its Source Loader, read buffer
                  and file state
    process B     at plan m, opens s and starts it after its cursor in the planner
                  checkpoint before m (the deferred samples of that state are read
                  again), as a restarted loader does; it reads on as plans take s's
                  samples, and reports what it reads (the Planner keeps what is new)
    constructors  read each step's samples of s from the ring of the process that
                  step's plan names

The plan carries the handoff, so every role sees it with the step it takes effect at,
a restarted role included, and no other key has to be read on the data path. A
Planner that takes over continues from the last published plan's owners.

What moves a stream: a request (`overlord handoff STREAM LOADER`, or an HSET of the
`handoff` hash), taken at the next step boundary, or the autoscaler (online
`Autoscale`): when one loader process's transform demand stays above the others', it
moves the stream that evens them most (`overlord.autoscale.handoff`). Every handoff,
and every request (refused, or for where a stream is served already), is logged in
the `handoffs` stream.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import redis

from overlord.plan.step_plan import Plan
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease, WriteUncertain
from overlord.runtime.reshard import RETIRED
from overlord.store import Keys
from overlord.store.schema import handoff_entry

log = logging.getLogger("overlord.planner")

LOOK_S = 0.5  # between two looks at the requests


class Handoffs:
    """Which loader process serves each stream, the requests to change it, and the
    plans that carry it."""

    def __init__(self, r: redis.Redis, keys: Keys, lease: Lease, layout: Layout) -> None:
        self.r, self.keys, self.lease, self.layout = r, keys, lease, layout
        self.serving: list[int] = list(layout.loader_of)  # stream -> loader process
        self.index = {name: i for i, name in enumerate(layout.streams)}
        self.next_look = 0.0
        self.unlogged: list[dict] = []  # `handoffs` entries of the decisions the next plan carries
        self.handled: set[bytes] = set()  # requests taken, deleted once that plan is out

    def recover(self, step: int) -> None:
        """A Planner starting at `step`: serve each stream where the last published plan did."""
        raw = self.r.get(self.keys.plan(step - 1)) if step > 0 else None
        if raw is None:
            return
        plan = Plan.decode(raw)
        for stream, to in [] if plan.owners is None else plan.owners.tolist():
            # a job resumed with other loader processes: handoffs its layout cannot hold lapse
            if stream < len(self.serving) and self.allowed(stream, to):
                self.serving[stream] = to
        moved = [s for s, k in enumerate(self.serving) if k != self.layout.loader_of[s]]
        if moved:
            log.info("streams served away from their layout's loader process: %s", self._names(moved))

    def grow(self, layout: Layout) -> None:
        """Serve `layout`'s streams (a reshard): the new ones where it puts them, the
        retired ones nowhere."""
        for i in range(len(self.serving), len(layout.streams)):
            self.serving.append(layout.loader_of[i])
        for i, home in enumerate(layout.loader_of):
            if home == RETIRED:
                self.serving[i] = RETIRED
        self.layout = layout
        self.index = {name: i for i, name in enumerate(layout.streams)}

    def stamp(self, plan: Plan, generation: int = 0) -> Plan:
        """`plan` with the streams served away from the layout's process, and the
        reshards the job has made through it (`generation`, overlord.runtime.reshard)."""
        home = self.layout.loader_of
        moved = [(s, k) for s, k in enumerate(self.serving) if k != home[s]]
        if not moved and not generation:
            return plan
        owners = np.asarray(moved, dtype=np.int64) if moved else None
        return dataclasses.replace(plan, owners=owners, generation=generation)

    def look(self, step: int, first: int) -> None:
        """Take the pending requests into effect from `step` (at most every LOOK_S).

        `step` must come after this Planner's first: the process a stream goes to starts
        it from the planner checkpoint before `step`, which the previous plan wrote.
        """
        if step <= first or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + LOOK_S
        raw = {k: v for k, v in self.r.hgetall(self.keys.handoff).items() if k not in self.handled}
        if not raw:
            return
        done, refused = [], []
        for field, value in raw.items():
            name = field.decode()
            why = self._refusal(name, value.decode())
            if why:
                refused.append((name, why))
            else:
                stream, to = self.index[name], int(value)
                done.append((stream, to, "requested" if self.serving[stream] != to else "served there already"))
        self._apply(step, done, refused, handled=list(raw))

    def move(self, step: int, stream: int, to: int, reason: str) -> None:
        """Serve `stream` from loader process `to` from `step` on (the autoscaler's)."""
        self._apply(step, [(stream, to, reason)], [], handled=[])

    def allowed(self, stream: int, to: int) -> bool:
        """Whether `stream` may be served by loader process `to` (a shadowed stream only
        by a process with a Shadow Loader)."""
        return not self._refusal(self.layout.streams[stream], str(to))

    def _refusal(self, name: str, value: str) -> str:
        layout = self.layout
        if name not in self.index:
            return f"no stream {name!r} in this job (its streams are <source>.<partition>)"
        if layout.loader_of[self.index[name]] == RETIRED:
            return f"stream {name!r} was retired by a reshard (`overlord status` lists the streams read now)"
        try:
            to = int(value)
        except ValueError:
            return f"{value!r} is not a loader process index"
        if not 0 <= to < layout.loaders:
            return f"no loader process {to}: the job has {layout.loaders} (0 to {layout.loaders - 1})"
        if layout.loader_of[self.index[name]] in layout.shadowed and to not in layout.shadowed:
            return (
                f"its source has Shadow Loaders and loader process {to} has none "
                f"(processes with one: {layout.shadowed})"
            )
        return ""

    def _apply(
        self, step: int, done: list[tuple[int, int, str]], refused: list[tuple[str, str]], handled: list[bytes]
    ) -> None:
        """Serve `done` from `step` on (the next plan carries it); what to log and the
        requests to delete wait for that plan (`published`)."""
        for stream, to, reason in done:
            before = self.serving[stream]
            self.unlogged.append(handoff_entry(step, self.layout.streams[stream], before, to, reason))
            if before == to:
                continue
            self.serving[stream] = to
            log.warning(
                "stream %s: loader process %d -> %d from step %d (%s)",
                self.layout.streams[stream],
                before,
                to,
                step,
                reason,
            )
        for name, why in refused:
            self.unlogged.append(handoff_entry(step, name, -1, -1, f"refused: {why}"))
            log.warning("handoff of %r refused: %s", name, why)
        self.handled.update(handled)

    def published(self) -> None:
        """The plan carrying what `look` and `move` decided is out: log them and delete the
        requests taken (fenced). A Planner deposed before its plan went out logs nothing:
        the requests stay, for the next one to take."""
        if log_decisions(self.lease, self.keys.handoffs, self.unlogged, self.keys.handoff, self.handled):
            self.unlogged, self.handled = [], set()

    def _names(self, streams: list[int]) -> list[str]:
        return [f"{self.layout.streams[s]} -> {self.serving[s]}" for s in streams]


def log_decisions(lease: Lease, log_key: str, entries: list[dict], requests: str, taken: set[bytes]) -> bool:
    """Add `entries` to the `log_key` stream and delete the `taken` fields of the
    `requests` hash, in one write fenced by the Planner's lease (a handoff's or a
    reshard's plan is out). False: the write may not have landed (it goes with the next
    plan).

    Raises:
        Superseded: another Planner leads; the requests stay for it.
    """
    if not (entries or taken):
        return True

    def write(pipe) -> None:
        for entry in entries:
            pipe.xadd(log_key, entry, maxlen=1000, approximate=True)
        if taken:
            pipe.hdel(requests, *taken)

    try:
        lease.fenced(write)
    except WriteUncertain:
        return False
    return True
