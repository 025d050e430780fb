"""Golden plans: the encoded plans of fixed inputs at 4, 8, 64 and 512 DP ranks, as digests.

A change to the balancers or the plan encoding that moves any byte fails here. The
digests were taken with the numpy balancers before the compiled kernels existed; they
hold with the kernels and without them. Regenerate them only for a change that must
alter plans, and say in its commit why balance and determinism are no worse.
"""

import hashlib

import numpy as np
import pytest

from overlord.config import Mesh
from overlord.plan import strategies
from overlord.plan.balance import assign
from overlord.plan.core import PlannerCore
from overlord.plan.meta import MetaChunk
from overlord.plan.tree import ClientPlaceTree

PLANS = {
    ("vlm_hybrid", 4, 256): "d3b7869330bc3f08",
    ("vlm_hybrid", 64, 4096): "640ed700b0e98cc1",
    ("vlm_hybrid", 512, 65536): "c7ff0f9055a6fb27",
    ("balanced", 64, 4096): "bba8d755e572c7e2",
    ("vlm_encoder_world", 8, 512): "7f751d62660f38c1",
}


def _metadata(rng, n):
    """Token counts with a 5% tail to 4096, and half the samples with an image."""
    tokens = np.minimum(rng.integers(1, 64, n) + (rng.random(n) < 0.05) * rng.integers(64, 4096, n), 4096)
    patches = rng.integers(0, 2, n) * rng.integers(16, 4096, n)
    return tokens.astype(np.int64), patches.astype(np.int64)


@pytest.mark.parametrize("strategy,dp,samples", list(PLANS))
def test_plans_are_the_golden_bytes(strategy, dp, samples):
    n_src = 4
    core = PlannerCore(
        streams=[f"s{i}.0" for i in range(n_src)],
        stream_source=list(range(n_src)),
        tree=ClientPlaceTree(Mesh(dp=dp)),
        weights=[1.0] * n_src,
        seed=7,
        global_batch=samples,
        micro_batches=8,
        finite=False,
        strategy=getattr(strategies, strategy),
    )
    rng = np.random.default_rng([dp, 3])
    per = samples * 4 // n_src * 2
    for i in range(n_src):
        tokens, patches = _metadata(rng, per)
        core.add(i, MetaChunk(0, np.arange(per), tokens, patches, tokens * 4))
    digest = hashlib.sha256()
    for _ in range(3):
        plan = core.plan_step()
        assert plan is not None
        digest.update(plan.encode())
    assert digest.hexdigest()[:16] == PLANS[(strategy, dp, samples)]


def test_assign_is_the_golden_bins():
    """assign's other paths: classic KK, capacity (repair, one-pair refinement), interleaved, LPT."""
    rng = np.random.default_rng(1)
    digest = hashlib.sha256()
    for n, k in ((1000, 16), (300, 7), (5000, 64)):
        c = rng.pareto(1.1, n) * 100
        s = rng.integers(1, 100, n).astype(float)
        for kw in (
            {},
            {"equal_count": False},
            {"bin_capacity": 2000.0, "sizes": s},
            {"mode": "interleaved"},
            {"inter": "greedy"},
        ):
            bucket, mbin = assign(c, k, 4, **kw)
            digest.update(bucket.tobytes())
            digest.update(mbin.tobytes())
    assert digest.hexdigest()[:16] == "dc282e5fd1a3ff83"


def test_partitioned_finite_sources_plan_the_golden_bytes_to_their_end():
    """Sources split into 1-3 streams, uneven weights, small chunks fed as a step asks,
    a finite job planned to its end (sources running out and redrawn elsewhere, the
    last step's leftovers): the selection, round robin and end paths at the Planner's
    size of hundreds of streams. Digest taken before the vectorized buffer paths."""
    parts = [1, 2, 3, 1, 2, 1, 3, 1] * 6
    streams, stream_source = [], []
    for src, k in enumerate(parts):
        streams += [f"s{src}.{p}" for p in range(k)]
        stream_source += [src] * k
    rng = np.random.default_rng(11)
    core = PlannerCore(
        streams=streams,
        stream_source=stream_source,
        tree=ClientPlaceTree(Mesh(dp=8)),
        weights=[1.0 / (1 + i % 7) for i in range(len(parts))],
        seed=5,
        global_batch=256,
        micro_batches=2,
        finite=True,
        strategy=strategies.balanced,
    )
    sizes = rng.integers(40, 400, len(streams))  # samples each stream has in all
    fed = np.zeros(len(streams), dtype=np.int64)

    def feed(i: int, n: int) -> None:
        n = int(min(n, sizes[i] - fed[i]))
        tokens, patches = _metadata(rng, n)
        core.add(
            i, MetaChunk(0, np.arange(fed[i], fed[i] + n), tokens, patches, tokens * 4, final=fed[i] + n >= sizes[i])
        )
        fed[i] += n

    for i in range(len(streams)):
        feed(i, 16)
    digest, steps = hashlib.sha256(), 0
    while not core.done:
        plan = core.plan_step()
        if plan is None:
            for i, want in sorted(core.wanted.items()):
                feed(i, max(16, want - core.streams[i].count))
            continue
        digest.update(plan.encode())
        digest.update(repr(core.delta()).encode())
        steps += 1
    assert (steps, digest.hexdigest()[:16]) == (76, "199f39d5d87f2ae1")
