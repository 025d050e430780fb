"""The offline partitioner on synthetic cost tables: within budget, limits respected,
heavy sources get more, memory splits a source."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.autoscale import Budget, PartitionError, SourceCost, partition


def _table(n, rng_costs, weights=None):
    return [SourceCost(name=f"s{i}", weight=(weights or [1.0] * n)[i], transform_ms=c) for i, c in enumerate(rng_costs)]


def test_heavy_sources_get_more_workers_and_their_own_processes():
    costs = [
        SourceCost(name="video", weight=1, transform_ms=40.0),
        SourceCost(name="images", weight=1, transform_ms=8.0),
        *[SourceCost(name=f"text{i}", weight=1, transform_ms=0.4) for i in range(6)],
    ]
    p = partition(costs, Budget(cpus=16, memory_mb=16000, cluster_size=1))
    assert p.of("video").workers > p.of("images").workers > p.of("text0").workers
    assert p.of("video").workers == 8  # capped at max_workers_per_source
    assert p.of("video").partitions == 2  # 8 workers at most 4 per loader process
    assert p.of("text0").workers < 1  # light sources share a worker
    text_homes = [k for k, hosted in enumerate(p.loaders) if any(n.startswith("text") for n, _ in hosted)]
    assert len(text_homes) < 6, "light sources are packed together"
    assert all(n == "video" for n, _ in p.loaders[0])
    assert "video" in p.render()


def test_a_cluster_shares_one_resource_level():
    costs = [
        SourceCost(name="a", weight=1, transform_ms=10.0),
        SourceCost(name="b", weight=1, transform_ms=6.0),
        SourceCost(name="c", weight=1, transform_ms=0.1),
        SourceCost(name="d", weight=1, transform_ms=0.1),
    ]
    p = partition(costs, Budget(cpus=10, memory_mb=8000, cluster_size=2))
    assert p.of("a").cluster == p.of("b").cluster != p.of("c").cluster
    assert p.of("a").demand == p.of("b").demand > p.of("c").demand


def test_weight_scales_the_demand():
    costs = [SourceCost(name="a", weight=3, transform_ms=1.0), SourceCost(name="b", weight=1, transform_ms=1.0)]
    p = partition(costs, Budget(cpus=10, memory_mb=8000, constructor_cpus=1, planner_cpus=1))
    assert p.of("a").workers == 6 and p.of("b").workers == 2


def test_file_state_beyond_one_loader_raises_the_partitions():
    costs = [
        SourceCost(name="wide", weight=1, transform_ms=1.0, state_mb=5000),
        SourceCost(name="b", weight=1, transform_ms=1.0),
    ]
    p = partition(costs, Budget(cpus=4, memory_mb=64000, max_loader_mb=1024))
    assert p.of("wide").partitions == 5 and p.of("b").partitions == 1
    assert any("file state" in n for n in p.notes)


def test_a_budget_that_cannot_hold_the_sources_says_what_to_raise():
    costs = _table(3, [1.0, 2.0, 3.0])
    with pytest.raises(PartitionError, match="raise the CPU budget"):
        partition(costs, Budget(cpus=1.5, memory_mb=8000))
    with pytest.raises(PartitionError, match="raise the memory budget"):
        partition(costs, Budget(cpus=8, memory_mb=500))
    with pytest.raises(PartitionError, match="max_partitions"):
        partition(
            [SourceCost(name="x", weight=1, transform_ms=1, state_mb=10000)],
            Budget(cpus=4, memory_mb=10**6, max_partitions=4),
        )


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=40),
    weights=st.data(),
    cpus=st.integers(3, 64),
    w_src=st.integers(1, 16),
    w_actor=st.integers(1, 8),
)
def test_sums_within_budget_and_limits_respected(costs, weights, cpus, w_src, w_actor):
    ws = weights.draw(st.lists(st.floats(0.01, 10.0), min_size=len(costs), max_size=len(costs)))
    budget = Budget(
        cpus=cpus, memory_mb=10**7, max_workers_per_source=w_src, max_workers_per_loader=w_actor, max_partitions=64
    )
    p = partition(_table(len(costs), costs, ws), budget)
    assert sum(s.workers for s in p.sources) <= budget.loader_cpus + 1e-6
    assert all(s.workers <= w_src for s in p.sources)
    assert all(w <= w_actor + 1e-9 for w in p.loader_workers)
    hosted = sorted(x for loader in p.loaders for x in loader)
    assert hosted == sorted((s.name, k) for s in p.sources for k in range(s.partitions)), "every partition hosted once"
    # at equal weight, a costlier cluster never gets fewer workers
    by_cluster = {}
    for s in p.sources:
        by_cluster.setdefault(s.cluster, []).append(s)


def test_read_buffers_are_budgeted_in_bytes_from_weight_sample_size_and_horizon():
    costs = [
        SourceCost(name="text", weight=3, transform_ms=1.0, sample_kb=4, state_mb=0),
        SourceCost(name="images", weight=1, transform_ms=1.0, sample_kb=1024, state_mb=0),
    ]
    budget = Budget(cpus=4, memory_mb=10**6, buffer_bytes=64 << 20)
    p = partition(costs, budget, global_batch=64, plan_ahead=4)
    # text: 2 x (48 a step x 5 steps + 3 sqrt(240)) x 4 KiB; images: 2 x (80 + 3 sqrt 80) MiB, capped at 64
    assert p.of("text").memory_mb == pytest.approx(1.5 * (240 + 3 * 240**0.5) * 4 / 1024, abs=0.1)
    assert p.of("images").memory_mb == pytest.approx(64.0, abs=0.1)
    # the source's own cap, and the sample cap
    capped = partition(costs, budget, global_batch=64, plan_ahead=4, buffer_caps={"images": 8 << 20})
    assert capped.of("images").memory_mb == pytest.approx(8.0, abs=0.1)
    few = partition(costs, Budget(cpus=4, memory_mb=10**6, buffer_samples=10), global_batch=64, plan_ahead=4)
    assert few.of("images").memory_mb == pytest.approx(10.0, abs=0.1)


def test_a_source_the_schedule_makes_costly_later_gets_its_peak_partitions_now():
    costs = [
        SourceCost(name="video", weight=1, transform_ms=40.0),
        SourceCost(name="images", weight=0.01, transform_ms=40.0),
        *[SourceCost(name=f"text{i}", weight=1, transform_ms=0.4) for i in range(4)],
    ]
    budget = Budget(cpus=8, memory_mb=16000, cluster_size=1, max_workers_per_loader=1)  # 6 worker blocks
    now = partition(costs, budget)
    later = {"video": 0.01, "images": 1.0, **{f"text{i}": 1.0 for i in range(4)}}
    both = partition(costs, budget, mixtures=[{c.name: c.weight for c in costs}, later])
    assert now.of("images").partitions == 1  # light at step 0
    assert both.of("images").partitions >= 4  # as many as its peak needs (5-6 of the 6 workers)
    assert both.of("images").workers == now.of("images").workers  # workers follow the weight now
    homes = {k for k, hosted in enumerate(both.loaders) for n, _ in hosted if n == "images"}
    assert len(homes) < both.of("images").partitions  # packed by their demand now: handoffs spread them later
