"""What the Planner asks a stream to hold when a step needs more of a source than its
streams reported: more than the stream holds, or its loader never reads on."""

from __future__ import annotations

import numpy as np
import pytest

from overlord.plan.buffer import ITEM, Buffer, NeedMetadata, join_items
from overlord.plan.meta import MetaChunk


def chunk(seqs, final: bool = False) -> MetaChunk:
    n = len(seqs)
    seq = np.asarray(list(seqs), dtype=np.int64)
    return MetaChunk(0, seq, np.full(n, 10), np.zeros(n, int), np.full(n, 40), [(0, n)] if final else [], final)


def test_a_stream_left_alone_in_its_source_is_asked_for_the_rest_of_the_draw():
    # the last steps of a finite job: s.0 ran out (final), s.1 holds 20 and is not final.
    # A draw of 30 takes 5 + 20 and needs 5 more of s.1: asking s.1 for its round-robin
    # share (15) asked for less than it holds, so its loader never read on and never
    # reported it final, and the Planner waited for ever (found by bench/handoff.py)
    buf = Buffer(["s.0", "s.1"], [0, 0], 1, finite=True)
    buf.add(0, chunk(range(5), final=True))
    buf.add(1, chunk(range(20)))
    with pytest.raises(NeedMetadata) as need:
        buf.select(np.asarray([30]), [0])
    assert need.value.wanted[1] == 25 > buf.streams[1].count  # what it gave and the 5 more
    buf.add(1, chunk(range(20, 30)))  # the loader read on: the draw goes through
    items, take, _ = buf.select(np.asarray([30]), [0])
    assert take == {0: 5, 1: 25} and len(items) == 30


def test_the_end_of_a_finite_source_asks_its_open_stream_for_more_than_it_holds():
    # three streams ran out (final); the fourth holds 27 and is not final; a step needs 37
    buf = Buffer(["i.0", "i.1", "i.2", "i.3"], [0, 0, 0, 0], 1, finite=True)
    buf.add(0, chunk(range(27)))
    for k in (1, 2, 3):
        buf.add(k, chunk([], final=True))
    wanted = buf.wanted(0, 37)
    assert wanted[0] == 37 > buf.streams[0].count  # was 10, the even share: the loader held 27 and waited
    assert buf.wanted(0, 20) == {0: 5, 1: 5, 2: 5, 3: 5}  # held enough: the even share


def test_open_streams_share_what_the_final_ones_cannot_give_and_nothing_more():
    # s.0 holds 30 and s.1 none yet (both open), s.2 ran out: a step needs 40 of the source
    buf = Buffer(["s.0", "s.1", "s.2"], [0, 0, 0], 1, finite=True)
    buf.add(0, chunk(range(30)))
    buf.add(2, chunk([], final=True))
    wanted = buf.wanted(0, 40)
    assert wanted[0] == wanted[1] == 20  # what the open two must supply between them
    assert wanted[1] > buf.streams[1].count  # the one short of it reads on
    # and with every stream open, the even share, as before the end of the source
    open_ = Buffer(["s.0", "s.1"], [0, 0], 1, finite=False)
    open_.add(0, chunk(range(30)))
    assert open_.wanted(0, 40) == {0: 20, 1: 20}


def test_round_robin_blocking_on_an_open_stream_asks_it_for_more_than_it_holds_with_the_source_not_short():
    # A (open) holds 5, B ran out after 1, C (open) holds 20; a step needs 12: the source holds
    # 26, yet the round robin takes 5 of A by the 10th draw and needs a sixth. The even share
    # (4) is less than A holds, so only the draw's own ask makes A's loader read on
    buf = Buffer(["A", "B", "C"], [0, 0, 0], 1, finite=True)
    buf.add(0, chunk(range(5)))
    buf.add(1, chunk(range(1), final=True))
    buf.add(2, chunk(range(20)))
    assert buf.wanted(0, 12)[0] == 4 <= buf.streams[0].count  # the source is not short in total
    with pytest.raises(NeedMetadata) as need:
        buf.select(np.asarray([12]), [0])
    assert need.value.wanted[0] == 6 > buf.streams[0].count
    buf.add(0, chunk(range(5, 10)))  # A's loader read on
    _, take, _ = buf.select(np.asarray([12]), [0])
    assert take == {0: 6, 1: 1, 2: 5}


def test_join_items_is_concatenate_for_item_rows_and_refuses_other_arrays():
    # the Planner joins the heads of hundreds of streams each step (join_items: their
    # bytes end to end): the same rows, fields and order as np.concatenate, for views,
    # strided parts, copies and empty parts; any other dtype or shape is refused, never
    # read as ITEM bytes
    rng = np.random.default_rng(3)
    base = np.zeros(40, dtype=ITEM)
    for name in ITEM.names:
        base[name] = rng.integers(-(2**31), 2**31 - 1, 40)
    ro = base[5:9]
    ro.flags.writeable = False
    parts = [base[:3], ro, base[10:30:3], base[:0], base[30:].copy(), base[39:40]]
    joined = join_items(parts)
    assert joined.dtype == ITEM and joined.flags.writeable
    assert joined.tobytes() == np.concatenate(parts).tobytes()
    assert len(join_items([])) == 0 and join_items([]).dtype == ITEM
    aligned = np.dtype(ITEM.descr, align=True)  # the same fields, padded: other bytes
    with pytest.raises(TypeError, match="ITEM rows"):
        join_items([base[:2], base[:2].astype(aligned)])
    with pytest.raises(TypeError, match="ITEM rows"):
        join_items([base[:4].reshape(2, 2)])


def test_the_one_pass_views_of_the_buffer_agree_with_the_stream_by_stream_ones():
    """remaining_all is each source's streams summed one by one; heads is the streams' peeks joined,
    also for streams whose draw spans chunks; consume leaves each cursor on the last item
    taken. Random buffers of 1-3 streams a source, some final, chunks of 1-9 items."""
    rng = np.random.default_rng(3)
    for trial in range(30):
        parts = rng.integers(1, 4, 12)
        stream_source = [src for src, k in enumerate(parts) for _ in range(k)]
        buf = Buffer([f"s{i}" for i in range(len(stream_source))], stream_source, len(parts), finite=True)
        fed = [0] * len(stream_source)
        for _ in range(40):
            i = int(rng.integers(len(stream_source)))
            n = int(rng.integers(1, 10))
            buf.add(i, chunk(range(fed[i], fed[i] + n), final=bool(rng.random() < 0.1)))
            fed[i] += n
        have, complete = buf.remaining_all()
        for src in range(len(parts)):
            ids = buf.by_source[src]
            alone = sum(buf.streams[i].count for i in ids), all(buf.streams[i].final for i in ids)
            assert (int(have[src]), bool(complete[src])) == alone, (trial, src)
        take = {
            i: int(rng.integers(1, s.count + 1)) for i, s in enumerate(buf.streams) if s.count and rng.random() < 0.7
        }
        expected = join_items([buf.streams[i].peek(n) for i, n in sorted(take.items())])
        assert buf.heads(take).tobytes() == expected.tobytes()
        last = {i: tuple(int(x) for x in buf.streams[i].peek(n)[-1][["epoch", "seq"]]) for i, n in take.items()}
        buf.commit(take)
        assert {i: buf.streams[i].cursor for i in take} == last


def test_heads_of_the_last_select_are_what_it_selected_even_if_its_items_were_changed():
    """The exactly-once check compares a plan with `heads(take)`: kept from the select
    that made the take, it must not follow a strategy that changes the items it got."""
    buf = Buffer(["a.0", "a.1", "b.0"], [0, 0, 1], 2, finite=False)
    for i in range(3):
        buf.add(i, chunk(range(10)))
    items, take, _ = buf.select(np.array([5, 3]), [0, 0])
    before = items.tobytes()
    items["seq"] += 1000  # a strategy working on the array it was given
    assert buf.heads(take).tobytes() == before
    assert buf.heads({0: 1}).tobytes() == buf.streams[0].peek(1).tobytes()  # another take: read afresh
    buf.add(2, chunk(range(10, 12)))
    assert buf.heads(take).tobytes() == before  # read afresh after a report: the same heads
