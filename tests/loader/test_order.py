"""The source order is a pure, complete permutation with a bounded shuffle window."""

from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.loader.order import EpochOrder, RowGroups


def _order(counts, **kw):
    args = dict(seed=7, source="web", epoch=0, partition=0, partitions=1, shuffle_window=16)
    args.update(kw)
    return EpochOrder(RowGroups.from_counts(counts), **args)


def _keys(order):
    return [(r.file, r.row_in_file) for r in map(order.locate, range(len(order)))]


def test_same_inputs_same_order_and_different_epochs_differ():
    counts = [[10, 20, 5], [30, 7]]
    assert _keys(_order(counts)) == _keys(_order(counts))
    assert _keys(_order(counts)) != _keys(_order(counts, epoch=1))
    assert _keys(_order(counts)) != _keys(_order(counts, seed=8))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=5), min_size=1, max_size=4),
    partitions=st.integers(1, 4),
    window=st.integers(1, 50),
)
def test_partitions_cover_every_row_exactly_once(counts, partitions, window):
    seen = []
    for p in range(partitions):
        seen += _keys(_order(counts, partition=p, partitions=partitions, shuffle_window=window))
    expected = [(f, r) for f, groups in enumerate(counts) for r in range(sum(groups))]
    assert sorted(seen) == expected


def test_shuffle_stays_inside_its_window():
    order = _order([[8] * 10], shuffle_window=16)
    positions = [order.position(s) for s in range(len(order))]
    for s, pos in enumerate(positions):
        assert s // 16 == pos // 16
    assert positions != list(range(len(order)))  # and it does shuffle


def test_groups_for_window_lists_what_the_window_reads():
    order = _order([[5, 5, 5, 5]], shuffle_window=7)
    for k in range(-(-len(order) // 7)):
        need = {order.locate(s).rg for s in range(k * 7, min((k + 1) * 7, len(order)))}
        assert need <= set(order.groups_for_window(k))
