"""The pure Planner core: same inputs, same plan; each sample once; weights respected."""

import dataclasses

import numpy as np
import pytest

from overlord.config import Mesh
from overlord.plan.core import PlannerCore
from overlord.plan.meta import MetaChunk, decode, encode
from overlord.plan.step_plan import Plan
from overlord.plan.tree import ClientPlaceTree


def chunk(epoch, seqs, final=False, ended=()):
    n = len(seqs)
    return MetaChunk(epoch, np.asarray(seqs), np.full(n, 10), np.zeros(n, int), np.full(n, 40), list(ended), final)


def make(weights=(1.0, 1.0), partitions=(1, 1), finite=False, **kw):
    streams, owner = [], []
    for s, p in enumerate(partitions):
        for i in range(p):
            streams.append(f"s{s}.{i}")
            owner.append(s)
    args = dict(seed=3, global_batch=8, micro_batches=2, finite=finite, tree=ClientPlaceTree(Mesh(dp=kw.pop("dp", 2))))
    args.update(kw)
    return PlannerCore(streams=streams, stream_source=owner, weights=None if weights is None else list(weights), **args)


def feed(core, sizes, final=False):
    for i, n in enumerate(sizes):
        core.add(i, chunk(0, range(n), final=final, ended=[(0, n)] if final else []))


def test_meta_round_trip():
    c = chunk(2, [5, 6, 9], final=True, ended=[(1, 40)])
    back = decode({k.encode(): v for k, v in encode(c).items()})
    assert back.epoch == 2 and list(back.seq) == [5, 6, 9] and back.final and back.ended == [(1, 40)]


def test_same_inputs_same_plans():
    a, b = make(), make()
    feed(a, [100, 100])
    feed(b, [100, 100])
    plans_a = [a.plan_step().to_json() for _ in range(10)]
    plans_b = [b.plan_step().to_json() for _ in range(10)]
    assert plans_a == plans_b
    assert Plan.from_json(plans_a[3]).step == 3


def test_waits_instead_of_guessing_then_gives_same_plan():
    early, late = make(), make()
    early.add(0, chunk(0, range(2)))
    early.add(1, chunk(0, range(2)))
    assert early.plan_step() is None  # not enough buffered: wait, consume nothing
    early.add(0, chunk(0, range(2, 100)))
    early.add(1, chunk(0, range(2, 100)))
    feed(late, [100, 100])
    assert early.plan_step().to_json() == late.plan_step().to_json()


def test_every_sample_exactly_once_in_a_finite_job_and_shapes():
    core = make(weights=(3.0, 1.0), partitions=(2, 1), finite=True)
    feed(core, [37, 41, 23], final=True)
    seen, plans = [], []
    while (plan := core.plan_step()) is not None:
        plans.append(plan)
        assert len(plan.buckets) == 2 and all(len(g) == 2 for g in plan.buckets)
        seen += [tuple(x) for g in plan.buckets for mb in g for x in mb]
    assert plans[-1].last and not any(p.last for p in plans[:-1])
    assert all(p.samples() == 8 for p in plans[:-1])
    assert sorted(seen) == sorted({(s, 0, q) for s, n in enumerate([37, 41, 23]) for q in range(n)})
    # equal counts per DP group in full steps
    for p in plans[:-1]:
        assert len({sum(len(mb) for mb in g) for g in p.buckets}) == 1


def test_drop_last_drops_the_partial_step():
    core = make(finite=True, drop_last=True)
    feed(core, [5, 6], final=True)
    plan = core.plan_step()
    assert plan.samples() == 8 and plan.last and plan.dropped == 3  # no empty step after it
    assert core.plan_step() is None and core.done


def test_achieved_mix_matches_weights():
    weights = (0.6, 0.3, 0.1)
    core = make(weights=weights, partitions=(1, 1, 1), global_batch=64)
    feed(core, [100_000] * 3)
    counts = np.zeros(3)
    for _ in range(200):
        for g in core.plan_step().buckets:
            for mb in g:
                for s, _, _ in mb:
                    counts[s] += 1
    share = counts / counts.sum()
    n = counts.sum()
    for w, got in zip(weights, share):
        assert abs(got - w) < 4 * np.sqrt(w * (1 - w) / n)


def test_zero_weight_source_never_planned():
    core = make(weights=(1.0, 0.0))
    feed(core, [1000, 1000])
    for _ in range(20):
        assert all(s == 0 for g in core.plan_step().buckets for mb in g for s, _, _ in mb)


def test_state_names_cursors():
    core = make()
    feed(core, [100, 100])
    core.plan_step()
    state = core.state()
    assert state["step"] == 1 and set(state["cursors"]) == {"s0.0", "s1.0"}
    assert sum(c[1] + 1 for c in state["cursors"].values()) == 8


def test_balanced_strategy_is_deterministic_complete_and_balances():
    from overlord.plan.strategies import balanced

    def run(strategy):
        core = make(weights=(1.0, 1.0), finite=True, global_batch=64, dp=4, micro_batches=2, strategy=strategy)
        rng = np.random.default_rng(0)
        for i, n in enumerate([400, 400]):
            tokens = np.where(rng.random(n) < 0.95, rng.integers(5, 64, n), rng.integers(500, 4000, n))
            core.add(i, MetaChunk(0, np.arange(n), tokens, np.zeros(n, int), tokens * 4, [(0, n)], True))
        plans = []
        while (p := core.plan_step()) is not None:
            plans.append(p)
        return plans, {(s, q): t for s in range(2) for q, t in enumerate(core.streams[s].chunks or [])}

    a, _ = run(balanced)
    b, _ = run(balanced)
    assert [p.to_json() for p in a] == [p.to_json() for p in b]
    seen = [x for p in a for bucket in p.buckets for mb in bucket for x in mb]
    assert sorted(seen) == sorted({(s, 0, q) for s in range(2) for q in range(400)})
    # every DP rank gets the same number of samples in every full step
    for p in a[:-1]:
        assert len({sum(len(mb) for mb in bucket) for bucket in p.buckets}) == 1


def test_a_strategy_that_drops_samples_is_refused():
    from overlord.errors import PlanError
    from overlord.plan.dgraph import DGraph

    def lossy(data, tree):
        planned = DGraph(data, tree).mix().distribute("DP").plan()
        buckets = planned.plan.buckets
        buckets[0][0].pop()
        return dataclasses.replace(planned, plan=Plan.from_lists(planned.plan.step, buckets))

    core = make(strategy=lossy)
    feed(core, [100, 100])
    with pytest.raises(PlanError, match="exactly once"):
        core.plan_step()


@pytest.mark.parametrize("fault", ["twice", "unselected", "other_epoch"])
def test_a_strategy_that_plans_a_sample_twice_or_one_not_selected_is_refused(fault):
    """The same count of samples as selected, one of them wrong: the check compares the
    samples themselves, not how many there are."""
    from overlord.errors import PlanError
    from overlord.plan.dgraph import DGraph

    def wrong(data, tree):
        planned = DGraph(data, tree).mix().distribute("DP").plan()
        buckets = planned.plan.buckets
        stream, epoch, seq = buckets[0][0][-1]
        buckets[0][0][-1] = {
            "twice": buckets[-1][-1][0],  # another micro-batch's sample, so it is planned twice
            "unselected": (stream, epoch, seq + 10_000),
            "other_epoch": (stream, epoch + 1, seq),
        }[fault]
        return dataclasses.replace(planned, plan=Plan.from_lists(planned.plan.step, buckets))

    core = make(strategy=wrong)
    feed(core, [100, 100])
    with pytest.raises(PlanError, match="exactly once"):
        core.plan_step()


def test_capacity_defers_what_does_not_fit_and_plans_it_once_later():
    from overlord.plan.dgraph import DGraph

    def capped(data, tree):
        g = DGraph(data, tree, view="tokens").mix().distribute("DP")
        return g.cost("tokens").balance("greedy", level="both", capacity=100).plan()

    core = make(weights=(1.0,), partitions=(1,), strategy=capped, finite=True, global_batch=8, dp=2, micro_batches=2)
    tokens = np.full(40, 60)  # two never fit one micro-batch of 100 tokens
    core.add(0, MetaChunk(0, np.arange(40), tokens, np.zeros(40, int), tokens, [(0, 40)], True))
    seen, deferred = [], []
    while (p := core.plan_step()) is not None:
        deferred.append(p.deferred)
        for bucket in p.buckets:
            for mb in bucket:
                assert sum(int(tokens[q]) for _, _, q in mb) <= 100
                seen += mb
    assert max(deferred) > 0 and deferred[-1] == 0
    assert sorted(seen) == [(0, 0, q) for q in range(40)]


def test_a_sample_larger_than_capacity_is_sized_as_delivered_or_refused_with_its_name():
    from overlord.errors import PlanError
    from overlord.plan.dgraph import DGraph

    def capped(data, tree):
        g = DGraph(data, tree, view="tokens").mix().distribute("DP")
        return g.cost("tokens").balance("greedy", level="both", capacity=100).plan()

    tokens = np.full(16, 10)
    tokens[5] = 200  # one long document among short ones
    # cut at context_length 64, it takes 64 tokens of a micro-batch: it fits, and is delivered
    core = make(
        weights=(1.0,),
        partitions=(1,),
        strategy=capped,
        finite=True,
        global_batch=8,
        dp=2,
        micro_batches=2,
        context_length=64,
    )
    core.add(0, MetaChunk(0, np.arange(16), tokens, np.zeros(16, int), tokens, [(0, 16)], True))
    seen = []
    while (p := core.plan_step()) is not None:
        seen += [x for bucket in p.buckets for mb in bucket for x in mb]
    assert sorted(seen) == [(0, 0, q) for q in range(16)]
    # at context_length 4096 no micro-batch of 100 tokens could take it: said at once, not deferred forever
    core = make(
        weights=(1.0,),
        partitions=(1,),
        strategy=capped,
        finite=True,
        global_batch=8,
        dp=2,
        micro_batches=2,
        context_length=4096,
    )
    core.add(0, MetaChunk(0, np.arange(16), tokens, np.zeros(16, int), tokens, [(0, 16)], True))
    with pytest.raises(PlanError, match=r"sample 5 of stream 's0.0' .* 200 tokens .*capacity=100"):
        core.plan_step()


@pytest.mark.parametrize("options", [dict(level="interleaved"), dict(level="both", keep_order=True)])
def test_other_balance_modes_plan_every_sample_once(options):
    from overlord.plan.dgraph import DGraph

    def strategy(data, tree):
        return DGraph(data, tree).mix().distribute("DP").cost("attention").balance("greedy", **options).plan()

    core = make(strategy=strategy, finite=True, global_batch=16, dp=2, micro_batches=2)
    feed(core, [50, 30], final=True)
    seen = []
    while (p := core.plan_step()) is not None:
        seen += [x for bucket in p.buckets for mb in bucket for x in mb]
    assert sorted(seen) == sorted({(s, 0, q) for s, n in enumerate([50, 30]) for q in range(n)})


def test_keep_order_keeps_the_round_robin_composition():
    from overlord.plan.dgraph import DGraph
    from overlord.plan.strategies import vanilla

    def kept(data, tree):
        return (
            DGraph(data, tree)
            .mix()
            .distribute("DP")
            .cost("attention")
            .balance("greedy", level="both", keep_order=True)
            .plan()
        )

    a, b = make(strategy=kept), make(strategy=vanilla)
    feed(a, [100, 100])
    feed(b, [100, 100])
    for _ in range(5):
        assert a.plan_step().buckets == b.plan_step().buckets


def test_group_size_balances_inside_groups_of_buckets():
    from overlord.plan.dgraph import DGraph

    def grouped(data, tree):
        return (
            DGraph(data, tree).mix().distribute("DP", group_size=2).cost("attention").balance("karmarkar_karp").plan()
        )

    core = make(strategy=grouped, global_batch=32, dp=4)
    feed(core, [500, 500])
    plan = core.plan_step()
    assert len(plan.buckets) == 4 and plan.samples() == 32
    assert {sum(len(mb) for mb in b) for b in plan.buckets} == {8}


def test_vlm_encoder_world_places_every_image_once_and_balances_patches():
    from overlord.plan.strategies import vlm_encoder_world

    core = make(weights=(1.0, 1.0), finite=False, global_batch=64, dp=4, micro_batches=2, strategy=vlm_encoder_world)
    rng = np.random.default_rng(1)
    n = 2000
    core.add(0, MetaChunk(0, np.arange(n), rng.integers(5, 60, n), np.zeros(n, int), np.full(n, 100)))
    patches = rng.integers(16, 1024, n)
    core.add(1, MetaChunk(0, np.arange(n), rng.integers(5, 30, n), patches, patches * 768))
    for _ in range(5):
        plan = Plan.from_json(core.plan_step().to_json())
        images = [x for bucket in plan.buckets for mb in bucket for x in mb if x[0] == 1]
        encoded = [x for rank in plan.encoder for x in rank]
        assert len(plan.encoder) == 4 and sorted(encoded) == sorted(images)
        load = [sum(int(patches[q]) for _, _, q in rank) for rank in plan.encoder]
        assert max(load) / np.mean(load) < 1.15, load


def test_plan_raw_builds_a_plan_from_an_explicit_placement():
    from overlord.errors import ConfigError
    from overlord.plan.dgraph import DGraph

    def raw(data, tree):
        g = DGraph(data, tree).mix()
        n = len(g.items)
        return g.plan_raw(np.arange(n) % 2, np.zeros(n, dtype=np.int64))

    core = make(strategy=raw)
    feed(core, [100, 100])
    plan = core.plan_step()
    assert all(len(bucket[1]) == 0 for bucket in plan.buckets) and plan.samples() == 8

    def bad(data, tree):
        g = DGraph(data, tree).mix()
        return g.plan_raw(np.full(len(g.items), 7), np.zeros(len(g.items), dtype=np.int64))

    core = make(strategy=bad)
    feed(core, [100, 100])
    with pytest.raises(ConfigError, match="plan_raw"):
        core.plan_step()


def test_substep_mixing_gives_each_micro_batch_its_own_mixture():
    from overlord.plan.strategies import balanced

    class WithinStep:  # source b's share grows from 0 to 3/4 across a step's micro-batches
        def weights(self, t):
            frac = t - int(t)
            return np.array([1.0 - frac, frac])

    core = make(
        weights=None,
        schedule=WithinStep(),
        mixing_unit="substep",
        strategy=balanced,
        global_batch=32,
        dp=2,
        micro_batches=4,
    )
    feed(core, [5000, 5000])
    share_b = np.zeros(4)
    for _ in range(40):
        plan = core.plan_step()
        assert plan.samples() == 32 and all(len(bucket[m]) == 4 for bucket in plan.buckets for m in range(4))
        share_b += [sum(s == 1 for bucket in plan.buckets for s, _, _ in bucket[m]) / 8 / 40 for m in range(4)]
    assert np.allclose(share_b, [0, 0.25, 0.5, 0.75], atol=0.08), share_b


def test_epoch_mixing_switches_when_the_job_reaches_an_epoch():
    from overlord.plan.schedule import from_config

    schedule = from_config(
        {"kind": "piecewise", "unit": "epoch", "points": [[0, {"a": 1.0}], [1, {"b": 1.0}]]}, ["a", "b"], [1, 1]
    )
    core = make(weights=None, schedule=schedule, mixing_unit="epoch", global_batch=8)
    core.add(0, chunk(0, range(24), ended=[(0, 24)]))
    core.add(0, chunk(1, range(24)))
    core.add(1, chunk(0, range(100)))
    sources = [{s for bucket in core.plan_step().buckets for mb in bucket for s, _, _ in mb} for _ in range(5)]
    assert sources[:3] == [{0}, {0}, {0}] and sources[4] == {1}  # epoch 1 of "a" begins at step 3


def test_the_job_epoch_follows_each_planned_step_and_a_restore():
    """epoch() is kept between the moves of a cursor (a planned step, a restore): it
    must never answer from before one."""
    core = make(global_batch=8)
    for i in (0, 1):
        core.add(i, chunk(0, range(8), ended=[(0, 8)]))
        core.add(i, chunk(1, range(40)))
    seen = []
    for _ in range(4):
        seen.append(core.epoch())
        core.plan_step()
    seen.append(core.epoch())
    assert seen[0] == 0 and seen[-1] == 1 and seen == sorted(seen)
    state = core.state()
    fresh = make(global_batch=8)
    assert fresh.epoch() == 0  # kept from here ...
    fresh.restore(state)
    assert fresh.epoch() == 1  # ... and not after a restore


def test_the_kept_job_epoch_is_the_one_the_cursors_give_after_every_step():
    """epoch() is recomputed only when a step moves a cursor into another epoch or plans
    a stream for the first time: after each step it equals the cursors' lowest epoch."""
    core = make(weights=(1.0, 0.5, 2.0), partitions=(2, 2, 1), global_batch=12)
    sizes = [7, 13, 5, 11, 30]
    for i, size in enumerate(sizes):
        for epoch in range(4):
            core.add(i, chunk(epoch, range(size), ended=[(epoch, size)]))
    epochs = []
    while (plan := core.plan_step()) is not None:
        assert core.epoch() == core._lowest_epoch(), plan.step
        epochs.append(core.epoch())
    assert len(epochs) >= 8 and epochs[0] == 0 and epochs[-1] >= 2 and epochs == sorted(epochs)


def test_a_restored_core_plans_exactly_what_the_original_did():
    """Resumption: restore the state saved after step s, feed only what loaders restarted
    at the cursors report, and the plans from s on are the original's, byte for byte."""
    from overlord.plan.dgraph import DGraph

    def capped(data, tree):  # capacity makes the state carry deferred samples
        g = DGraph(data, tree, view="tokens").mix().distribute("DP").cost("attention")
        return g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra", capacity=160).plan()

    rng = np.random.default_rng(4)
    tokens = [rng.integers(5, 150, 400), rng.integers(5, 60, 400)]

    def fed(core, after=None):
        for i in range(2):
            start = 0 if after is None else after[f"s{i}.0"][1] + 1
            seqs = np.arange(start, 400)
            core.add(i, MetaChunk(0, seqs, tokens[i][seqs], np.zeros(len(seqs), int), tokens[i][seqs]))
        return core

    original = fed(make(strategy=capped, global_batch=16, dp=2, micro_batches=2))
    plans, states = [], []
    for _ in range(12):
        states.append(original.state())
        plans.append(original.plan_step().to_json())
    assert any(s["deferred"] for s in states), "the test needs deferred samples in a checkpoint"
    for s in (3, 7):
        resumed = make(strategy=capped, global_batch=16, dp=2, micro_batches=2)
        resumed.restore(states[s])
        fed(resumed, after=states[s]["cursors"])
        assert [resumed.plan_step().to_json() for _ in range(12 - s)] == plans[s:]


def test_restore_refuses_a_checkpoint_of_other_streams():
    from overlord.errors import PlanError

    core = make()
    state = core.state()
    state["cursors"] = {"other.0": [0, -1]}
    with pytest.raises(PlanError, match="cannot change across a resume"):
        make().restore(state)


def test_a_waiting_step_says_how_many_samples_each_stream_must_hold():
    core = make(weights=(1.0,), partitions=(2,), global_batch=16)
    core.add(0, chunk(0, range(3)))
    core.add(1, chunk(0, range(3)))
    assert core.plan_step() is None
    assert core.wanted == {0: 8, 1: 8}  # 16 samples round robin over two streams
    core.add(0, chunk(0, range(3, 10)))
    core.add(1, chunk(0, range(3, 10)))
    assert core.plan_step() is not None and core.wanted == {}


def _counting(calls):
    from overlord.plan.strategies import vanilla

    def strategy(data, tree):
        calls.append(data.step)
        return vanilla(data, tree)

    return strategy


def test_a_step_that_stopped_for_metadata_is_tried_again_only_once_a_stream_it_named_holds_its_ask():
    calls = []
    core = make(weights=(1.0, 1.0), partitions=(2, 1), global_batch=16, strategy=_counting(calls))
    core.add(2, chunk(0, range(40)))
    assert core.plan_step() is None and len(calls) == 1
    named = set(core.wanted)
    assert named == {0, 1}, core.wanted  # source 0 is short, source 1 holds plenty
    core.add(2, chunk(0, range(40, 80)))  # another stream's report cannot undo the shortage
    assert core.plan_step() is None and len(calls) == 1, "tried again though no stream it named reported"
    assert core.wanted and set(core.wanted) == named  # the loaders are still asked for the same
    asked = core.wanted[0]
    assert asked >= 2
    core.add(0, chunk(0, range(asked - 1)))  # a named stream reports, still short of its ask: not tried
    assert core.plan_step() is None and len(calls) == 1
    core.add(0, chunk(0, range(asked - 1, asked)))  # it holds its ask: tried again (stream 1 is still short)
    assert core.plan_step() is None and len(calls) == 2
    for i in (0, 1):
        core.add(i, chunk(0, range(asked if i == 0 else 0, 40)))
    assert core.plan_step() is not None and len(calls) == 3 and core.wanted == {}


def test_a_named_stream_that_reports_its_end_ends_the_wait():
    """A finite job: the short stream reports its end without a sample; the step is tried
    again and takes what the source has (the end of the job)."""
    calls = []
    core = make(weights=(1.0,), partitions=(1,), global_batch=8, finite=True, strategy=_counting(calls))
    core.add(0, chunk(0, range(5)))
    assert core.plan_step() is None and len(calls) == 1
    assert core.plan_step() is None and len(calls) == 1
    core.add(0, chunk(0, [], final=True, ended=[(0, 5)]))
    plan = core.plan_step()
    assert plan is not None and plan.last and len(calls) == 2


@pytest.mark.parametrize("finite", [False, True], ids=["endless", "finite"])
def test_skipping_a_try_that_would_stop_again_changes_no_plan(monkeypatch, finite):
    """The same reports, in small random chunks to random streams, give the same plans
    whether or not a try is skipped while no named stream reported: the skip only saves
    tries (and the loop that feeds stops by itself)."""
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(30, 90, 5)]
    reports = []
    for _ in range(400):
        i = int(rng.integers(0, 5))
        reports.append((i, int(rng.integers(1, 6))))

    def run(skip):
        calls = []
        core = make(
            weights=(1.0, 0.5, 2.0), partitions=(2, 2, 1), global_batch=12, finite=finite, strategy=_counting(calls)
        )
        if not skip:
            monkeypatch.setattr(core, "_still_short", lambda: False)
        fed, plans, queue, last = [0] * 5, [], list(reports), False
        while not last and len(plans) < 60:
            plan = core.plan_step()
            if plan is not None:
                plans.append(plan.to_json())
                last = plan.last
                continue
            if not queue:
                break
            i, n = queue.pop(0)
            top = min(fed[i] + n, sizes[i])
            final = finite and top == sizes[i]
            core.add(i, chunk(0, range(fed[i], top), final=final, ended=[(0, sizes[i])] if final else []))
            fed[i] = top
        return plans, len(calls)

    plans, tries = run(skip=True)
    plans_without, tries_without = run(skip=False)
    assert len(plans) >= 8 and plans == plans_without
    assert tries < tries_without, (tries, tries_without)


def test_a_strategy_that_stops_for_a_stream_the_job_lacks_is_named():
    from overlord.errors import PlanError
    from overlord.plan.buffer import NeedMetadata

    def strategy(data, tree):
        raise NeedMetadata({7: 4})

    core = make(strategy=strategy)
    with pytest.raises(PlanError, match=r"stream\(s\) \[7\].*streams 0\.\.1.*fix the strategy"):
        core.plan_step()
