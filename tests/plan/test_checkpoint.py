"""Differential checkpoints: deltas rebuild the full state, and a core restored from
them (fed everything again, as re-reporting loaders do) plans what the original did."""

from __future__ import annotations

import numpy as np
from test_core import make

from overlord.plan.checkpoint import apply
from overlord.plan.meta import MetaChunk


def _capped(data, tree):  # capacity makes the state carry deferred samples
    from overlord.plan.dgraph import DGraph

    g = DGraph(data, tree, view="tokens").mix().distribute("DP").cost("attention")
    return g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra", capacity=160).plan()


def _feed(core, tokens, start=0):
    for i, t in enumerate(tokens):
        seqs = np.arange(start, len(t))
        core.add(i, MetaChunk(0, seqs, t[seqs], np.zeros(len(seqs), int), t[seqs]))
    return core


def test_deltas_rebuild_every_state_and_a_reported_again_buffer_plans_the_same():
    rng = np.random.default_rng(4)
    tokens = [rng.integers(5, 150, 400), rng.integers(5, 60, 400)]
    original = _feed(make(strategy=_capped, global_batch=16, dp=2, micro_batches=2), tokens)
    state = original.state()
    plans, states = [], []
    for _ in range(12):
        states.append(original.state())
        plans.append(original.plan_step().to_json())
        state = apply(state, original.delta())
        assert state == original.state()
    assert any(s["deferred"] for s in states), "the test needs deferred samples in a checkpoint"
    for s in (3, 7):
        resumed = make(strategy=_capped, global_batch=16, dp=2, micro_batches=2)
        resumed.restore(states[s])
        _feed(resumed, tokens)  # everything again: what is behind the cursors is dropped
        assert [resumed.plan_step().to_json() for _ in range(12 - s)] == plans[s:]


def test_a_chunk_reported_twice_counts_once():
    core = make(weights=(1.0,), global_batch=8)
    t = np.arange(1, 41)
    _feed(core, [t])
    _feed(core, [t], start=10)
    assert core.streams[0].count == 40
