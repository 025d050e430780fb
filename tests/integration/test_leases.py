"""A trainer that holds batches while it asks for more (Lightning's prefetch, a logger, an
accumulation list) still sees every batch's bytes as they arrived: batches lease their
ring record until their tensors die, and a trainer that holds more than the ring can
lease gets copies. A real sidecar, embedded Redis and ring; small rings so they wrap."""

from __future__ import annotations

import pytest

from overlord import BatchSpec, Mesh
from overlord.torch import DataLoader, batch_digest

pytestmark = pytest.mark.timeout(180)

STEPS = 80


def run(job, hold: int, keep_first: bool = False):
    """Read STEPS micro-batches, holding the last `hold` (and the first, if asked), and
    check each held batch against the digest taken when it arrived."""
    loader = DataLoader(job, rank=0, world_size=1, spawn_sidecar=False)
    held, seen, changed = [], [], []
    first = None
    for i, batch in enumerate(loader):
        seen.append(batch_digest(batch))
        if keep_first and first is None:
            first = batch
        held.append((i, batch))
        if len(held) > hold:
            j, old = held.pop(0)
            if batch_digest(old) != seen[j]:
                changed.append(j)
        if i + 1 == STEPS:
            break
    changed += [j for j, b in held if batch_digest(b) != seen[j]]
    if first is not None and batch_digest(first) != seen[0]:
        changed.append(0)
    copies = loader.copies
    loader.close()
    return seen, changed, copies


@pytest.mark.parametrize("ring_kib", [256, 1024])
def test_held_batches_keep_their_bytes(cluster, ring_kib):
    spec = dict(
        seed=3,
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=1024, ring_bytes=ring_kib << 10),
    )
    c = cluster(**spec)
    c.start_sidecar()
    reference, _, _ = run(c.job, hold=0)
    assert c.stop() == 0
    c2 = cluster(**spec)
    c2.start_sidecar()
    seen, changed, copies = run(c2.job, hold=3, keep_first=True)
    assert c2.stop() == 0
    assert changed == [], f"batches {changed} changed under the trainer"
    assert seen == reference, "holding batches must not change which bytes arrive"
    if ring_kib == 256:
        assert copies > 0, "the first batch held for the whole run pins a 256 KiB ring: copies expected"
