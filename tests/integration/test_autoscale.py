"""Auto-partitioning at start: profiled costs size the Source Loaders, the choice is
stored, the profile journal outlives the run, and every sample still arrives once."""

from __future__ import annotations

import json

import pytest

from overlord import BatchSpec, Mesh
from overlord.autoscale.profile import journaled
from overlord.sidecar.layout import Layout
from overlord.store import EmbeddedRedis, Keys, connect

pytestmark = pytest.mark.timeout(240)

JOB = dict(seed=4, epochs=1, mesh=Mesh(dp=2),
           batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
           autoscale={"cpus": 6, "memory_mb": 8000, "profile_samples": 16, "cluster_size": 1})


def test_costly_source_gets_more_loader_partitions_and_every_sample_arrives_once(cluster, corpus, corpus_keys):
    from dataclasses import replace

    from harness import make_job

    # books decodes slowly (50 ms a sample): 500x the other text sources
    sources = tuple(replace(s, transform="tests.integration.strategies:slow_text") if s.name == "books" else s
                    for s in make_job(corpus, "/tmp/unused").sources)
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
