"""A Data Constructor packs samples from the loader rings in place (one copy on the
node): under ring pressure it copies what it holds instead of deadlocking or letting
the loader overwrite it, and the trainers get the same bytes either way."""

from __future__ import annotations

import pytest

from overlord.config import BatchSpec
from overlord.store import Keys
from overlord.store.schema import copied_field

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # make test-slow (CI runs it): two jobs, about 35 s


def _run(cluster, ring_bytes: int) -> tuple[dict, int]:
    # 32 samples per DP group a step: more than a 64 KiB ring holds
    batch = BatchSpec(global_batch=128, micro_batches=2, context_length=512, ring_bytes=4 << 20)
    c = cluster(seed=23, sample_ring_bytes=ring_bytes, batch=batch)
    c.start_sidecar()
    c.start_trainers(batches=20)
    results = c.results()
    assert {r["end"] for r in results.values()} == {"limit"}, c.log()
    counters = c.redis().hgetall(Keys(c.job.name).counters)
    copied = sum(int(counters.get(copied_field(dp).encode(), 0)) for dp in range(c.job.mesh.dp))
    assert c.stop() == 0
    return results, copied


def test_samples_held_past_a_small_ring_are_copied_never_overwritten(cluster):
    roomy, roomy_copied = _run(cluster, 8 << 20)
    tight, tight_copied = _run(cluster, 64 << 10)
    # the 64 KiB rings cannot hold what the constructors keep (a step's samples and
    # the later steps' kept aside): the leases were copied out, and counted
    assert tight_copied > 0
    assert roomy_copied == 0
    for rank in roomy:
        assert tight[rank]["keys"] == roomy[rank]["keys"]
        assert tight[rank]["digests"] == roomy[rank]["digests"]
