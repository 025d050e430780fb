"""The plan's binary encoding: what is encoded reads back the same, in ~7 bytes a sample,
and bytes that are not a plan of this version are refused with what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.errors import PlanError
from overlord.plan.step_plan import HEADER_BYTES, VERSION, Plan

BUCKETS = [
    [[(0, 0, 5), (1, 0, 7)], [(0, 0, 6)]],
    [[(1, 0, 8)], [(0, 1, 70_000), (2, 0, 1)]],
]


def plan(**kw) -> Plan:
    return Plan.from_lists(3, BUCKETS, **kw)


def test_a_plan_reads_back_as_written():
    p = plan(
        axis="CP",
        last=True,
        broadcast=("TP",),
        deferred=2,
        dropped=9,
        encoder=[[(1, 0, 7)], [], [(0, 1, 70_000)], []],
    )
    q = Plan.decode(p.encode())
    assert q == p and q.buckets == BUCKETS and q.encoder == [[(1, 0, 7)], [], [(0, 1, 70_000)], []]
    assert (q.step, q.axis, q.last, q.broadcast, q.deferred, q.dropped) == (3, "CP", True, ("TP",), 2, 9)
    assert q.micro_batch(1, 1) == [(0, 1, 70_000), (2, 0, 1)] and q.samples() == 6 and q.n_buckets == 2
    assert Plan.from_json(p.to_json()) == p


def test_a_plan_without_encoder_lists_or_samples():
    p = Plan.decode(plan().encode())
    assert p.encoder is None and p.encoder_rows(0).shape == (0, 3) and not p.last and p.broadcast == ()
    empty = Plan.from_lists(7, [[[], []], [[], []]], last=True, dropped=3)
    back = Plan.decode(empty.encode())
    assert back.samples() == 0 and back.buckets == [[[], []], [[], []]] and back.last and back.dropped == 3


def test_columns_take_the_narrowest_width():
    # 65,536 samples of 300 streams in epoch 0, seqs below 2**32: 2 + 1 + 4 bytes a sample
    rng = np.random.default_rng(0)
    n, cells = 65_536, 512 * 8
    items = np.stack([rng.integers(0, 300, n), np.zeros(n, np.int64), rng.integers(0, 1 << 31, n)], axis=1)
    bounds = np.linspace(0, n, cells + 1).astype(np.int64)
    p = Plan(step=0, items=items, bounds=bounds, micro_batches=8)
    raw = p.encode()
    assert len(raw) == HEADER_BYTES + 8 + 4 * cells + 7 * n
    back = Plan.decode(raw)
    assert np.array_equal(back.items, items) and np.array_equal(back.bounds, bounds)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 300), st.integers(0, 2**40)), max_size=4),
            min_size=2,
            max_size=2,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_plan_round_trips(buckets):
    p = Plan.from_lists(11, buckets)
    assert Plan.decode(p.encode()).buckets == buckets


def test_bytes_that_are_not_a_plan_of_this_version_are_refused():
    raw = plan().encode()
    with pytest.raises(PlanError, match="JSON, written by an Overlord older"):
        Plan.decode(plan().to_json())
    with pytest.raises(PlanError, match="not a plan"):
        Plan.decode(b"hello world, this is not a plan at all" * 3)
    newer = bytearray(raw)
    struct.pack_into("<H", newer, 4, VERSION + 1)
    with pytest.raises(PlanError, match=f"format version {VERSION + 1}; this Overlord reads version {VERSION}"):
        Plan.decode(bytes(newer))
    with pytest.raises(PlanError, match="disagrees with its header"):
        Plan.decode(raw[:-8])
    counts_at = HEADER_BYTES + 8  # the text "DP" takes 8 bytes
    bad = bytearray(raw)
    struct.pack_into("<I", bad, counts_at, 3)  # micro-batch (0, 0) claims 3 samples, not 2
    with pytest.raises(PlanError, match="counts 7 samples in its micro-batches .* but holds 6"):
        Plan.decode(bytes(bad))


def test_a_negative_row_is_a_bug_said_as_one():
    with pytest.raises(PlanError, match="negative"):
        Plan.from_lists(0, [[[(0, 0, -1)]]]).encode()


def test_a_plan_carries_the_streams_handed_to_another_loader_process():
    owners = np.asarray([[1, 0], [2, 3]], dtype=np.int64)
    p = plan(owners=owners)
    q = Plan.decode(p.encode())
    assert q == p and q.owners is not None and q.owners.tolist() == [[1, 0], [2, 3]]
    assert q.loader_of([1, 1, 0]) == [1, 0, 3]  # stream 0 where the layout put it
    assert Plan.decode(plan().encode()).loader_of([1, 1, 0]) == [1, 1, 0]  # no handoff: the layout
    assert Plan.from_json(p.to_json()) == p
    assert len(p.encode()) == len(plan().encode()) + 16  # 8 bytes a handoff
    with pytest.raises(PlanError, match="disagrees with its header .* 2 handoffs"):
        Plan.decode(p.encode()[:-8])
    with pytest.raises(PlanError, match="hands stream 2 to loader process 3, but the job has 2 streams"):
        q.loader_of([0, 0])
