"""Transformation reordering: the image decode deferred to the Data Constructor gives
the same batches while the loader-to-constructor rings carry compressed bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlord import BatchSpec, Mesh
from overlord.autoscale.profile import journaled
from overlord.store import EmbeddedRedis, Keys, connect

pytestmark = pytest.mark.timeout(180)

JOB = dict(
    seed=8,
    epochs=1,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)


def _run(cluster, sources=None):
    c = cluster(**JOB, **({"sources": sources} if sources else {}))
    c.start_sidecar()
    c.start_trainers()
    out = c.results()
    assert c.stop() == 0, c.log()
    server = EmbeddedRedis(c.job.run_path).start()
    try:
        images = journaled(connect(server.url), Keys(c.job.name))["images.0"]
    finally:
        server.stop()
    return out, images.out_bytes / images.samples


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_deferred_decode_gives_the_same_batches_with_compressed_bytes_in_the_rings(cluster, corpus):
    from harness import make_job

    expected, pixel_bytes = _run(cluster)
    sources = tuple(
        replace(s, transform="overlord.transforms:image_text_deferred", decode="overlord.transforms:decode_image")
        if s.name == "images"
        else s
        for s in make_job(corpus, "/tmp/unused").sources
    )
    got, compressed_bytes = _run(cluster, sources)
    for rank in range(2):
        assert got[rank]["end"] == "stop", got[rank]["end"]
        assert got[rank]["digests"] == expected[rank]["digests"]
    assert compressed_bytes < pixel_bytes / 2, (compressed_bytes, pixel_bytes)
