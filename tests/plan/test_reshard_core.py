"""Reshards in the pure Planner core: a source's streams retired between two steps and
new ones planned over what they had not (overlord.runtime.reshard), every sample of
every epoch planned once, the record and the new streams' cursors in the checkpoint.

The loaders here are a model: a source of N rows, base partition p of P holding the rows
r with r % P == p in ascending order (source 0's two: 40 rows and 21, so they stand in
different epochs at times), a reshard's new stream q reading its run of the
remainder (the record's deferred samples, then each parent's rest, epoch by epoch) in
its remainder epoch and the rows r % P' == q after it. The row-group order itself is
overlord.loader.order's, tested with real files in tests/loader/test_reshard_order.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from overlord.config import Mesh
from overlord.errors import PlanError
from overlord.plan.checkpoint import apply
from overlord.plan.core import PlannerCore
from overlord.plan.meta import MetaChunk
from overlord.plan.strategies import vanilla
from overlord.plan.tree import ClientPlaceTree
from overlord.runtime.layout import Layout
from overlord.runtime.reshard import RETIRED, Reshard, reshards_of

ROWS = {0: 61, 1: 47}  # rows of each source
EPOCHS = 2


class Model:
    """Virtual Source Loaders: what each stream's (epoch, seq) is, as (row, epoch)."""

    def __init__(self, partitions: dict[int, int]) -> None:
        self.spec: dict[str, tuple] = {}
        self.streams: list[str] = []
        for src, parts in partitions.items():
            for p in range(parts):
                self._add(f"s{src}.{p}", ("base", src, p, parts))

    def _add(self, name: str, spec: tuple) -> None:
        self.spec[name] = spec
        self.streams.append(name)

    def rows_of(self, src: int, part: int, parts: int, base: bool = False) -> list[int]:
        if base and src == 0:  # unequal partitions (as unequal row groups make them): 40 and 21 rows
            return list(range(40)) if part == 0 else list(range(40, ROWS[0]))
        return [r for r in range(ROWS[src]) if r % parts == part]

    def length(self, name: str, epoch: int) -> int:
        return len(self._order(name, epoch))

    def _order(self, name: str, epoch: int) -> list[tuple[int, int]]:
        """(row, true epoch) of each seq of `name` in `epoch`."""
        spec = self.spec[name]
        if spec[0] == "base":
            _, src, p, parts = spec
            return [(r, epoch) for r in self.rows_of(src, p, parts, base=True)]
        _, record, q = spec
        if epoch > record.epoch:
            src = record.source_index
            return [(r, epoch) for r in self.rows_of(src, q, record.partitions)]
        assert epoch == record.epoch
        rest = [self._order(n, e)[s] for n, e, s in record.deferred]
        for n, e, s in record.parents:
            rest += self._order(n, e)[s + 1 :]
            for later in range(e + 1, record.epoch + 1):
                rest += self._order(n, later)
        size, parts = len(rest), record.partitions
        return rest[q * size // parts : (q + 1) * size // parts]

    def identity(self, name: str, epoch: int, seq: int) -> tuple[int, int]:
        return self._order(name, epoch)[seq]

    def grow(self, record: Reshard) -> None:
        for q, name in enumerate(record.streams):
            self._add(name, ("new", record, q))

    def first_epoch(self, name: str) -> int:
        spec = self.spec[name]
        return 0 if spec[0] == "base" else spec[1].epoch

    def report(self, core: PlannerCore, index: int, after: tuple[int, int] = (-1, -1)) -> None:
        """Everything stream `index` will ever prepare after `after` (epoch, seq), in order."""
        name = self.streams[index]
        first = self.first_epoch(name)
        for epoch in range(first, EPOCHS):
            n = self.length(name, epoch)
            seqs = [s for s in range(n) if (epoch, s) > after]
            last = epoch == EPOCHS - 1
            core.add(index, _chunk(epoch, seqs, ended=[(epoch, n)], final=last))


def _chunk(epoch, seqs, ended=(), final=False):
    n = len(seqs)
    return MetaChunk(
        epoch, np.asarray(seqs, dtype=np.int64), np.full(n, 10), np.zeros(n, int), np.full(n, 40), list(ended), final
    )


def deferring(data, tree):
    """vanilla, with the last sample of source 0 in every step's plan deferred to the next."""
    planned = vanilla(data, tree)
    items = planned.plan.items
    ours = np.flatnonzero(data.buffer.source_of[items[:, 0]] == 0)
    if planned.plan.last or len(items) < 2 or not len(ours):
        return planned
    at = int(ours[-1])
    keep = np.ones(len(items), dtype=bool)
    keep[at] = False
    bounds = planned.plan.bounds.copy()
    bounds[np.searchsorted(bounds, at, side="right") :] -= 1
    plan = dataclasses.replace(planned.plan, items=items[keep], bounds=bounds, deferred=1)
    picked = np.asarray([tuple(items[at])], dtype=np.int64)
    pool = (
        np.concatenate([data.deferred, data.buffer.heads(planned.take)])
        if len(data.deferred)
        else data.buffer.heads(planned.take)
    )
    hit = (pool["stream"] == picked[0, 0]) & (pool["epoch"] == picked[0, 1]) & (pool["seq"] == picked[0, 2])
    return dataclasses.replace(planned, plan=plan, deferred=np.concatenate([planned.deferred, pool[hit]]))


def make(model: Model, strategy=vanilla) -> PlannerCore:
    return PlannerCore(
        streams=list(model.streams),
        stream_source=[model.spec[n][1] for n in model.streams],
        tree=ClientPlaceTree(Mesh(dp=2)),
        seed=5,
        global_batch=8,
        micro_batches=2,
        finite=True,
        weights=[1.0, 1.0],
        strategy=strategy,
    )


def run(
    reshard_at: dict[int, tuple[int, int]],
    strategy=vanilla,
    restore_at: int | None = None,
    straddle: tuple[int, int] | None = None,
):
    """Plan a finite job to its end, resharding source s to P' streams before the steps
    `reshard_at` names ({step: (source, P')}); with `restore_at`, a fresh core takes over
    from the state before that step (its loaders report from the cursors); with
    `straddle` (source, P'), that source is resharded at the first step where its
    streams stand in different epochs. Returns the
    plans' (row, epoch) pairs by source, the plans as bytes and the records."""
    model = Model({0: 2, 1: 1})
    core = make(model, strategy)
    for i in range(len(model.streams)):
        model.report(core, i)
    plans, delivered, states = [], {0: Counter(), 1: Counter()}, [core.state()]
    while True:
        plan = core.plan_step()
        assert plan is not None, f"step {core.step} waits on metadata the model has reported"
        plans.append(plan.encode())
        for stream, epoch, seq in plan.items.tolist():
            spec = model.spec[model.streams[stream]]
            src = spec[1] if spec[0] == "base" else spec[1].source_index
            delivered[src][model.identity(model.streams[stream], epoch, seq)] += 1
        if straddle is not None and not plan.last:
            epochs = {core.streams[i].cursor[0] for i in core.buffer.by_source[straddle[0]]}
            if len(epochs) > 1:
                reshard_at, straddle = {core.step: straddle}, None
        if core.step in reshard_at and not plan.last:
            src, parts = reshard_at[core.step]
            record = core.reshard(src, f"s{src}", homes=[q % 2 for q in range(parts)])
            model.grow(record)
            for i in range(len(model.streams) - parts, len(model.streams)):
                model.report(core, i)
        states.append(core.delta())
        if plan.last:
            break
        if restore_at is not None and core.step == restore_at:
            fresh = make(Model({0: 2, 1: 1}), strategy)
            fresh.restore(core.state())
            for i, stream in enumerate(fresh.streams):
                if not stream.retired:
                    model.report(fresh, i, after=tuple(stream.cursor))
            core = fresh
            restore_at = None
    return delivered, plans, core, states


def exactly_once(delivered) -> None:
    for src, seen in delivered.items():
        want = Counter({(r, e): 1 for r in range(ROWS[src]) for e in range(EPOCHS)})
        assert seen == want, (
            f"source {src}: missing {sorted((want - seen).elements())[:5]}, twice {sorted((seen - want).elements())[:5]}"
        )


@pytest.mark.parametrize("strategy", [vanilla, deferring], ids=["vanilla", "deferring"])
@pytest.mark.parametrize(
    "reshard_at",
    [
        {3: (0, 3)},  # more streams, early in epoch 0
        {5: (0, 1)},  # fewer
        {9: (0, 4), 10: (0, 2)},  # twice, within the first one's remainder epoch
        {4: (1, 3), 12: (0, 5), 20: (1, 2)},  # both sources, the last one in epoch 1
    ],
    ids=["grow", "shrink", "twice", "both-sources"],
)
def test_every_row_once_per_epoch_across_reshards(reshard_at, strategy):
    delivered, _, core, _ = run(reshard_at, strategy)
    exactly_once(delivered)
    assert len(core.reshards) == len(reshard_at)


@pytest.mark.parametrize("parts", [1, 3])
def test_streams_in_two_epochs_resharded_give_the_rest_of_both(parts):
    # s0.1 (21 rows) begins epoch 1 while s0.0 (40 rows) still reads epoch 0: the new
    # streams' remainder epoch is 1, holding s0.0's rest of epoch 0 and all of its epoch 1
    delivered, _, core, _ = run({}, straddle=(0, parts))
    (record,) = core.reshards
    assert record.epoch == 1 and sorted(e for _, e, _ in record.parents) == [0, 1]
    exactly_once(delivered)


def test_a_remainder_deferred_and_resharded_is_planned_once():
    # the deferring strategy holds a sample of the source back at every step: the reshard
    # moves it out of `deferred` into the new streams' remainder
    delivered, _, core, _ = run({3: (0, 3)}, deferring)
    record = core.reshards[0]
    assert record.deferred, "the test needs a deferred sample of the resharded source"
    exactly_once(delivered)


@pytest.mark.parametrize("restore_at", [4, 7, 13])
def test_a_core_restored_after_a_reshard_plans_the_same(restore_at):
    reshards = {3: (0, 3), 6: (1, 2)}
    straight, plans, _, _ = run(reshards, deferring)
    restored, plans_restored, core, _ = run(reshards, deferring, restore_at=restore_at)
    assert plans_restored == plans
    assert straight == restored
    assert [r.to_json() for r in core.reshards] == [r.to_json() for r in reshards_of(core.state())]


def test_deltas_carry_the_reshards():
    _, _, core, states = run({3: (0, 3), 8: (1, 2)})
    state = states[0]
    for delta in states[1:]:
        state = apply(state, delta)
    assert state["reshards"] == core.state()["reshards"]
    assert state["cursors"] == core.state()["cursors"]
    assert sum("reshards" in d for d in states[1:]) == 2  # only the deltas of the steps that made one


def _resharded() -> tuple[PlannerCore, Reshard, Model]:
    """A core that planned three steps, then resharded source 0 into three streams."""
    model = Model({0: 2, 1: 1})
    core = make(model)
    for i in range(3):
        model.report(core, i)
    for _ in range(3):
        core.plan_step()
    return core, core.reshard(0, "s0", homes=[1, 0, 1]), model


def test_the_record_and_the_grown_layout():
    core, record, _ = _resharded()
    assert record.generation == 1 and record.step == 3 and record.epoch == 0
    assert record.streams == ("s0.r1p0", "s0.r1p1", "s0.r1p2")
    assert [p[0] for p in record.parents] == ["s0.0", "s0.1"]
    assert Reshard.from_json(record.to_json()) == record
    assert [s.name for s in core.streams][3:] == list(record.streams)
    assert all(core.streams[i].retired for i in (0, 1)) and core.buffer.by_source[0] == [3, 4, 5]
    # a late report of a retired stream is dropped: its rest is the new streams' now
    core.add(0, _chunk(0, [40, 41]))
    assert core.streams[0].count == 0
    base = Layout(["s0.0", "s0.1", "s1.0"], [0, 0, 1], [0, 1, 0], 2, 1, [0, 0], [])
    grown = base.grown([record])
    assert grown.streams[3:] == list(record.streams) and grown.stream_source[3:] == [0, 0, 0]
    assert grown.loader_of == [RETIRED, RETIRED, 0, 1, 0, 1] and grown.generation == 1
    assert grown.live == [2, 3, 4, 5]
    assert grown.grown([record]) is grown
    with pytest.raises(PlanError, match="do not follow"):
        base.grown([dataclasses.replace(record, generation=2)])


# a record as a damaged checkpoint, or another job's, could hold it: each is named, not applied
DAMAGED = {
    "no home for a stream": lambda r: dataclasses.replace(r, homes=r.homes[:2]),
    "a home past the processes": lambda r: dataclasses.replace(r, homes=(1, 0, 7)),
    "streams named otherwise": lambda r: dataclasses.replace(r, streams=("s0.r1p0", "s0.r1p1", "s0.x")),
    "another generation's names": lambda r: dataclasses.replace(r, generation=1, streams=("s0.r2p0",), homes=(0,)),
    "a parent left out": lambda r: dataclasses.replace(r, parents=r.parents[:1]),
    "a parent of another source": lambda r: dataclasses.replace(r, parents=(r.parents[0], ("s1.0", 0, 3))),
    "an epoch that is not the cursors' highest": lambda r: dataclasses.replace(r, epoch=r.epoch + 1),
    "a deferred sample twice": lambda r: dataclasses.replace(r, deferred=(("s0.0", 0, 9), ("s0.0", 0, 9))),
    "a deferred sample of another stream": lambda r: dataclasses.replace(r, deferred=(("s1.0", 0, 1),)),
    "a source index with no streams": lambda r: dataclasses.replace(r, source_index=5),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_reshard_record_is_refused_with_what_is_wrong(damage):
    core, record, model = _resharded()
    bad = DAMAGED[damage](record)
    base = Layout(["s0.0", "s0.1", "s1.0"], [0, 0, 1], [0, 1, 0], 2, 1, [0, 0], [])
    with pytest.raises(PlanError, match=r"reshard 1 \(source 's0', step 3\) .*not this job's"):
        base.grown([bad])
    state = core.state()
    state["reshards"] = [bad.to_json()]
    fresh = make(model)
    if damage != "a home past the processes":  # the core does not know the processes (the layout does)
        with pytest.raises(PlanError, match=r"reshard 1 \(source 's0', step 3\)"):
            fresh.restore(state)
    fresh = make(model)
    fresh.restore(core.state())  # the record as the Planner wrote it is taken
    assert fresh.reshards == [record]


@pytest.mark.parametrize("damage", ["fields missing", "not a mapping", "a value not a number"])
def test_a_reshards_entry_that_is_not_a_record_is_named(damage):
    core, record, _ = _resharded()
    entry = {
        "fields missing": {"generation": 2},
        "not a mapping": ["s0", 2],
        "a value not a number": {**record.to_json(), "generation": 2, "homes": ["one"]},
    }[damage]
    state = core.state()
    state["reshards"] = [record.to_json(), entry]
    with pytest.raises(PlanError, match="reshards entry 1 is not a reshard record"):
        reshards_of(state)
