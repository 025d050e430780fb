"""Resharded streams over real Parquet files: a new stream's first epoch is its run of
the remainder the retired streams had not delivered (overlord.runtime.reshard), so every
row is still read once an epoch, in an order any loader derives alike."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlord.config import Source
from overlord.errors import PlanError
from overlord.loader import formats
from overlord.loader.order import EpochOrder, Orders, RemainderOrder, RowGroups
from overlord.loader.source_loader import SourceLoader
from overlord.runtime.layout import stream_name
from overlord.runtime.reshard import Reshard, reshard_stream_name

WINDOW = 4  # smaller than any stream's epoch
# rows per file and row-group size: row groups of unequal sizes (5,5,5,5,3 / 4,4,1 / 6,6,2)
FILES = {"a": (23, 5), "b": (9, 4), "c": (14, 6)}
ROWS = sum(n for n, _ in FILES.values())


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    out = []
    for name, (n, size) in FILES.items():
        texts = [f"{name} {i} " + "w " * (i % 5) for i in range(n)]
        pq.write_table(pa.table({"id": list(range(n)), "text": texts}), d / f"{name}.parquet", row_group_size=size)
        out.append(str(d / f"{name}.parquet"))
    return out


def source(paths, partitions, **kw):
    return Source(name="web", paths=tuple(paths), shuffle_window=WINDOW, partitions=partitions, **kw)


def record(generation, parents, deferred, partitions, epoch=None):
    return Reshard(
        generation=generation,
        source="web",
        source_index=0,
        step=10 * generation,
        epoch=max(e for _, e, _ in parents) if epoch is None else epoch,
        parents=tuple(parents),
        deferred=tuple(deferred),
        streams=tuple(reshard_stream_name("web", generation, q) for q in range(partitions)),
        homes=(0,) * partitions,
    )


def read(src, partition, *, epochs, stream=None, reshards=()):
    """Every sample the stream reads through `epochs`, by (epoch, seq), and the epochs'
    ends as prepare reported them."""
    ld = SourceLoader(src, partition, seed=5, epochs=epochs, stream=stream, reshards=reshards)
    out, ended = {}, []
    while not ld.finished:
        got, done = ld.prepare(7)
        out.update({(s.epoch, s.seq): s for s in got})
        ended += done
        assert len(out) < 10 * ROWS
    ld.close()
    return out, ended


_BASE: dict[int, dict[str, dict]] = {}


def base_streams(paths, partitions):
    """The samples of every base stream of `partitions`, epochs 0..2 (cached: a pure function)."""
    if partitions not in _BASE:
        src = source(paths, partitions)
        _BASE[partitions] = {stream_name("web", p): read(src, p, epochs=3)[0] for p in range(partitions)}
    return _BASE[partitions]


def new_streams(paths, partitions, reshards, epochs, **kw):
    src = source(paths, partitions, **kw)
    last = reshards[-1]
    return {name: read(src, q, epochs=epochs, stream=name, reshards=reshards)[0] for q, name in enumerate(last.streams)}


def epoch_of(samples, epoch):
    """The samples of one epoch, in seq order; their seqs are 0..n-1."""
    got = sorted((seq, s) for (e, seq), s in samples.items() if e == epoch)
    assert [seq for seq, _ in got] == list(range(len(got)))
    return [s for _, s in got]


def remainder(streams, rec):
    """The record's remainder, straight from the spec: (parent, epoch, seq) in order."""

    def length(name, epoch):
        return sum(e == epoch for e, _ in streams[name])

    out = list(rec.deferred)
    for name, e_p, s_p in rec.parents:
        out += [(name, e_p, s) for s in range(s_p + 1, length(name, e_p))]
        for e in range(e_p + 1, rec.epoch + 1):
            out += [(name, e, s) for s in range(length(name, e))]
    return out


def delivered(streams, rec):
    """Keys the retired streams delivered: through their cursors, less the deferred."""
    deferred = set(rec.deferred)
    return [
        s.key
        for name, e_p, s_p in rec.parents
        for (e, seq), s in streams[name].items()
        if (e, seq) <= (e_p, s_p) and (name, e, seq) not in deferred
    ]


def check_remainder(parents, rec, new):
    """Stream q's first epoch is run q of the spec's remainder: those samples, key and
    bytes, read where each parent's order puts them."""
    spec = remainder(parents, rec)
    total = len(spec)
    for q, name in enumerate(rec.streams):
        run = spec[q * total // rec.partitions : (q + 1) * total // rec.partitions]
        got = epoch_of(new[name], rec.epoch)
        want = [parents[p][(e, s)] for p, e, s in run]
        assert [s.key for s in got] == [s.key for s in want], f"stream {name}"
        for a, b in zip(got, want):
            assert a.epoch == rec.epoch and np.array_equal(a.arrays["input_ids"], b.arrays["input_ids"])


def every_row(times):
    return {f"web:{f}:{r}": times for f, (n, _) in enumerate(FILES.values()) for r in range(n)}


@st.composite
def cursors(draw, streams, epochs):
    """A cursor per stream, at one of `epochs` (seq -1 .. its last), and deferred samples
    behind them, in a drawn order."""
    parents, behind = [], []
    for name, samples in streams.items():
        epoch = draw(st.sampled_from(epochs))
        n = sum(e == epoch for e, _ in samples)
        seq = draw(st.sampled_from(sorted({-1, n - 1, draw(st.integers(-1, n - 1))})))
        parents.append((name, epoch, seq))
        behind += [(name, e, s) for (e, s) in samples if (e, s) <= (epoch, seq)]
    deferred = draw(st.lists(st.sampled_from(behind), unique=True, max_size=6)) if behind else []
    return parents, deferred


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), partitions=st.integers(1, 4), new=st.integers(1, 5))
def test_a_reshard_reads_every_row_exactly_once(paths, data, partitions, new):
    base = base_streams(paths, partitions)
    parents, deferred = data.draw(cursors(base, [0, 1]))
    rec = record(1, parents, deferred, new)
    streams = new_streams(paths, partitions, [rec], epochs=rec.epoch + 2)
    check_remainder(base, rec, streams)
    # the deferred samples are the remainder's first: read by a new stream, not a retired one
    first = [s.key for name in rec.streams for s in epoch_of(streams[name], rec.epoch)]
    assert collections.Counter(delivered(base, rec) + first) == every_row(rec.epoch + 1)
    after = [s.key for name in rec.streams for s in epoch_of(streams[name], rec.epoch + 1)]
    assert collections.Counter(after) == every_row(1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), partitions=st.integers(1, 3), middle=st.integers(1, 4), new=st.integers(1, 4))
def test_a_second_reshard_of_resharded_streams_reads_every_row_exactly_once(paths, data, partitions, middle, new):
    base = base_streams(paths, partitions)
    parents, deferred = data.draw(cursors(base, [0, 1]))
    first = record(1, parents, deferred, middle)
    e1 = first.epoch
    mid = new_streams(paths, partitions, [first], epochs=e1 + 2)
    parents2, deferred2 = data.draw(cursors(mid, [e1, e1 + 1]))
    second = record(2, parents2, deferred2, new)
    e2 = second.epoch
    streams = new_streams(paths, partitions, [first, second], epochs=e2 + 2)
    check_remainder(base, first, mid)
    check_remainder(mid, second, streams)
    planned = delivered(base, first) + delivered(mid, second)
    planned += [s.key for name in second.streams for s in epoch_of(streams[name], e2)]
    assert collections.Counter(planned) == every_row(e2 + 1)
    after = [s.key for name in second.streams for s in epoch_of(streams[name], e2 + 1)]
    assert collections.Counter(after) == every_row(1)


def _fixed_record(paths):
    """P=3 to P'=2 at epoch 1: one parent behind at epoch 0, one at its last seq, one mid-epoch."""
    lengths = {name: sum(e == 0 for e, _ in s) for name, s in base_streams(paths, 3).items()}
    parents = [("web.0", 0, 5), ("web.1", 1, lengths["web.1"] - 1), ("web.2", 1, 3)]
    return record(1, parents, [("web.2", 1, 1), ("web.0", 0, 2), ("web.1", 1, 0)], 2)


def test_a_new_stream_is_the_same_from_any_loader_and_from_any_cursor(paths):
    rec = _fixed_record(paths)
    src = source(paths, 3)
    one, _ = read(src, 0, epochs=3, stream=rec.streams[0], reshards=[rec])
    two, _ = read(src, 0, epochs=3, stream=rec.streams[0], reshards=[rec])
    assert [(k, s.key, s.arrays["input_ids"].tobytes()) for k, s in one.items()] == [
        (k, s.key, s.arrays["input_ids"].tobytes()) for k, s in two.items()
    ]
    length = len(epoch_of(one, 1))
    assert length > 10 and min(one) == (1, 0)  # it starts at the record's epoch
    ld = SourceLoader(src, 0, seed=5, epochs=3, stream=rec.streams[0], reshards=[rec])
    assert (ld.epoch, ld.seq) == (1, 0)
    cursor = length // 2 + 1  # mid-remainder, mid-window
    ld.start_at(1, cursor)
    resumed = {}
    while not ld.finished:
        resumed.update({(s.epoch, s.seq): s for s in ld.prepare(5)[0]})
    assert [(k, s.key) for k, s in resumed.items()] == [(k, s.key) for k, s in one.items() if k >= (1, cursor)]
    for epoch, seqs in ((1, [cursor - 1, 0, 3, 7]), (2, [4, 0])):  # deferred samples, behind the cursor
        again = ld.prepare_at(epoch, seqs)
        assert [(s.epoch, s.seq) for s in again] == [(epoch, q) for q in seqs]
        for s in again:
            ref = one[(epoch, s.seq)]
            assert s.key == ref.key and np.array_equal(s.arrays["input_ids"], ref.arrays["input_ids"])
    # after the remainder: plain partition 0 of 2
    order = EpochOrder(ld.groups, seed=5, source="web", epoch=2, partition=0, partitions=2, shuffle_window=WINDOW)
    rows = [order.locate(q) for q in range(len(order))]
    assert [s.key for s in epoch_of(one, 2)] == [f"web:{r.file}:{r.row_in_file}" for r in rows]
    with pytest.raises(PlanError, match=r"'web.r1p0'.* starts at epoch 1: it never reads epoch 0"):
        ld.start_at(0, 4)
    with pytest.raises(PlanError, match="starts at epoch 1"):
        ld.prepare_at(0, [0])


def test_new_streams_with_nothing_left_end_their_first_epoch_empty(paths):
    base = base_streams(paths, 2)
    lengths = {name: sum(e == 0 for e, _ in s) for name, s in base.items()}
    # two samples left (one deferred, web.0's last) for five new streams
    rec = record(1, [("web.0", 0, lengths["web.0"] - 2), ("web.1", 0, lengths["web.1"] - 1)], [("web.1", 0, 3)], 5)
    src = source(paths, 2)
    firsts, keys = [], []
    for q, name in enumerate(rec.streams):
        got, ended = read(src, q, epochs=1, stream=name, reshards=[rec])  # finite: the remainder is the last
        firsts.append(len(got))
        keys += [s.key for s in got.values()]
        assert ended == [(0, len(got))]
    assert firsts == [0, 0, 1, 0, 1]  # cut at q * 2 // 5
    assert sorted(keys) == sorted([base["web.1"][(0, 3)].key, base["web.0"][(0, lengths["web.0"] - 1)].key])
    # and a later epoch follows an empty one
    got, ended = read(src, 0, epochs=2, stream=rec.streams[0], reshards=[rec])
    assert ended == [(0, 0), (1, len(got))] and len(got) > 0


def test_a_bad_row_in_a_remainder_is_skipped_and_counted(tmp_path):
    texts = [f"t{i} " * (i % 3 + 1) for i in range(30)]
    bad = (2, 13, 21, 29)
    for r in bad:
        texts[r] = None
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=7)
    src = source([str(path)], 2, on_error="skip")
    rec = record(1, [("web.0", 0, -1), ("web.1", 0, -1)], [], 3)  # the remainder is all of epoch 0
    keys, skipped = [], 0
    for q, name in enumerate(rec.streams):
        ld = SourceLoader(src, q, seed=5, epochs=1, stream=name, reshards=[rec])
        while not ld.finished:
            keys += [s.key for s in ld.prepare(4)[0]]
        skipped += ld.skipped
    assert skipped == len(bad)
    assert sorted(keys) == sorted(f"web:0:{r}" for r in range(30) if r not in bad)
    # one sample per new stream: the one whose only sample is bad ends its run with none,
    # no error (a run of a remainder is not a whole epoch, which could never yield)
    src = source([str(path)], 1, on_error="skip")
    ld = SourceLoader(src, 0, seed=5, epochs=1)
    rows = [ld._order.locate(q).row_in_file for q in range(30)]
    last = max(q for q in range(30) if rows[q] in bad)
    rec = record(1, [("web.0", 0, last - 1)], [], 30 - last)
    for q, name in enumerate(rec.streams):
        got, ended = read(src, q, epochs=1, stream=name, reshards=[rec])
        assert [s.key for s in got.values()] == ([] if rows[last + q] in bad else [f"web:0:{rows[last + q]}"])
        assert ended == [(0, len(got))]


def test_a_remainder_reads_a_parent_window_once_as_the_parent_would(paths, monkeypatch):
    calls = []
    real = formats.ParquetFile.read_group

    def counting(self, group, columns):
        calls.append(group)
        return real(self, group, columns)

    monkeypatch.setattr(formats.ParquetFile, "read_group", counting)
    src = source(paths, 1)
    rec = record(1, [("web.0", 0, 5)], [], 1)  # web.r1p0 epoch 0 is web.0's seqs 6..
    got, _ = read(src, 0, epochs=1, stream=rec.streams[0], reshards=[rec])
    by_remainder = len(calls)
    calls.clear()
    parent = SourceLoader(src, 0, seed=5, epochs=1)
    parent.start_at(0, 6)
    while not parent.finished:
        parent.prepare(7)
    order = EpochOrder(parent.groups, seed=5, source="web", epoch=0, partition=0, partitions=1, shuffle_window=WINDOW)
    pairs = {(q // WINDOW, order.locate(q).rg) for q in range(6, ROWS)}  # (window, row group) pairs read
    assert len(got) == ROWS - 6 and by_remainder == len(calls) == len(pairs)


def test_records_that_do_not_fit_the_source_are_refused():
    groups = RowGroups.from_counts([[5, 5, 3], [4]])
    args = dict(seed=1, source="web", partitions=2, shuffle_window=WINDOW)
    orphan = record(1, [("web.7", 0, 1)], [], 2)
    with pytest.raises(PlanError, match="retires stream 'web.7', which neither"):
        Orders(groups, **args, reshards=[orphan])
    with pytest.raises(PlanError, match="given for source 'books'"):
        Orders(groups, **{**args, "source": "books"}, reshards=[record(1, [("web.0", 0, 1)], [], 2)])
    late = Orders(groups, **args, reshards=[record(1, [("web.0", 0, 99), ("web.1", 0, -1)], [], 2)])
    with pytest.raises(PlanError, match=r"cursor at \(0, 99\)"):
        late.order("web.r1p0", 0)
    rec = record(1, [("web.0", 1, 2), ("web.1", 0, -1)], [("web.0", 0, 0)], 3)
    orders = Orders(groups, **args, reshards=[rec])
    assert orders.first_epoch("web.0") == 0 and orders.first_epoch("web.r1p2") == 1
    assert isinstance(orders.order("web.r1p2", 1), RemainderOrder)
    assert isinstance(orders.order("web.r1p2", 2), EpochOrder)
    # web.0: row groups 0 and 2 (8 rows), web.1: 1 and 3 (9 rows); the remainder: one
    # deferred sample, web.0's seqs 3..7 of epoch 1, web.1's epochs 0 and 1 whole
    assert [len(orders.order(f"web.r1p{q}", 1)) for q in range(3)] == [8, 8, 8]
    assert orders.remainder_length(rec) == 1 + 5 + 2 * 9
    with pytest.raises(PlanError, match="'web.r2p0' is none of source 'web'"):
        orders.order("web.r2p0", 1)
