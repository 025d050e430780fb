"""A real single-node job: sidecar, embedded redis-server, loaders, planner,
constructors, rings and four trainer processes."""

from __future__ import annotations

import collections
import math
import time

import pytest
from harness import assert_delivered

from overlord import Mesh

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    "layout",
    # the second layout (10.8 s) runs in the slow tier, which CI runs too
    ["one loader process", pytest.param("partitions over two loader processes", marks=pytest.mark.slow)],
)
def test_every_sample_exactly_once_across_four_dp_ranks(cluster, corpus_keys, layout):
    overrides = {}
    if layout != "one loader process":
        from dataclasses import replace

        c0 = cluster()
        overrides = dict(
            sources=tuple(replace(s, partitions=3 if s.name == "web" else 1) for s in c0.job.sources),
            loader_processes=2,
        )
    c = cluster(epochs=1, **overrides)
    c.start_sidecar()
    c.start_trainers()
    results = c.results()
    assert {r["end"] for r in results.values()} == {"stop"}, c.log()
    assert_delivered(results, corpus_keys, log=c.log)
    # every rank saw the same steps, each with all micro-batches
    steps = {tuple(map(tuple, r["steps"])) for r in results.values()}
    assert len(steps) == 1
    # no trainer loaded redis-py: each left its running totals in its ring's consumer
    # note, and the Data Constructor host published them (overlord.torch.stats)
    assert not any(r["redis_loaded"] for r in results.values())
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_trainers_on_one_node_leave_their_totals_to_their_constructor_host(cluster):
    """A trainer on one node opens no Redis connection for its running totals: it leaves
    them in its ring's consumer note, and the Data Constructor host publishes them as
    its `stats` record (with its pid and node), refreshed while it runs."""
    from overlord.runtime.layout import client_ring
    from overlord.shm import Ring
    from overlord.store import Keys
    from overlord.store.schema import contact_of, decode_record

    c = cluster(mesh=Mesh(dp=2))
    c.start_sidecar()
    c.start_trainers(batches=60, sleep=0.05)
    r, deadline, seen = c.redis(), time.monotonic() + 60, {}
    while len(seen) < 2 or min(rec["batches"] for rec in seen.values()) < 10:
        assert time.monotonic() < deadline, f"no running totals from the trainers: {seen}\n{c.log()}"
        raw = r.hgetall(Keys(c.job.name).stats)
        seen = {rank: decode_record(raw[f"rank{rank}".encode()]) for rank in (0, 1) if f"rank{rank}".encode() in raw}
        time.sleep(0.1)
    for rank, record in seen.items():
        assert record["pid"] == c.trainers[rank].pid and record["node"] == c.job.node, record
        assert record["done"] is False and record["wait_s"] >= 0 and record["step"] >= 0, record
    # and once written, the host says when in each ring: a stalled trainer dates an outage from it
    for rank in (0, 1):
        with Ring.attach(client_ring(c.job, rank), timeout=5) as ring:
            assert abs(contact_of(ring.producer_note()) - time.time()) < 5
    results = c.results()
    assert {res["end"] for res in results.values()} == {"limit"}, c.log()
    assert not any(res["redis_loaded"] for res in results.values())
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_same_seed_same_bytes_and_weights_respected(cluster, corpus):
    runs = []
    for _ in range(2):
        c = cluster(seed=99)
        c.start_sidecar()
        c.start_trainers(batches=40)
        runs.append(c.results())
        assert c.stop() == 0
    for rank in range(4):
        assert runs[0][rank]["end"] == "limit"
        assert runs[0][rank]["digests"] == runs[1][rank]["digests"]
        assert runs[0][rank]["keys"] == runs[1][rank]["keys"]
    # the achieved mix is within sampling error of the weights (sources cycle epochs)
    counts = collections.Counter(k.split(":")[0] for r in runs[0].values() for b in r["keys"] for k in b)
    n = sum(counts.values())
    weights = {"web": 0.4, "code": 0.3, "books": 0.2, "images": 0.1}
    for name, w in weights.items():
        assert abs(counts[name] / n - w) < 4 * math.sqrt(w * (1 - w) / n), (name, counts)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_another_seed_other_batches(cluster):
    digests = []
    for seed in (1, 2):
        c = cluster(
            seed=seed,
            mesh=__import__("overlord").Mesh(dp=1),
            batch=__import__("overlord").BatchSpec(global_batch=8, context_length=256),
        )
        c.start_sidecar()
        c.start_trainers(batches=5)
        digests.append(c.results()[0]["digests"])
        c.stop()
    assert digests[0] != digests[1]


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_bytes_do_not_depend_on_how_loaders_are_laid_out(cluster):
    digests = []
    for processes in (1, 2):
        c = cluster(seed=7, loader_processes=processes)
        c.start_sidecar()
        c.start_trainers(batches=12)
        digests.append({rank: r["digests"] for rank, r in c.results().items()})
        assert c.stop() == 0
    assert digests[0] == digests[1]


def test_dynamic_mixing_follows_losses_the_trainer_reports(cluster):
    from overlord import BatchSpec, Mesh
    from overlord.torch import DataLoader

    c = cluster(
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=16, context_length=512, ring_bytes=1 << 20),
        mixing={"kind": "dynamic", "every": 4},
        plan_ahead=1,
    )
    c.start_sidecar()
    loader = DataLoader(c.config, rank=0, world_size=1, timeout_s=30)
    early, late = collections.Counter(), collections.Counter()
    for i, _ in enumerate(loader):
        if i == 0:
            loader.report_metrics({"loss/images": 9.0, "loss/web": 1.0, "loss/code": 1.0, "loss/books": 1.0})
        (early if i < 4 else late).update(k.split(":")[0] for k in loader.last_meta["keys"])
        if i == 60:
            break
    loader.close()
    # images has base weight 0.1; once the Planner reads the loss, nearly every sample is an image
    assert early["images"] / sum(early.values()) < 0.5
    assert late["images"] / sum(late.values()) > 0.9, late
    assert c.stop() == 0
