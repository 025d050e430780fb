"""Auto-partitioning at start: profiled costs size the Source Loaders, the choice is
stored, the profile journal outlives the run, and every sample still arrives once."""

from __future__ import annotations

import json

import pytest

from overlord import BatchSpec, Mesh
from overlord.autoscale.profile import journaled
from overlord.runtime.layout import Layout
from overlord.store import EmbeddedRedis, Keys, connect

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # make test-slow

JOB = dict(
    seed=4,
    epochs=1,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    autoscale={"cpus": 6, "memory_mb": 8000, "profile_samples": 16, "cluster_size": 1},
)


def test_costly_source_gets_more_loader_partitions_and_every_sample_arrives_once(cluster, corpus, corpus_keys):
    from dataclasses import replace

    from harness import make_job

    # books decodes slowly (50 ms a sample): 500x the other text sources
    sources = tuple(
        replace(s, transform="tests.integration.strategies:slow_text") if s.name == "books" else s
        for s in make_job(corpus, "/tmp/unused").sources
    )
    c = cluster(**JOB, sources=sources)
    c.start_sidecar()
    c.start_trainers()
    out = c.results()
    assert all(rec["end"] == "stop" for rec in out.values()), {r: rec["end"] for r, rec in out.items()}
    seen = [k for rec in out.values() for batch in rec["keys"] for k in batch]
    assert len(seen) == len(set(seen)) and set(seen) == corpus_keys
    assert c.stop() == 0
    server = EmbeddedRedis(c.job.run_path).start()  # the job's Redis data, from its append-only file
    try:
        _check_choice(connect(server.url), Keys(c.job.name))
    finally:
        server.stop()
    log = c.log()
    assert "auto-partitioned the sources (0 source(s) from the profile journal, 4 profiled now)" in log

    # the next start of the job partitions from the journal the first run left
    c.start_sidecar()
    c.start_trainers()
    assert all(rec["end"] == "stop" for rec in c.results().values())
    assert c.stop() == 0
    assert "4 source(s) from the profile journal, 0 profiled now" in c.log()


def _check_choice(r, keys) -> None:
    chosen = json.loads(r.get(keys.autoscale))
    layout = Layout.from_json(r.get(keys.layout))
    assert chosen["partitions"]["books"] >= 3, chosen
    assert all(chosen["partitions"][s] == 1 for s in ("web", "code")), chosen
    assert all(hosted == [["books", p]] for p, hosted in enumerate(chosen["loaders"][:3])), "heavy partitions run alone"
    assert len(layout.streams) == sum(chosen["partitions"].values()) and layout.loaders == len(chosen["loaders"])
    profiles = journaled(r, keys)
    assert set(profiles) == set(layout.streams) and all(p.samples > 0 for p in profiles.values())


SHIFT = {
    "kind": "piecewise",
    "points": [
        [0, {"web": 0.2, "code": 0.2, "books": 1, "images": 0}],
        [12, {"web": 1, "code": 1, "books": 0, "images": 0.2}],
    ],
}


def _mixed(cluster, corpus, *, mixing, slow: set[str], seed: int, batches: int, **autoscale):
    """A 2-rank job whose `slow` sources decode slowly (50 ms a sample), under `mixing`,
    autoscaled with `autoscale` (over a few defaults); sidecar and trainers started."""
    from dataclasses import replace

    from harness import make_job

    sources = tuple(
        replace(s, transform="tests.integration.strategies:slow_text") if s.name in slow else s
        for s in make_job(corpus, "/tmp/unused").sources
    )
    c = cluster(
        seed=seed,
        mesh=Mesh(dp=2),
        mixing=mixing,
        sources=sources,
        batch=BatchSpec(global_batch=8, micro_batches=2, context_length=512, ring_bytes=1 << 20),
        autoscale={"memory_mb": 8000, "profile_samples": 4, "scale_interval": 2, **autoscale},
    )
    c.start_sidecar()
    c.start_trainers(batches=batches)
    return c


def _shifting(cluster, corpus, online: bool):
    # books decodes slowly and dominates the first steps, then leaves the mix
    return _mixed(
        cluster, corpus, mixing=SHIFT, slow={"books"}, seed=9, batches=80, cpus=2, online=online, max_threads=3
    )


def test_live_scaling_with_the_mixture_keeps_every_sample_and_the_order(cluster, corpus):
    """Transform workers follow the mixture while the job runs; the batches are the
    bytes of the same job without scaling."""
    fixed = _shifting(cluster, corpus, online=False)
    expected = fixed.results()
    assert fixed.stop() == 0
    c = _shifting(cluster, corpus, online=True)
    got = c.results()
    r = connect(f"unix://{c.job.run_path / 'redis.sock'}")
    events = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in r.xrange(Keys(c.job.name).scaling)]
    assert c.stop() == 0
    for rank in range(2):
        assert got[rank]["end"] == "limit", got[rank]["end"]
        assert got[rank]["digests"] == expected[rank]["digests"]
    books = [(int(e["step"]), int(e["workers"])) for e in events if e["source"] == "books"]
    assert books and max(w for _, w in books) == 3, events  # starved by its slow decode: scaled up
    assert books[-1][1] == 1 and books[-1][0] > 12, events  # the mixture moved away: workers reclaimed
    assert "transform worker(s)" in c.log()


TURN = {
    "kind": "piecewise",
    "points": [
        [0, {"web": 0.2, "code": 0, "books": 1, "images": 0}],
        [10, {"web": 0.2, "code": 1, "books": 0, "images": 0}],
    ],
}


def _turning(cluster, corpus, online: bool):
    # books and code both decode slowly; the mixture turns from books to code
    return _mixed(cluster, corpus, mixing=TURN, slow={"books", "code"}, seed=13, batches=60, cpus=6, online=online)


def test_a_source_the_mixture_turns_to_is_spread_over_the_idle_loader_processes_live(cluster, corpus):
    """code is light at step 0 (its partitions, sized for its peak, share one process)
    and costly from step 10: the autoscaler hands its partitions to the processes books
    leaves idle, at step boundaries; the batches are the bytes of the job without it."""
    fixed = _turning(cluster, corpus, online=False)
    expected = fixed.results()
    assert fixed.stop() == 0
    c = _turning(cluster, corpus, online=True)
    got = c.results()
    r = connect(f"unix://{c.job.run_path / 'redis.sock'}")
    keys = Keys(c.job.name)
    layout = Layout.from_json(r.get(keys.layout))
    handoffs = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.handoffs)]
    assert c.stop() == 0
    for rank in range(2):
        assert got[rank]["end"] == "limit", got[rank]["end"]
        assert got[rank]["digests"] == expected[rank]["digests"]
        assert got[rank]["keys"] == expected[rank]["keys"]
    code = [i for i, n in enumerate(layout.streams) if n.startswith("code.")]
    before = {layout.loader_of[i] for i in code}
    assert len(code) > 1 and len(before) < len(code), layout  # sized for its peak, packed for step 0
    moved = [h for h in handoffs if h["reason"].startswith("loader process demand")]
    assert moved and all(int(h["step"]) > 0 for h in moved), (handoffs, c.log()[-4000:])
    serving = list(layout.loader_of)
    for h in moved:
        serving[layout.streams.index(h["stream"])] = int(h["to"])
    assert len({serving[i] for i in code}) > len(before), (handoffs, layout)  # read by more processes now
    assert "served by loader process" in c.log()


def _repartitioned(cluster, corpus):
    return _mixed(
        cluster, corpus, mixing=TURN, slow={"books", "code"}, seed=13, batches=60, cpus=6, online=True, reshards=True
    )


def test_partitions_follow_the_mixing_schedule_live_and_the_same_in_every_run(cluster, corpus):
    """With autoscale.reshards, the Planner reshards the sources the schedule turns from
    and to, at steps the schedule decides: a second run reshards at the same steps and
    gives the same bytes, and no sample comes twice."""
    runs = []
    for _ in range(2):
        c = _repartitioned(cluster, corpus)
        got = c.results()
        r = connect(f"unix://{c.job.run_path / 'redis.sock'}")
        log = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(Keys(c.job.name).reshards)]
        assert c.stop() == 0
        for rank in range(2):
            assert got[rank]["end"] == "limit", (got[rank]["end"], c.log()[-4000:])
        seen = [k for rec in got.values() for batch in rec["keys"] for k in batch]
        assert len(seen) == len(set(seen))
        runs.append((got, [(e["step"], e["source"], e["from"], e["to"]) for e in log], log))
    (first, made, log), (second, again, _) = runs
    assert made and all(e["reason"].startswith("autoscaler: the mixing schedule") for e in log), log
    assert {source for _, source, _, _ in made} >= {"books"}, made  # the source the schedule leaves
    assert made == again, (made, again)
    for rank in range(2):
        assert first[rank]["digests"] == second[rank]["digests"]
