"""Exact resumption: stop or kill -9 the whole node side, restart with --resume, and
every rank continues at exactly its next batch with the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from overlord import BatchSpec, Mesh

pytestmark = pytest.mark.timeout(240)

JOB = dict(
    seed=21, mesh=Mesh(dp=2), batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20)
)


def _uninterrupted(cluster, job: dict, batches: int = 30) -> dict:
    """Every rank's ledger of `batches` batches of `job` with no restart."""
    reference = cluster(**job)
    reference.start_sidecar()
    reference.start_trainers(batches=batches)
    expected = reference.results()
    assert reference.stop() == 0
    return expected


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_resume_after_a_restart_gives_identical_bytes(cluster, tmp_path, how):
    expected = _uninterrupted(cluster, JOB)
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


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_ranks_that_resume_as_far_apart_as_the_look_ahead_lets_them_get_every_batch(cluster, tmp_path):
    """With plan_ahead 2 a rank may run 3 steps ahead of the slowest: rank 1 stops
    through step 3, rank 0 in step 1. On the resume (at step 1) the Data Constructor
    skips what rank 1 consumed, every micro-batch of steps 1-3, and those count as
    consumed there too. They did not: rank 1's mark stood at the resume step, the
    Planner kept steps 1-3 planned and waited for it, and both ranks waited for step 4
    (no batch, "slow, not hung", for ever)."""
    job = dict(JOB, plan_ahead=2)
    expected = _uninterrupted(cluster, job)
    c = cluster(**job)
    c.start_sidecar()
    states = {r: tmp_path / f"state{r}.json" for r in range(2)}
    done = {0: 3, 1: 8}  # rank 1: all of steps 0-3, the most rank 0 at step 1 lets it have
    c.trainers.clear()
    for r in range(2):
        c.start_trainers(ranks=[r], batches=done[r], **{"save-state": states[r]})
    first = c.results()
    assert [first[r]["end"] for r in range(2)] == ["limit", "limit"], c.log()
    assert c.stop() == 0

    c.start_sidecar(resume=True)
    c.trainers.clear()
    for r in range(2):
        c.start_trainers(ranks=[r], batches=30 - done[r], **{"load-state": states[r]})
    second = c.results(timeout=90)
    for r in range(2):
        assert second[r]["end"] == "limit", second[r]["end"]
        assert first[r]["digests"] + second[r]["digests"] == expected[r]["digests"]
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_resume_on_a_different_dp_size_continues_exactly_once(cluster, corpus_keys, tmp_path):
    from dataclasses import replace

    c = cluster(
        seed=5,
        epochs=1,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    c.start_sidecar()
    states = {r: tmp_path / f"dp2-rank{r}.json" for r in range(2)}
    for r in range(2):
        c.start_trainers(ranks=[r], batches=12, **{"save-state": states[r]})  # 6 whole steps
    before = c.results()
    assert c.stop() == 0

    # the same job, same run directory and Redis, on one DP rank
    narrower = cluster(job=replace(c.job, mesh=Mesh(dp=1)))
    narrower.start_sidecar(resume=True)
    narrower.start_trainers(ranks=[0], **{"load-state": states[0]})
    after = narrower.results()[0]
    assert after["end"] == "stop", after["end"]
    assert after["steps"][0] == [6, 0]
    delivered = [k for r in before.values() for b in r["keys"] for k in b] + [k for b in after["keys"] for k in b]
    assert len(delivered) == len(set(delivered)) and set(delivered) == corpus_keys
    assert narrower.stop() == 0


def test_a_mid_step_state_of_another_mesh_is_refused(cluster):
    from overlord.errors import ConfigError
    from overlord.torch import DataLoader

    c = cluster(mesh=Mesh(dp=1), batch=BatchSpec(global_batch=8, micro_batches=2))
    loader = DataLoader(c.job, rank=0, world_size=1, spawn_sidecar=False)
    state = {
        "job": c.job.name,
        "rank": 1,
        "batches": 3,
        "step": 1,
        "microbatch": 0,
        "mesh": [2, 1, 1, 1],
        "micro_batches": 2,
    }
    with pytest.raises(ConfigError, match="needs a state taken at a step boundary"):
        loader.load_state_dict(state)
