"""Live reshards: a source read by another number of streams from a step boundary on,
while the job runs (overlord.runtime.reshard), with real processes: every sample of
every epoch reaches the trainers once, a run given the same reshards at the same steps
gives the same bytes, and a role killed right after a reshard changes neither."""

from __future__ import annotations

import dataclasses

import pytest
from harness import assert_delivered, clean_run, kill_after_step, partitioned_job, wait_planning

from overlord.planner.request import request_reshard
from overlord.status import collect, render
from overlord.store import Keys
from overlord.store.schema import log_entries

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # make test-slow: a job each, ~25-40 s

# (source, partitions, step): more streams early in epoch 0, fewer, then the first
# source again in epoch 1 (its second reshard: the new streams of the first retired)
RESHARDS = (("web", 3, 12), ("code", 1, 20), ("web", 2, 70))


def _job(corpus, run_dir, shadow: bool = False):
    job = partitioned_job(corpus, run_dir, seed=31, epochs=2)
    return dataclasses.replace(job, sources=tuple(dataclasses.replace(s, shadow=shadow) for s in job.sources))


def _reshard(c, reshards=RESHARDS) -> list[tuple[int, str]]:
    """Request each reshard at its step, in turn (each answer comes once its step is planned)."""
    r, keys = c.redis(), Keys(c.job.name)
    wait_planning(r, keys)
    return [request_reshard(r, keys, source, parts, timeout_s=60, at_step=step) for source, parts, step in reshards]


def _run(c, kill: tuple[str, int] | None = None, promotions: list | None = None) -> dict:
    """Every rank's ledger of a run with RESHARDS (and `kill`); `promotions` gets the
    job's `promotions` entries (read before the job's embedded Redis ends with it)."""
    c.start_sidecar()
    c.start_trainers(sleep=0.1)
    answers = _reshard(c, RESHARDS[:1])
    if kill is not None:
        kill_after_step(c, RESHARDS[0][2], *kill)
    answers += _reshard(c, RESHARDS[1:])
    assert [code for code, _ in answers] == [0, 0, 0], (answers, c.log())
    log = log_entries(c.redis().xrange(Keys(c.job.name).reshards))
    if promotions is not None:
        promotions += log_entries(c.redis().xrange(Keys(c.job.name).promotions))
    shown = render(collect(c.job))  # now: the job's embedded Redis ends with the job
    out = c.results()
    assert c.stop() == 0, c.log()
    assert [(e["source"], int(e["to"]), int(e["step"])) for e in log] == list(RESHARDS), log
    assert "reshard: source web 2 -> 3 streams from step 12 (web.r1p0,web.r1p1,web.r1p2)" in shown, shown
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{c.log()}"
    return out


@pytest.fixture(scope="module")
def resharded(corpus, tmp_path_factory):
    """Every rank's ledger of a run with the reshards and no fault, and the loaders' logs."""
    from harness import Cluster

    tmp = tmp_path_factory.mktemp("reshard-reference")
    (tmp / "work").mkdir()
    c = Cluster(_job(corpus, tmp / "run"), tmp / "work")
    try:
        out = _run(c)
        logs = "".join(p.read_text() for p in c.job.run_path.glob("loader*.log"))
    finally:
        c.kill_all()
    return out, logs


def test_reshards_deliver_every_sample_once_per_epoch(resharded, corpus_keys):
    out, logs = resharded
    assert_delivered(out, corpus_keys, times=2)
    # the processes really read with the new streams
    assert "serving stream(s) ['web.r1p" in logs and "made by a reshard" in logs, logs[-3000:]
    assert "stream web.0: retired by a reshard from step 12" in logs, logs[-3000:]
    assert "stream web.r1p0: retired by a reshard from step 70" in logs, logs[-3000:]


def test_the_same_reshards_at_the_same_steps_give_the_same_bytes(cluster, corpus, corpus_keys, resharded, tmp_path):
    c = cluster(job=_job(corpus, tmp_path / "run"))
    out = _run(c)
    for rank, rec in out.items():
        assert rec["digests"] == resharded[0][rank]["digests"], f"rank {rank}: bytes differ\n{c.log()}"


def test_other_bytes_than_a_run_without_them(corpus, resharded, tmp_path):
    # a reshard changes which samples later steps draw (new streams, a new order): the
    # comparison above would hold by accident if the requests did nothing
    plain = clean_run(_job(corpus, tmp_path / "run"), tmp_path)
    assert any(plain[rank]["digests"] != rec["digests"] for rank, rec in resharded[0].items())


@pytest.mark.parametrize("role, index", [("loader", 0), ("loader", 1), ("planner", 0)])
def test_a_role_killed_right_after_a_reshard_loses_and_repeats_nothing(
    cluster, corpus, corpus_keys, resharded, tmp_path, role, index
):
    # a loader process that hosts new streams (or retired ones) restarts from the planner
    # checkpoint, which holds the reshard; the next Planner plans on with its streams
    c = cluster(job=_job(corpus, tmp_path / "run"))
    out = _run(c, kill=(role, index))
    assert_delivered(out, corpus_keys, times=2, log=c.log)
    for rank, rec in out.items():
        assert rec["digests"] == resharded[0][rank]["digests"], f"rank {rank}: bytes differ\n{c.log()}"


def test_a_loader_killed_after_a_reshard_is_replaced_by_its_shadow_that_followed_it(
    cluster, corpus, corpus_keys, resharded, tmp_path
):
    # every source has Shadow Loaders (so every process has one: the new streams start
    # where they do without them, and the plans are the same): each standby starts the
    # new streams of its process at the same step, and the one promoted when loader
    # process 0 dies right after the first reshard delivers them on
    c = cluster(job=_job(corpus, tmp_path / "run", shadow=True))
    promoted: list = []
    out = _run(c, kill=("loader", 0), promotions=promoted)
    assert_delivered(out, corpus_keys, times=2, log=c.log)
    for rank, rec in out.items():
        assert rec["digests"] == resharded[0][rank]["digests"], f"rank {rank}: bytes differ\n{c.log()}"
    assert [int(e["loader"]) for e in promoted] == [0], promoted
    shadows = "".join(p.read_text() for p in c.job.run_path.glob("shadow*.log"))
    assert "made by a reshard" in shadows and "stream web.0: retired by a reshard from step 12" in shadows, shadows[
        -3000:
    ]


def test_a_request_the_planner_cannot_make_is_refused(cluster, corpus, tmp_path):
    c = cluster(job=_job(corpus, tmp_path / "run"))
    c.start_sidecar()
    c.start_trainers(sleep=0.05)
    r, keys = c.redis(), Keys(c.job.name)
    wait_planning(r, keys)
    answers = [
        request_reshard(r, keys, "nosuch", 2, timeout_s=30),
        request_reshard(r, keys, "web", 0, timeout_s=30),
        request_reshard(r, keys, "books", 2, timeout_s=30),
    ]
    c.results()
    assert c.stop() == 0, c.log()
    assert answers[0][0] == 1 and "no source 'nosuch'" in answers[0][1], answers
    assert answers[1][0] == 1 and "0 partitions: give 1 to" in answers[1][1], answers
    assert answers[2] == (0, "source books: read by 2 stream(s) already"), answers
