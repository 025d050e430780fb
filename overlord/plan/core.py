"""The Planner's pure core: buffer metadata in, one plan per step out.

No I/O here: the same metadata, seed, schedule and step give the same plan, byte for
byte. Each step the core hands the strategy (a `module:function` from the job config,
see `strategies.py`) a `StepData` and the `ClientPlaceTree`; the strategy composes
DGraph primitives and returns a plan, which the core checks (every selected sample
planned exactly once, or deferred) and commits.

A decision that depends on data not yet reported (is a source exhausted? has its
loader prepared enough samples?) is never taken early: the strategy raises
`NeedMetadata`, `plan_step` returns None, and the same step is asked again later.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from overlord.errors import ConfigError, PlanError
from overlord.plan.balance._kernels import NATIVE
from overlord.plan.buffer import ITEM, Buffer, NeedMetadata, Stream, join_items
from overlord.plan.dgraph import Planned, StepData, triples
from overlord.plan.meta import MetaChunk
from overlord.plan.schedule import Constant, Schedule
from overlord.plan.step_plan import Plan
from overlord.plan.strategies import vanilla
from overlord.plan.tree import ClientPlaceTree
from overlord.runtime.reshard import Reshard, check_record, reshard_stream_name, reshards_of

Strategy = Callable[[StepData, ClientPlaceTree], Planned]
_DEFERRED_FIELDS = ("stream", "epoch", "seq", "tokens", "patches", "nbytes")


def resolve_strategy(spec: str) -> Strategy:
    """'module:function' -> the strategy callable, with a clear error naming the spec."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"Job.strategy={spec!r} cannot be loaded ({exc}); give 'module:function'") from None
    if not callable(fn):
        raise ConfigError(f"Job.strategy={spec!r} is not callable")
    return cast(Strategy, fn)  # a user's callable: `plan_step` checks what it returns


class PlannerCore:
    """Builds plans from buffer metadata.

    Args:
        streams: stream names, in the job's layout order (plans refer to their index).
        stream_source: index of each stream's source.
        tree: the trainer mesh.
        seed: job seed.
        global_batch: samples per step.
        micro_batches: micro-batches per step per bucket.
        finite: True when the job runs a fixed number of epochs (sources can run out).
        schedule: the mixing schedule; default constant `weights`.
        weights: constant weights, used when no schedule is given.
        strategy: the orchestration strategy (default: `strategies.vanilla`).
        context_length: tokens per packed row (strategies may use it as capacity).
        drop_last: drop a final partial step (see dgraph.py for how a finite job ends).

    Raises:
        ConfigError: global_batch is smaller than DP groups x micro_batches.
    """

    def __init__(
        self,
        *,
        streams: list[str],
        stream_source: list[int],
        tree: ClientPlaceTree,
        seed: int,
        global_batch: int,
        micro_batches: int,
        finite: bool,
        schedule: Schedule | None = None,
        weights: list[float] | None = None,
        strategy: Strategy | None = None,
        context_length: int = 2048,
        drop_last: bool = False,
        mixing_unit: str = "step",
    ) -> None:
        if global_batch < tree.buckets("DP") * micro_batches:
            raise ConfigError(
                f"BatchSpec.global_batch={global_batch} cannot give each of the {micro_batches} micro-batches of "
                f"the {tree.buckets('DP')} data-parallel groups a sample: every step would deliver empty "
                f"micro-batches; raise global_batch to at least {tree.buckets('DP') * micro_batches} or lower "
                "micro_batches"
            )
        n_sources = max(stream_source) + 1 if stream_source else 0
        if schedule is None:
            if weights is None:
                raise ConfigError("PlannerCore needs a schedule or constant weights")
            schedule = Constant(np.asarray(weights, dtype=np.float64))
            n_sources = len(weights)
        if strategy is None:
            strategy = vanilla
        self.buffer = Buffer(streams, stream_source, n_sources, finite=finite)
        self.strategy: Strategy = strategy
        self.tree, self.schedule = tree, schedule
        self.seed, self.global_batch, self.mb = seed, global_batch, micro_batches
        self.context_length, self.drop_last, self.mixing_unit = context_length, drop_last, mixing_unit
        self.rr = [0] * n_sources  # next stream (round robin) of each source
        self.deferred = np.empty(0, dtype=ITEM)
        self.wanted: dict[int, int] = {}  # stream -> samples it must hold, while a step waits
        self._short: dict[int, tuple[int, bool]] = {}  # those streams' (count, final) when the step stopped
        self._epoch: int | None = None  # epoch(), until a cursor's epoch moves or a stream is first planned
        self.took: dict[int, int] = {}  # stream -> samples the last planned step took from it
        self.step = 0
        self.done = False
        self._dirty: set[int] = set()  # streams whose cursor moved since the last delta()
        self._rr_written = list(self.rr)  # round robin as of the last delta()
        self.reshards: list[Reshard] = []  # the job's, oldest first (overlord.runtime.reshard)
        self._reshards_written = 0  # of them, in a delta() or a state() restored

    @property
    def streams(self) -> list[Stream]:
        return self.buffer.streams

    def add(self, stream: int, chunk: MetaChunk) -> None:
        """Metadata in: a chunk a Source Loader reported."""
        self.buffer.add(stream, chunk)

    def state(self) -> dict[str, Any]:
        """What the Planner checkpoints with every plan."""
        return {
            "step": self.step,
            "cursors": {s.name: list(s.cursor) for s in self.streams},
            "round_robin": list(self.rr),
            # deferred samples are behind the cursors: keep their metadata to plan them again
            "deferred": [[int(r[f]) for f in _DEFERRED_FIELDS] for r in self.deferred],
            "rng": {"kind": "numpy.default_rng", "seed_words": [self.seed, "step", "MIX"]},
            "schedule": self.schedule.state() if hasattr(self.schedule, "state") else None,
            "done": self.done,
            "reshards": [r.to_json() for r in self.reshards],
        }

    def delta(self) -> dict[str, Any]:
        """What changed in `state()` since the last call: a differential checkpoint
        (see checkpoint.py), O(streams touched) rather than O(streams)."""
        cursors = {self.streams[i].name: list(self.streams[i].cursor) for i in sorted(self._dirty)}
        rr = {str(i): now for i, (now, then) in enumerate(zip(self.rr, self._rr_written)) if now != then}
        self._dirty.clear()
        self._rr_written = list(self.rr)
        out = {
            "step": self.step,
            "cursors": cursors,
            "round_robin": rr,
            "deferred": [[int(r[f]) for f in _DEFERRED_FIELDS] for r in self.deferred],
            "schedule": self.schedule.state() if hasattr(self.schedule, "state") else None,
            "done": self.done,
        }
        if len(self.reshards) != self._reshards_written:  # the whole list, in the step that grew it
            out["reshards"] = [r.to_json() for r in self.reshards]
            self._reshards_written = len(self.reshards)
        return out

    def reshard(self, src: int, source: str, homes: list[int]) -> Reshard:
        """Read source `src` (named `source`) with `len(homes)` new streams from this step
        on, served first by loader processes `homes` (overlord.runtime.reshard): its
        streams are retired, and what they had not planned, with their deferred samples,
        is the new streams' to read. Call between two steps (the next delta() holds it).

        Raises:
            PlanError: no partitions asked for, or the job is done.
        """
        if not homes or self.done:
            raise PlanError(f"source {source!r}: a reshard needs at least one stream and a job still planning")
        old = self.buffer.by_source[src]
        parents = tuple((self.streams[i].name, *self.streams[i].cursor) for i in old)
        epoch = max(e for _, e, _ in parents)
        mine = np.isin(self.deferred["stream"], old)
        deferred = tuple(
            (self.streams[int(r["stream"])].name, int(r["epoch"]), int(r["seq"])) for r in self.deferred[mine]
        )
        generation = len(self.reshards) + 1
        record = Reshard(
            generation=generation,
            source=source,
            source_index=src,
            step=self.step,
            epoch=epoch,
            parents=parents,
            deferred=deferred,
            streams=tuple(reshard_stream_name(source, generation, q) for q in range(len(homes))),
            homes=tuple(homes),
        )
        self._grow(record)
        self.deferred = self.deferred[~mine]
        return record

    def _grow(self, record: Reshard) -> None:
        """The streams of `record` in the buffer, its parents retired."""
        ids = self.buffer.reshard(record.source_index, list(record.streams), record.epoch)
        self.reshards.append(record)
        self._dirty.update(ids)
        self._epoch = None
        self.wanted, self._short = {}, {}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a `state()` taken after some step, before any metadata arrives.

        The Source Loaders, restarted at the cursors, report the samples after them; the
        deferred ones come from the state. Plans from here equal the original run's.
        """
        for record in reshards_of(state)[len(self.reshards) :]:
            streams = self.streams
            check_record(
                record, [s.name for s in streams], [s.source for s in streams], [not s.retired for s in streams]
            )
            self._grow(record)
        self._reshards_written = len(self.reshards)
        names = [s.name for s in self.streams]
        if sorted(state["cursors"]) != sorted(names):
            raise PlanError(
                f"planner checkpoint names streams {sorted(state['cursors'])}, this job has {sorted(names)}; "
                "a job's sources and partitions cannot change across a resume"
            )
        for stream in self.streams:
            stream.cursor = stream.known = tuple(state["cursors"][stream.name])
        self._epoch = None
        self.wanted, self._short = {}, {}
        self.step, self.rr, self.done = int(state["step"]), list(state["round_robin"]), bool(state.get("done"))
        self._dirty.clear()
        self._rr_written = list(self.rr)
        rows = np.zeros(len(state["deferred"]), dtype=ITEM)
        for row, values in zip(rows, state["deferred"]):
            for field, value in zip(_DEFERRED_FIELDS, values):
                row[field] = value
        if len(rows):
            rows["source"] = [self.streams[i].source for i in rows["stream"]]
        self.deferred = rows
        if state.get("schedule") is not None and hasattr(self.schedule, "load"):
            self.schedule.load(state["schedule"])

    def step_data(self) -> StepData:
        return StepData(
            step=self.step,
            seed=self.seed,
            buffer=self.buffer,
            schedule=self.schedule,
            global_batch=self.global_batch,
            micro_batches=self.mb,
            context_length=self.context_length,
            drop_last=self.drop_last,
            round_robin=list(self.rr),
            deferred=self.deferred,
            mixing_unit=self.mixing_unit,
            epoch=self.epoch(),
        )

    def epoch(self) -> int:
        """The job's epoch: the lowest epoch a source that has been planned is being planned in
        (kept until a step moves a cursor into another epoch, or plans a stream for the first
        time, or a state is restored: all it depends on)."""
        if self._epoch is None:
            self._epoch = self._lowest_epoch()
        return self._epoch

    def _lowest_epoch(self) -> int:
        """Each source's epoch is the highest cursor epoch of its streams; the job's is
        the lowest of those over the sources that have been planned (a stream's seq past
        -1), 0 before any was. One pass over the streams' cursors, as arrays."""
        streams = self.buffer.streams
        n = len(streams)
        epochs = np.fromiter((s.cursor[0] for s in streams), dtype=np.int64, count=n)
        planned = np.fromiter((s.cursor[1] >= 0 for s in streams), dtype=bool, count=n)
        sources = self.buffer.source_of
        top = np.full(self.buffer.n_sources, -1, dtype=np.int64)
        np.maximum.at(top, sources, epochs)
        seen = np.zeros(self.buffer.n_sources, dtype=bool)
        seen[sources[planned]] = True
        return int(top[seen].min()) if seen.any() else 0

    def plan_step(self) -> Plan | None:
        """The plan of `self.step`, or None if metadata is missing; advances on success."""
        if self.done or self._still_short():
            return None
        try:
            planned = self.strategy(self.step_data(), self.tree)
        except NeedMetadata as need:
            unknown = sorted(i for i in need.wanted if not 0 <= i < len(self.streams))
            if unknown:
                raise PlanError(
                    f"step {self.step}: the strategy stopped for metadata of stream(s) {unknown}, and the job "
                    f"has streams 0..{len(self.streams) - 1}; NeedMetadata names streams by their index in "
                    "StepData.buffer.streams: fix the strategy"
                ) from None
            self.wanted = need.wanted
            self._short = {i: (self.streams[i].count, self.streams[i].final) for i in need.wanted}
            return None
        self.wanted, self._short = {}, {}
        self._check(planned)
        moved = [self.streams[i] for i in planned.take]
        before = [(s.cursor[0], s.cursor[1] >= 0) for s in moved]
        self.buffer.commit(planned.take)
        if before != [(s.cursor[0], s.cursor[1] >= 0) for s in moved]:
            self._epoch = None  # a stream began an epoch, or was planned for the first time
        self.took = planned.take
        self._dirty.update(planned.take)
        self.rr, self.step, self.done = planned.round_robin, self.step + 1, planned.plan.last
        # the last step's leftovers are dropped (counted in the plan), not carried
        self.deferred = planned.deferred[:0] if self.done else planned.deferred
        return planned.plan

    def _still_short(self) -> bool:
        """Whether this step's last try stopped for metadata and no stream it named has
        since reported its end or come to hold what the try asked of it (`NeedMetadata`:
        what the stream must hold for this step): the strategy would stop there again.
        Until a step is planned nothing it reads moves but those streams (its draw is
        seeded by the step; the other streams only gain samples, which cannot undo a
        shortage). The Planner tries after every metadata read, and a loader short of a
        step reports it in several chunks as its transforms finish them: a whole try
        each, about one a step at the demo's rate, when any report of a named stream
        counted."""
        streams, wanted = self.streams, self.wanted
        return bool(self._short) and not any(
            (streams[i].count, streams[i].final) != seen and (streams[i].final or streams[i].count >= wanted[i])
            for i, seen in self._short.items()
        )

    def _check(self, planned: Planned) -> None:
        """Exactly once: the plan holds each selected sample once, or defers it."""
        heads = self.buffer.heads(planned.take)
        wanted = triples(join_items([self.deferred, heads]) if len(self.deferred) else heads)
        planned_items = np.asarray(planned.plan.items, dtype=np.int64).reshape(-1, 3)
        given = np.concatenate([planned_items, triples(planned.deferred)]) if len(planned.deferred) else planned_items
        if not same_once(given, wanted):
            raise PlanError(
                f"step {self.step}: the strategy's plan does not hold every selected sample exactly once "
                f"({len(planned_items)} planned, {len(planned.deferred)} deferred, {len(wanted)} selected); fix the strategy"
            )


SAME_ONCE_TABLE_MOST = 8192  # the compiled check's rows at most (`same_once`)


def same_once(given: NDArray[np.int64], wanted: NDArray[np.int64]) -> bool:
    """Whether the (stream, epoch, seq) rows of `given` are those of `wanted`, each once
    (a row twice on either side is not). Up to SAME_ONCE_TABLE_MOST rows in one pass of
    the compiled check (native/plan_check.c: a table of the rows, 1.5 us for 64 rows
    against 39 us sorting), past that and where the extension is not built by sorting
    (`same_once_numpy`, what the compiled one is tested against), which reads memory in
    order where the table's reads scatter (65,536 rows: 2.2 ms against 2.5)."""
    kernel = getattr(NATIVE, "same_once", None)  # None also from an extension built before it existed
    if kernel is None or len(wanted) > SAME_ONCE_TABLE_MOST:
        return same_once_numpy(given, wanted)
    return bool(kernel(np.ascontiguousarray(given, dtype=np.int64), np.ascontiguousarray(wanted, dtype=np.int64)))


def same_once_numpy(given: NDArray[np.int64], wanted: NDArray[np.int64]) -> bool:
    """`same_once` by sorting both sides' rows and comparing them."""
    given_keys, wanted_keys = _sorted_keys(given, wanted)
    same = np.diff(given_keys, axis=0) == 0  # neighbours that are one sample (whole rows where not keys)
    duplicated = bool((same.all(axis=1) if same.ndim == 2 else same).any())
    return not duplicated and np.array_equal(given_keys, wanted_keys)  # then wanted holds none twice either


def _sorted_keys(*rows: NDArray[np.int64]) -> list[NDArray[np.int64]]:
    """Each set of (stream, epoch, seq) rows in lexicographic order, comparable with the
    others: as one int64 key per row where the three fit it (as they do but for seqs
    past ~2**40; a sort of the values, no argsort), else the rows themselves, lexsorted.
    Extremes are taken column by column: numpy's max(axis=0) over [n, 3] is ~10x slower."""
    live = [r for r in rows if len(r)]
    if live and min(int(r.min()) for r in live) >= 0:
        top = [max(int(r[:, col].max()) for r in live) + 1 for col in range(3)]
        if top[0] * top[1] * top[2] < 1 << 63:
            return [np.sort((r[:, 0] * top[1] + r[:, 1]) * top[2] + r[:, 2]) for r in rows]
    return [r[np.lexsort((r[:, 2], r[:, 1], r[:, 0]))] for r in rows]
