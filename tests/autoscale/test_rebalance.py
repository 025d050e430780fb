"""Which stream to hand to which loader process when one process demands more than the
others (the Planner makes the handoff at the next step boundary)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.autoscale.rebalance import Rebalancer, best_handoff


def anywhere(stream: int, to: int) -> bool:
    return True


def test_the_handoff_that_lowers_the_busiest_process_most():
    # process 0 serves three partitions of a source that became costly; 1 and 2 idle
    demand = [1.0, 1.0, 1.0, 0.1, 0.1]
    serving = [0, 0, 0, 1, 2]
    stream, to = best_handoff(demand, serving, 3, anywhere, min_gain=0.25)
    assert serving[stream] == 0 and to in (1, 2)


def test_no_handoff_when_none_lowers_the_peak_enough():
    # one stream is the whole load: moving it moves the peak, it does not lower it
    assert best_handoff([2.0, 0.1], [0, 1], 2, anywhere, min_gain=0.25) is None
    assert best_handoff([1.0, 1.0], [0, 1], 2, anywhere, min_gain=0.25) is None  # balanced


def test_a_handoff_the_caller_forbids_is_not_chosen():
    demand, serving = [1.0, 1.0, 0.0], [0, 0, 1]
    assert best_handoff(demand, serving, 3, lambda s, to: to != 1, min_gain=0.25)[1] == 2
    assert best_handoff(demand, serving, 3, lambda s, to: False, min_gain=0.25) is None


def test_the_rebalancer_waits_for_a_lasting_imbalance_and_rests_a_moved_stream():
    rb = Rebalancer(loaders=2, patience=2, rest=2)
    demand, serving = [1.0, 1.0, 1.0, 0.0], [0, 0, 0, 1]
    assert rb.look(demand, serving, anywhere) is None  # once is not yet lasting
    stream, to = rb.look(demand, serving, anywhere)
    assert (serving[stream], to) == (0, 1)
    serving[stream] = to
    assert rb.look(demand, serving, anywhere) is None  # 2 against 1: lasting again only at the next look
    move = rb.look(demand, serving, anywhere)
    assert move is None or move[0] != stream  # the moved stream rests
    assert rb.look([0.5, 0.5, 0.5, 0.5], [0, 0, 1, 1], anywhere) is None  # balanced: nothing


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 4), min_size=2, max_size=24),
    st.integers(2, 6),
    st.randoms(use_true_random=False),
)
def test_a_handoff_always_lowers_the_peak_by_the_minimum_gain(demand, loaders, rnd):
    serving = [rnd.randrange(loaders) for _ in demand]
    move = best_handoff(demand, serving, loaders, anywhere, min_gain=0.25)
    load = [sum(d for d, k in zip(demand, serving) if k == p) for p in range(loaders)]
    if move is None:
        return
    stream, to = move
    after = list(serving)
    after[stream] = to
    moved = [sum(d for d, k in zip(demand, after) if k == p) for p in range(loaders)]
    assert to != serving[stream] and max(moved) <= max(load) - 0.25 + 1e-9
