"""The streams a Source Loader process hosts, and how that set changes while it runs.

A loader process starts with the streams its layout places on it. Two things change
the set between two plans, both announced by the plan the process serves:

- a handoff (overlord.planner.handoff): a stream moves to another process from a
  step on. The process it leaves drops it after its last step there; the one it goes
  to starts it from the planner checkpoint before that step, as a restarted loader
  starts its streams;
- a reshard (overlord.runtime.reshard): a source's streams are retired after a step
  and new ones start before the next. A process drops the retired streams it hosts
  and starts the new ones placed on it, after their cursors in the checkpoint that
  step wrote.

`Hosting` keeps what a process holds per stream (its Source Loader, read buffer and
that buffer's bytes and budget) and makes those changes. A dropped stream's samples
sent for earlier steps stay with the process (kept for replays), not here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from overlord.config import Job
from overlord.loader.reports import Reports
from overlord.loader.source_loader import Prepared, SourceLoader
from overlord.plan.checkpoint import Checkpoints
from overlord.plan.step_plan import Plan
from overlord.runtime.layout import Layout
from overlord.runtime.readbuffer import ReadBudget, draw_per_step
from overlord.runtime.reshard import RETIRED, Reshard, reshards_of
from overlord.store import Keys

log = logging.getLogger("overlord.loader")


def ring_max_record(capacity: int) -> int:
    """The largest record a ring created with `capacity` bytes holds (Ring.max_record:
    the capacity rounded up to a power of two, at least 4096, less the record header),
    known to a Shadow Loader too, which maps no ring."""
    return min((1 << max(12, (capacity - 1).bit_length())) - 8, (1 << 32) - 1)


class Hosting:
    """The streams loader process `index` hosts (see the module docstring).

    Args:
        reports: the process's metadata reports (a dropped stream's are forgotten; a
            reshard's streams are named there).
        opened: called with a stream started while the process runs (to watch its
            transforms); not for the streams of the start.
    """

    def __init__(
        self, job: Job, r, keys: Keys, index: int, layout: Layout, reports: Reports, opened: Callable[[int], None]
    ) -> None:
        self.job, self.r, self.keys, self.index = job, r, keys, index
        self.layout, self.reports, self.opened = layout, reports, opened
        self.serving: list[int] = list(layout.loader_of)  # stream -> the loader process serving it now
        self.loaders: dict[int, SourceLoader] = {}
        self.buffers: dict[int, dict[tuple[int, int], Prepared]] = {}  # not yet sent
        self.held_bytes: dict[int, int] = {}  # bytes of each read buffer
        self.budgets: dict[int, ReadBudget] = {}
        self.reshards: list[Reshard] = []  # the job's, as far as this process has followed them
        for i, owner in enumerate(layout.loader_of):
            if owner == index:
                self._open(i)

    def _open(self, i: int) -> SourceLoader:
        """Start hosting stream i: its Source Loader (at the epoch order's start), an
        empty read buffer and its budget."""
        job, layout = self.job, self.layout
        name, src = layout.streams[i], layout.stream_source[i]
        made = next((r for r in self.reshards if name in r.streams), None)  # None: one of the start's streams
        loader = self.loaders[i] = SourceLoader(
            job.sources[src],
            int(name.rsplit(".", 1)[1]) if made is None else made.streams.index(name),
            seed=job.seed,
            epochs=job.epochs,
            context_length=job.batch.context_length,
            vocab_size=job.batch.vocab_size,
            max_sample_bytes=ring_max_record(job.sample_ring_bytes),
            stream=name,
            reshards=[]
            if made is None
            else [r for r in self.reshards if r.source_index == src and r.generation <= made.generation],
        )
        self.buffers[i], self.held_bytes[i], self.budgets[i] = {}, 0, self._budget(i)
        return loader

    def _budget(self, i: int) -> ReadBudget:
        """Stream i's read-buffer budget (runtime/readbuffer.py): its share of a step."""
        job, layout = self.job, self.layout
        src = layout.stream_source[i]
        source = job.sources[src]
        parts = sum(s == src and k != RETIRED for s, k in zip(layout.stream_source, layout.loader_of))
        return ReadBudget(
            draw=draw_per_step(job.batch.global_batch, [s.weight for s in job.sources], src, parts),
            plan_ahead=job.plan_ahead,
            cap_bytes=source.buffer_bytes if source.buffer_bytes is not None else job.buffer_bytes,
            cap_samples=job.buffer_samples,
        )

    def _start(self, streams: list[int]) -> None:
        """Open `streams` while the process runs (a handoff's or a reshard's)."""
        for i in streams:
            self._open(i)
            self.opened(i)

    def drop(self, i: int, why: str) -> None:
        """Stop hosting stream i: its Source Loader, read buffer and file state."""
        log.info("stream %s: %s", self.layout.streams[i], why)
        self.loaders.pop(i).close()
        del self.buffers[i], self.held_bytes[i], self.budgets[i]
        self.reports.forget(i)

    def rebuild(self, step: int, state: dict | None, streams: list[int] | None = None) -> None:
        """Start every stream (or those of `streams`) after its cursor in the planner
        state before `step` and re-prepare the samples that state deferred (they sit
        behind the cursors)."""
        state = state or Checkpoints(self.keys).load(self.r, step)
        chosen = set(self.loaders if streams is None else streams)
        for i in chosen:
            epoch, seq = state["cursors"][self.layout.streams[i]]
            self.loaders[i].start_at(epoch, seq + 1)
        deferred: dict[tuple[int, int], list[int]] = {}
        for stream, epoch, seq, *_ in state["deferred"]:
            if stream in chosen:
                deferred.setdefault((stream, epoch), []).append(seq)
        for (stream, epoch), seqs in deferred.items():
            for sample in self.loaders[stream].prepare_at(epoch, seqs):
                self.buffers[stream][(sample.epoch, sample.seq)] = sample
                self.held_bytes[stream] += sample.nbytes
        log.info(
            "rebuilt read buffers at step %d from the planner checkpoint (%d deferred samples re-read)",
            step,
            sum(len(v) for v in deferred.values()),
        )

    def handoffs(self, plan: Plan) -> None:
        """Serve the streams `plan` names this process for (handoff.py): a stream handed
        to another process is dropped after its last step here; a stream handed to this
        one starts from the planner checkpoint before this step, as a restarted loader's
        does. Its samples are read as this and the next steps take them."""
        serving = plan.loader_of(self.layout.loader_of)
        if serving == self.serving:
            return
        me = self.index
        for i in [i for i in self.loaders if serving[i] != me]:
            self.drop(i, f"served by loader process {serving[i]} from step {plan.step}")
        gained = [i for i, k in enumerate(serving) if k == me and i not in self.loaders]
        started = time.monotonic()
        self._start(gained)
        if gained:
            opened = time.monotonic()
            if plan.step > 0:
                self.rebuild(plan.step, None, gained)
            log.info(
                "serving stream(s) %s from step %d (handed over from loader process(es) %s; opened in %.0f ms, "
                "started from the planner checkpoint in %.0f ms)",
                [self.layout.streams[i] for i in gained],
                plan.step,
                sorted({self.serving[i] for i in gained}),
                (opened - started) * 1000,
                (time.monotonic() - opened) * 1000,
            )
        self.serving = serving

    def grow(self, state: dict, step: int, rebuild: bool = True) -> None:
        """Follow the reshards `state` (the planner state before `step`) records that this
        process does not know yet: drop the retired streams it hosts and start the new
        ones whose first loader process it is, after their cursors in `state` (with
        `rebuild`; else the caller rebuilds every stream)."""
        fresh = [r for r in reshards_of(state) if r.generation > self.layout.generation]
        if not fresh:
            return
        self.reshards += fresh
        grown = self.layout.grown(fresh)
        serving = [RETIRED if grown.loader_of[i] == RETIRED else k for i, k in enumerate(self.serving)]
        serving += grown.loader_of[len(self.serving) :]
        self.layout, self.reports.streams = grown, list(grown.streams)
        for i in [i for i in self.loaders if serving[i] == RETIRED]:
            self.drop(i, f"retired by a reshard from step {step}")
        gained = [i for i in range(len(self.serving), len(serving)) if serving[i] == self.index]
        self.serving = serving
        self._start(gained)
        if gained and rebuild:
            self.rebuild(step, state, gained)
        if gained:
            log.info("serving stream(s) %s from step %d (made by a reshard)", [grown.streams[i] for i in gained], step)
