"""A shortage wakes the Source Loaders: the Planner's demand reaches a loader blocked on
the plans stream at once (its `demanded` entry), not when the loader's idle wait ends."""

from __future__ import annotations

import pytest

from overlord import BatchSpec, Mesh
from overlord.loader.refill import IDLE_ENV
from overlord.store import Keys
from overlord.store.schema import demanded_values

pytestmark = pytest.mark.timeout(120)

IDLE_MS = 5000  # the loaders' idle block here (below the Redis socket timeout, 10 s; a stop waits for it)
TURN = 6  # the step the mixing turns to images
BATCHES = 2 * (TURN + 6)  # two micro-batches a step


# 9.4-11.7 s on 2 cores at load average 4-5, of which ~5 s is the stop waiting out the loaders'
# idle block; the longest wait between two batches 0.03-0.09 s (without the wake: 5.1 s, three runs)
@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_shortage_is_served_long_before_the_idle_block_ends(cluster, monkeypatch, corpus_keys):
    # At step TURN the mixing turns from text to images: the images stream's buffer (it
    # held what the steps before drew, a sample or two) is short by far. The Planner asks
    # right after publishing the step before, and every loader, woken by that plan, has
    # served it and sits in its idle block. Without the wake the images loader hears the
    # demand when that block runs out, and the trainer waits as long.
    monkeypatch.setenv(IDLE_ENV, str(IDLE_MS))  # the sidecar and the loaders it forks inherit it
    text = {"web": 1.0, "code": 1.0, "books": 1.0, "images": 0.05}
    images = {"web": 0.05, "code": 0.05, "books": 0.05, "images": 1.0}
    c = cluster(
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
        mixing={"kind": "piecewise", "points": [[0, text], [TURN, images]]},
        buffer_samples=None,
        buffer_bytes=4096,  # one sample at most: a stream holds what the Planner asked for, no more
    )
    c.start_sidecar()
    c.start_trainers(batches=BATCHES, timeout=30)
    (record,) = c.results().values()
    r, keys = c.redis(), Keys(c.job.name)
    asks = [demanded_values(fields) for _, fields in r.xrange(keys.demanded)]
    assert c.stop() == 0
    assert record["end"] == "limit" and len(record["keys"]) == BATCHES, c.log()
    delivered = [k for batch in record["keys"] for k in batch]
    assert len(set(delivered)) == len(delivered) and set(delivered) <= corpus_keys
    assert max(a.get("images.0", 0) for a in asks) > 16, asks  # the turn was a shortage
    gaps = [b - a for a, b in zip(record["times"], record["times"][1:])]
    assert max(gaps) < IDLE_MS / 4 / 1e3, (
        f"a batch waited {max(gaps):.2f}s; the loaders' idle block is {IDLE_MS / 1e3:g}s: the Planner's demand "
        f"waited for it (asks: {asks})\n{c.log()}"
    )
