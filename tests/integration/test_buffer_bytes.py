"""The read-buffer budget decides how far ahead a Source Loader reads, never which
sample goes where: the same job with very different byte budgets delivers the same bytes."""

from __future__ import annotations

import time

import pytest

from overlord import BatchSpec, Mesh
from overlord.store import Keys
from overlord.store.schema import is_loader_stats_field, json_records

pytestmark = pytest.mark.timeout(120)

JOB = dict(
    seed=23,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    buffer_samples=None,
)
BIG, TINY = 64 << 20, 4096


# two sidecars side by side: 8.2 s on 2 cores at load average 5-6 (26.6 s at 9-13), 12.4 s
# quiet: the slow tier, which CI runs too
@pytest.mark.slow
def test_two_byte_budgets_deliver_identical_bytes(cluster):
    # 64 MiB holds every stream's draw for the horizon; 4 KiB holds one sample at most, so
    # every step goes through the Planner's demand (a buffer that runs dry asks, never
    # stalls). The two jobs run side by side (their own names, Redis and rings).
    runs = {budget: cluster(buffer_bytes=budget, **JOB) for budget in (BIG, TINY)}
    for c in runs.values():
        c.start_sidecar()
    for c in runs.values():
        c.start_trainers(batches=16)
    big, small = (runs[b].results() for b in (BIG, TINY))
    budgets = {b: _budgets(c) for b, c in runs.items()}
    for c in runs.values():
        assert c.stop() == 0
    # the loaders applied the budgets (the bytes below being equal says nothing if they did not)
    assert max(budgets[TINY]) <= TINY < max(budgets[BIG]), budgets
    for r in range(2):
        assert small[r]["end"] == big[r]["end"] == "limit"
        assert len(big[r]["digests"]) == 16
        assert small[r]["keys"] == big[r]["keys"]
        assert small[r]["digests"] == big[r]["digests"]


def _budgets(c) -> list[int]:
    """Every stream's read-buffer budget as its loader published it (`stats`, once a second)."""
    r, keys = c.redis(), Keys(c.job.name)
    deadline = time.monotonic() + 10
    while True:
        records = [v for k, v in json_records(r.hgetall(keys.stats)).items() if is_loader_stats_field(k)]
        if records or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [s["budget_bytes"] for rec in records for s in rec["streams"].values()]
