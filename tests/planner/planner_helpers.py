"""A small pure Planner core and loader reports for the controller tests (conftest.py
holds the Redis fixture; this module has a name no other test directory uses)."""

from __future__ import annotations

import numpy as np

from overlord.config import Mesh
from overlord.plan.core import PlannerCore
from overlord.plan.meta import MetaChunk
from overlord.plan.tree import ClientPlaceTree


def chunk(seqs, *, token: int = 0, final: bool = False) -> MetaChunk:
    """A loader's report of samples `seqs` of epoch 0 (10 tokens each)."""
    n = len(seqs)
    seq = np.asarray(list(seqs), dtype=np.int64)
    ended = [(0, int(seq[-1]) + 1)] if final and n else []
    return MetaChunk(0, seq, np.full(n, 10), np.zeros(n, int), np.full(n, 40), ended, final, token)


def small_core(streams: int = 2) -> PlannerCore:
    """A core over one stream per source (`s<i>.0`), 8 samples a step over 2 DP groups."""
    return PlannerCore(
        streams=[f"s{i}.0" for i in range(streams)],
        stream_source=list(range(streams)),
        weights=[1.0] * streams,
        seed=3,
        global_batch=8,
        micro_batches=2,
        finite=False,
        tree=ClientPlaceTree(Mesh(dp=2)),
    )
