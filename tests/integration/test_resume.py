"""Exact resumption: stop or kill -9 the whole node side, restart with --resume, and
every rank continues at exactly its next batch with the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from overlord import BatchSpec, Mesh

pytestmark = pytest.mark.timeout(240)

JOB = dict(seed=21, mesh=Mesh(dp=2), batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20))


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_resume_after_a_restart_gives_identical_bytes(cluster, tmp_path, how):
    reference = cluster(**JOB)
    reference.start_sidecar()
    reference.start_trainers(batches=30)
    expected = reference.results()
    assert reference.stop() == 0

    c = cluster(**JOB)
    sidecar = c.start_sidecar()
    states = {r: tmp_path / f"state{r}-{how}.json" for r in range(2)}
    c.trainers.clear()
    c.start_trainers(ranks=[0], batches=11, **{"save-state": states[0]})  # ranks may stop at different
    c.start_trainers(ranks=[1], batches=12, **{"save-state": states[1]})  # micro-batches of a step
    first = c.results()
    if how == "kill -9":
        os.kill(sidecar.pid, signal.SIGKILL)
        sidecar.wait(timeout=10)
    else:
        assert c.stop() == 0
    assert json.loads(states[0].read_text())["batches"] == 11

    c.start_sidecar(resume=True)
    c.trainers.clear()
    for r in range(2):
        c.start_trainers(ranks=[r], batches=30 - (11 + r), **{"load-state": states[r]})
    second = c.results()
    for r in range(2):
        assert second[r]["end"] == "limit", second[r]["end"]
        assert first[r]["digests"] + second[r]["digests"] == expected[r]["digests"]
        assert first[r]["keys"] + second[r]["keys"] == expected[r]["keys"]
    assert c.stop() == 0
