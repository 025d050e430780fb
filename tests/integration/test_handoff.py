"""Live handoffs: a stream moves from one loader process to another while the job runs,
at a step boundary, and every sample still arrives once, with the bytes of a run
without a handoff."""

from __future__ import annotations

import dataclasses
import time

import pytest
from harness import assert_delivered, clean_run, kill_after_step, partitioned_job, wait_planning

from overlord.planner.request import request_handoff
from overlord.runtime.layout import Layout
from overlord.status import collect, render
from overlord.store import Keys
from overlord.store.schema import log_entries

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # make test-slow: a job each, ~20-35 s


def _job(corpus, run_dir):
    return partitioned_job(corpus, run_dir, seed=29, epochs=1)


def _four_handoffs(c) -> tuple[list, list, tuple, str, list]:
    """Four handoffs mid-epoch (one stream there and back, two others across: both
    processes give and take), then two requests the Planner refuses. Returns the
    moves, the answers, the refused answers, what `overlord status` showed and the
    `handoffs` log."""
    r, keys = c.redis(), Keys(c.job.name)
    wait_planning(r, keys)
    layout = Layout.plan(c.job)
    on0 = [n for n, k in zip(layout.streams, layout.loader_of) if k == 0]
    on1 = [n for n, k in zip(layout.streams, layout.loader_of) if k == 1]
    moves = [(on0[0], 0, 1), (on1[-1], 1, 0), (on1[0], 1, 0), (on0[0], 1, 0)]
    answers = [request_handoff(r, keys, stream, to, timeout_s=30) for stream, _, to in moves]
    refused = (request_handoff(r, keys, on0[0], 5, timeout_s=30), request_handoff(r, keys, "nosuch.0", 0, timeout_s=30))
    # read now: the job's embedded Redis ends with the job
    return moves, answers, refused, render(collect(c.job)), log_entries(r.xrange(keys.handoffs))


def _check_handoffs(c, moves, answers, refused, log, results, corpus_keys) -> None:
    assert [code for code, _ in answers] == [0, 0, 0, 0], (answers, c.log())
    assert refused[0][0] == 1 and "no loader process 5: the job has 2" in refused[0][1], refused
    assert refused[1][0] == 1 and "no stream 'nosuch.0'" in refused[1][1], refused
    taken = [e for e in log if e["to"] != "-1"]
    assert [(e["stream"], int(e["from"]), int(e["to"])) for e in taken] == moves, (log, answers, moves)
    steps = [int(e["step"]) for e in taken]
    last = max(s for rec in results.values() for s, _ in rec["steps"])
    assert steps == sorted(steps) and 0 < steps[0] and steps[-1] < last, (steps, last)  # mid-epoch, in order
    for rec in results.values():
        assert rec["end"] == "stop", rec["end"]
    assert_delivered(results, corpus_keys, log=c.log)
    # the processes really handed the streams over (not served from where they were)
    stream = moves[0][0]
    loader_logs = "".join(p.read_text() for p in c.job.run_path.glob("loader*.log"))
    assert f"serving stream(s) ['{stream}'] from step" in loader_logs, loader_logs[-3000:]
    assert f"stream {stream}: served by loader process 1 from step" in loader_logs, loader_logs[-3000:]


# -- faults around a handoff (make test-slow) -------------------------------------------


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Every rank's ledger in a run with no handoff and no fault."""
    tmp = tmp_path_factory.mktemp("handoff-reference")
    return clean_run(_job(corpus, tmp / "run"), tmp)


def _hand_over_then_kill(c, role: str, index: int) -> tuple[str, int]:
    """Hand the first stream of process 0 to process 1, then SIGKILL `role` `index` once
    the handoff's step was served. Returns (stream, step)."""
    r, keys = c.redis(), Keys(c.job.name)
    wait_planning(r, keys)
    layout = Layout.plan(c.job)
    stream = next(n for n, k in zip(layout.streams, layout.loader_of) if k == 0)
    code, message = request_handoff(r, keys, stream, 1, timeout_s=30)
    assert code == 0, message
    step = int(log_entries(r.xrange(keys.handoffs))[-1]["step"])
    kill_after_step(c, step, role, index)
    return stream, step


def _same_as(reference, out, corpus_keys, c) -> None:
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{c.log()}"
        assert rec["digests"] == reference[rank]["digests"], f"rank {rank}: bytes differ\n{c.log()}"
    assert_delivered(out, corpus_keys, log=c.log)


def test_handoffs_give_the_bytes_of_a_run_without_them(cluster, corpus, corpus_keys, reference, tmp_path):
    c = cluster(job=_job(corpus, tmp_path / "run"))
    c.start_sidecar()
    c.start_trainers(sleep=0.1)
    moves, answers, refused, shown, log = _four_handoffs(c)
    results = c.results()
    _check_handoffs(c, moves, answers, refused, log, results, corpus_keys)
    assert c.stop() == 0, c.log()
    _same_as(reference, results, corpus_keys, c)
    assert f"handoff: stream {moves[0][0]} loader process 0 -> 1 from step" in shown, shown
    assert "handoff refused: stream nosuch.0 at step" in shown, shown


@pytest.mark.parametrize("role, index", [("loader", 1), ("loader", 0), ("planner", 0)])
def test_a_role_killed_right_after_a_handoff_loses_and_repeats_nothing(
    cluster, corpus, corpus_keys, reference, tmp_path, role, index
):
    # loader 1: the process that took the stream over restarts, and takes it again from
    # the plans; loader 0: the one that handed it off restarts without it; planner: the
    # next Planner serves the stream where the last plan did
    c = cluster(job=_job(corpus, tmp_path / "run"))
    c.start_sidecar()
    c.start_trainers(sleep=0.1)
    stream, step = _hand_over_then_kill(c, role, index)
    out = c.results()
    assert c.stop() == 0, c.log()
    _same_as(reference, out, corpus_keys, c)
    if role == "planner":
        assert f"streams served away from their layout's loader process: ['{stream} -> 1']" in c.log(), c.log()


def test_a_handed_over_stream_follows_its_new_process_into_the_shadow_that_takes_over(
    cluster, corpus, corpus_keys, reference, tmp_path
):
    job = _job(corpus, tmp_path / "run")
    c = cluster(job=dataclasses.replace(job, sources=tuple(dataclasses.replace(s, shadow=True) for s in job.sources)))
    c.start_sidecar()
    c.start_trainers(sleep=0.1)
    stream, _ = _hand_over_then_kill(c, "loader", 1)
    r, keys = c.redis(), Keys(c.job.name)
    deadline = time.monotonic() + 60
    while not r.xrange(keys.promotions):
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.05)
    out = c.results()
    assert c.stop() == 0, c.log()
    _same_as(reference, out, corpus_keys, c)
