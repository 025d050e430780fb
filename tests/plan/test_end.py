"""How a finite job ends (item 7 of issue 16): no step with an empty micro-batch, the
last step that delivers carries `last`, drop_last both ways, and what happens to a
remainder too small to give every micro-batch of every DP group a sample."""

import numpy as np
import pytest

from overlord.config import Mesh
from overlord.errors import ConfigError, PlanError
from overlord.plan.core import PlannerCore
from overlord.plan.dgraph import DGraph
from overlord.plan.meta import MetaChunk
from overlord.plan.schedule import Piecewise
from overlord.plan.strategies import balanced, vanilla
from overlord.plan.tree import ClientPlaceTree


def make(sizes, *, final=True, dp=2, micro_batches=2, global_batch=8, **kw):
    """A finite core over one stream per source, fed `sizes` samples (random tokens)."""
    n = len(sizes)
    core = PlannerCore(
        streams=[f"s{i}.0" for i in range(n)],
        stream_source=list(range(n)),
        tree=ClientPlaceTree(Mesh(dp=dp)),
        seed=5,
        global_batch=global_batch,
        micro_batches=micro_batches,
        finite=True,
        weights=kw.pop("weights", [1.0] * n),
        **kw,
    )
    rng = np.random.default_rng(1)
    for i, size in enumerate(sizes):
        feed(core, i, 0, size, final, rng)
    return core


_RNG = np.random.default_rng(2)  # one stream across calls, as before


def feed(core, stream, start, stop, final, rng=_RNG):
    n = stop - start
    tokens = rng.integers(10, 400, n)
    core.add(
        stream,
        MetaChunk(0, np.arange(start, stop), tokens, np.zeros(n, int), tokens, [(0, stop)] if final else [], final),
    )


def run(core):
    plans = []
    while (plan := core.plan_step()) is not None:
        plans.append(plan)
    return plans


def cells(plan):
    return [len(mb) for bucket in plan.buckets for mb in bucket]


def delivered(plans):
    return sorted(item for p in plans for bucket in p.buckets for mb in bucket for item in mb)


@pytest.mark.parametrize("strategy", [vanilla, balanced])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_multiple_of_global_batch_ends_with_a_full_last_step(strategy, drop_last):
    core = make([13, 11, 8], strategy=strategy, drop_last=drop_last)  # 32 samples = 4 steps of 8
    plans = run(core)
    assert [p.step for p in plans] == [0, 1, 2, 3]
    assert [p.last for p in plans] == [False, False, False, True]
    assert all(p.samples() == 8 and min(cells(p)) >= 1 and p.dropped == 0 for p in plans)
    assert len(delivered(plans)) == 32 and len(set(delivered(plans))) == 32
    assert core.done and core.plan_step() is None  # and no empty step after it


@pytest.mark.parametrize("strategy", [vanilla, balanced])
def test_without_drop_last_a_partial_step_gives_every_micro_batch_a_sample(strategy):
    core = make([10, 9], strategy=strategy)  # 2 full steps, then 3 left for 4 micro-batches... no: 19 = 16 + 3
    plans = run(core)
    assert [p.samples() for p in plans] == [8, 8] and plans[-1].last and plans[-1].dropped == 3

    core = make([12, 9], strategy=strategy)  # 21 = 16 + 5: the partial step holds 5, in 2 groups x 2 micro-batches
    plans = run(core)
    assert [p.samples() for p in plans] == [8, 8, 5]
    assert [p.last for p in plans] == [False, False, True] and plans[-1].dropped == 0
    assert all(min(cells(p)) >= 1 for p in plans), [cells(p) for p in plans]
    assert delivered(plans) == sorted([(0, 0, q) for q in range(12)] + [(1, 0, q) for q in range(9)])


def test_with_drop_last_the_partial_step_is_dropped_and_counted():
    plans = run(make([12, 9], drop_last=True))
    assert [p.samples() for p in plans] == [8, 8]
    assert plans[-1].last and plans[-1].dropped == 5


def test_the_remainder_rule_counts_buckets_of_the_plan_axis():
    # 4 DP groups x 1 micro-batch: a remainder of 3 cannot reach every group, 4 can
    assert [p.samples() for p in run(make([10, 9], dp=4, micro_batches=1))] == [8, 8]
    assert [p.samples() for p in run(make([10, 10], dp=4, micro_batches=1))] == [8, 8, 4]


def test_the_end_waits_for_the_sources_to_say_they_ended_and_is_deterministic():
    whole = run(make([12, 9]))
    core = make([12, 9], final=False)
    assert [core.plan_step().step for _ in range(1)] == [0]  # 13 more reported: a full step follows
    assert core.plan_step() is None  # 5 reported after step 1, the sources not ended: wait, don't guess
    feed(core, 0, 12, 12, True)
    feed(core, 1, 9, 9, True)
    rest = run(core)
    assert [p.to_json() for p in whole] == [p.to_json() for p in [whole[0]] + rest]


def test_a_source_without_weight_at_the_next_step_does_not_hold_the_end_back():
    # source 1 (weight 0 from step 1 on) still holds samples: step 1 is the last full one of source 0
    schedule = Piecewise(np.array([0, 1]), np.array([[1.0, 1.0], [1.0, 0.0]]))
    core = make([12, 40], weights=None, schedule=schedule)
    plans = run(core)
    assert plans[-1].last and all(min(cells(p)) >= 1 for p in plans)
    assert not any(p.samples() == 0 for p in plans)


def test_deferred_samples_at_the_end_are_delivered_in_a_step_of_their_own_or_counted():
    def capped(data, tree):
        g = DGraph(data, tree, view="tokens").mix().distribute("DP")
        return g.cost("tokens").balance("greedy", level="both", capacity=100).plan()

    core = PlannerCore(
        streams=["s0.0"],
        stream_source=[0],
        tree=ClientPlaceTree(Mesh(dp=2)),
        seed=5,
        global_batch=8,
        micro_batches=2,
        finite=True,
        weights=[1.0],
        strategy=capped,
    )
    tokens = np.full(40, 60)  # two never fit one micro-batch of 100 tokens: half of each step is deferred
    core.add(0, MetaChunk(0, np.arange(40), tokens, np.zeros(40, int), tokens, [(0, 40)], True))
    plans = run(core)
    assert plans[-1].last and all(min(cells(p)) >= 1 for p in plans)
    got = len(delivered(plans))
    assert got + plans[-1].dropped == 40 and len(set(delivered(plans))) == got


def test_substep_mixing_ends_without_an_empty_micro_batch():
    class Drift:  # source 1's share grows within a step
        def weights(self, t):
            return np.array([1.0, t - int(t) + 0.01])

    core = make(
        [11, 10],
        weights=None,
        schedule=Drift(),
        mixing_unit="substep",
        strategy=balanced,
        micro_batches=4,
        global_batch=16,
        dp=1,
    )
    plans = run(core)
    assert [p.samples() for p in plans] == [16, 5] and plans[-1].last
    assert all(min(cells(p)) >= 1 for p in plans)


def test_too_little_data_for_one_step_is_refused_naming_the_fix():
    with pytest.raises(PlanError, match="fewer than one step can deliver.*lower BatchSpec.global_batch"):
        make([2, 1]).plan_step()  # 3 samples, 2 groups x 2 micro-batches
    with pytest.raises(PlanError, match="drop_last=True needs global_batch=8"):
        make([4, 3], drop_last=True).plan_step()


def test_a_global_batch_smaller_than_the_micro_batches_is_refused():
    with pytest.raises(ConfigError, match="raise global_batch to at least 8"):
        make([100], dp=4, micro_batches=2, global_batch=4)


def test_a_mixture_moved_at_run_time_ends_with_a_sampleless_step_not_empty_micro_batches():
    class Switch:  # stands for Dynamic: weights the trainers' metrics change between steps
        w = np.array([1.0, 0.0])

        def weights(self, step):
            return self.w

    schedule = Switch()
    core = make([20, 2], weights=None, schedule=schedule)
    assert [core.plan_step().last for _ in range(2)] == [False, False]  # 4 of source 0 left: a partial step follows
    schedule.w = np.array([0.0, 1.0])  # now only source 1 (2 samples) is weighted: 2 for 2 x 2 micro-batches
    plan = core.plan_step()
    assert plan.last and plan.samples() == 0 and plan.dropped == 2  # the constructors deliver nothing, close
    assert core.plan_step() is None
