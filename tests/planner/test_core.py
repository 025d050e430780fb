"""The pure Planner core: same inputs, same plan; each sample once; weights respected."""

import numpy as np
import pytest

from overlord.planner.core import Plan, PlannerCore
from overlord.planner.meta import MetaChunk, decode, encode


def chunk(epoch, seqs, final=False, ended=()):
    n = len(seqs)
    return MetaChunk(epoch, np.asarray(seqs), np.full(n, 10), np.zeros(n, int), np.full(n, 40), list(ended), final)


def make(weights=(1.0, 1.0), partitions=(1, 1), finite=False, **kw):
    streams, owner = [], []
    for s, p in enumerate(partitions):
        for i in range(p):
            streams.append(f"s{s}.{i}")
            owner.append(s)
    args = dict(seed=3, global_batch=8, dp=2, micro_batches=2, finite=finite)
    args.update(kw)
    return PlannerCore(streams=streams, stream_source=owner, weights=list(weights), **args)


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
        assert len(plan.dp) == 2 and all(len(g) == 2 for g in plan.dp)
        seen += [tuple(x) for g in plan.dp for mb in g for x in mb]
    assert plans[-1].last and not any(p.last for p in plans[:-1])
    assert all(p.samples() == 8 for p in plans[:-1])
    assert sorted(seen) == sorted({(s, 0, q) for s, n in enumerate([37, 41, 23]) for q in range(n)})
    # equal counts per DP group in full steps
    for p in plans[:-1]:
        assert len({sum(len(mb) for mb in g) for g in p.dp}) == 1


def test_drop_last_drops_the_partial_step():
    core = make(finite=True, drop_last=True)
    feed(core, [5, 6], final=True)
    plan = core.plan_step()
    assert plan.samples() == 8
    last = core.plan_step()
    assert last.last and last.samples() == 0


def test_achieved_mix_matches_weights():
    weights = (0.6, 0.3, 0.1)
    core = make(weights=weights, partitions=(1, 1, 1), global_batch=64)
    feed(core, [100_000] * 3)
    counts = np.zeros(3)
    for _ in range(200):
        for g in core.plan_step().dp:
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
        assert all(s == 0 for g in core.plan_step().dp for mb in g for s, _, _ in mb)


def test_state_names_cursors():
    core = make()
    feed(core, [100, 100])
    core.plan_step()
    state = core.state()
    assert state["step"] == 1 and set(state["cursors"]) == {"s0.0", "s1.0"}
    assert sum(c[1] + 1 for c in state["cursors"].values()) == 8
