"""A job on several nodes (hosts of their own, hosts.py) resumes from its trainers'
state_dict: a stopped job started again with `overlord sidecar --resume` on every node
(in any order), on the same mesh or another DP size, and a job that lost a whole node
with its trainers while the other node's sidecar ran on (node_loss: torchrun restarts
every rank from its last saved state, systemd starts the lost node's sidecar again).

Each test merges every rank's ledger of the first run (up to its saved state) with the
second run's: every sample key exactly once across both, and on the same mesh the
bytes of a run without a stop.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from harness import assert_delivered
from hosted import FLIGHT_PORT, HostedJob, HostedJobs, until
from hosts import unavailable

from overlord import BatchSpec, Mesh
from overlord.sidecar import rewind
from overlord.store import Keys, connect
from overlord.store.schema import RESUME_STEP

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,  # make test-slow
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

NODES = ("n0", "n1")
JOB = dict(
    seed=7,
    epochs=1,
    mesh=Mesh(dp=2),
    loader_processes=2,
    plan_ahead=2,
    timeout_s=30.0,
    nodes=NODES,
    flight_port=FLIGHT_PORT,
    # 960 samples: 40 steps of 2 micro-batches per rank at dp=2 (and 3 samples a micro-batch at dp=4)
    batch=BatchSpec(global_batch=24, micro_batches=2, context_length=512, ring_bytes=512 << 10),
)


@pytest.fixture
def hosted(corpus, tmp_path):
    jobs = HostedJobs(corpus, tmp_path, **JOB)
    yield jobs.make
    jobs.close()


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Every rank's ledger in a run on the two hosts with no stop."""
    jobs = HostedJobs(corpus, tmp_path_factory.mktemp("reference"), **JOB)
    try:
        h = jobs.make()
        for node in NODES:
            h.start_sidecar(node)
        h.start_trainers()
        out = h.results(timeout=180)
        assert all(rec["end"] == "stop" for rec in out.values()), ({r: rec["end"] for r, rec in out.items()}, h.log())
        assert h.stop() == {n: 0 for n in NODES}, h.log()
    finally:
        jobs.close()
    return out


def _stopped_run(h: HostedJob, batches: int) -> tuple[dict[int, dict], dict[int, str]]:
    """Run the job until every rank consumed `batches` and saved its state, then stop
    every sidecar (a job stopped for maintenance). Returns the ledgers and the states."""
    for node in NODES:
        h.start_sidecar(node)
    states = {rank: str(h.workdir / f"state-{rank}.json") for rank in range(h.job.mesh.world_size)}
    for rank, path in states.items():
        h.start_trainers(ranks=[rank], sleep="0.02", batches=batches, **{"save-state": path})
    first = h.results(timeout=120)
    assert all(rec["end"] == "limit" for rec in first.values()), ({r: rec["end"] for r, rec in first.items()}, h.log())
    assert h.stop() == {n: 0 for n in NODES}, h.log()
    h.trainers.clear()
    return first, states


def _merge(first: dict[int, dict], second: dict[int, dict]) -> dict[int, dict]:
    """Every rank's ledger across both runs (a rank of only one run keeps that one's)."""
    out = {}
    for rank in sorted(set(first) | set(second)):
        a, b = first.get(rank, {}), second.get(rank, {})
        out[rank] = {
            "end": b.get("end", a.get("end")),
            "keys": a.get("keys", []) + b.get("keys", []),
            "digests": a.get("digests", []) + b.get("digests", []),
        }
    return out


def _check_ends(second: dict[int, dict], h: HostedJob) -> None:
    for rank, rec in second.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.log()}"


def _as_reference(h: HostedJob, first: dict[int, dict], reference, corpus_keys, timeout: float) -> dict[int, dict]:
    """The second run's records once every rank ended, checked: each rank read to the end,
    every sample once across both runs, and each rank's bytes those of the run without
    a stop or a fault."""
    second = h.results(timeout=timeout)
    _check_ends(second, h)
    merged = _merge(first, second)
    for rank, rec in merged.items():
        assert rec["digests"] == reference[rank]["digests"], (
            f"rank {rank}: bytes differ from the run without a stop or fault"
        )
    assert_delivered(merged, corpus_keys, log=h.log)
    return second


def test_a_stopped_job_resumes_on_the_same_nodes_with_the_bytes_of_a_run_without_a_stop(hosted, reference, corpus_keys):
    h = hosted()
    first, states = _stopped_run(h, batches=30)  # step 14 of 40: the rest comes from the resume
    for node in reversed(NODES):  # the node that did not start the job boots first now
        h.start_sidecar(node, "--resume")
    for rank, path in states.items():
        h.start_trainers(ranks=[rank], **{"load-state": path})
    _as_reference(h, first, reference, corpus_keys, timeout=120)
    assert h.stop() == {n: 0 for n in NODES}, h.log()


def test_a_stopped_job_resumes_on_another_dp_size_exactly_once(hosted, corpus_keys):
    h = hosted()
    first, states = _stopped_run(h, batches=30)  # after micro-batch 1 of step 14: a step boundary
    state = states[0]  # rank 0's state is the job's: every rank loads it
    h.reconfigure(mesh=Mesh(dp=4))  # two ranks on each node now
    for node in NODES:
        h.start_sidecar(node, "--resume")
    h.start_trainers(**{"load-state": state})
    second = h.results(timeout=120)
    _check_ends(second, h)
    assert all(len(rec["keys"]) == 2 * (40 - 15) for rec in second.values()), {
        r: len(rec["keys"]) for r, rec in second.items()
    }
    assert_delivered(_merge(first, second), corpus_keys, log=h.log)
    assert h.stop() == {n: 0 for n in NODES}, h.log()


def _saved_mid_run(h: HostedJob):
    """Both nodes run the job, the ranks saving their state every 10 and 15 batches; returns
    (Redis client, keys) once they saved 40 and 45 (rank 1's state is mid-step: step 22,
    micro-batch 0, so the rank ahead skips what it had of the step resumed at)."""
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(ranks=[0], sleep="0.05", **{"save-every": 10})
    h.start_trainers(ranks=[1], sleep="0.05", **{"save-every": 15})

    def saved(rank: int) -> int:
        try:
            return json.loads(h.out(rank).read_text())["state"]["batches"]
        except (OSError, KeyError, ValueError):
            return 0

    until(lambda: saved(0) >= 40 and saved(1) >= 45, h, what="both ranks to save 40 and 45 batches")
    return connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)


def test_a_node_lost_with_its_trainers_rewinds_the_job_to_their_saved_states(hosted, reference, corpus_keys):
    """node_loss: n1 vanishes with its sidecar, roles and trainer while n0's sidecar
    runs on; torchrun kills n0's trainer too and restarts every rank from its last
    saved state; systemd starts n1's sidecar again (the same command line). The job
    goes back to the trainers' states on both nodes and continues exactly once, with
    the bytes of a run without a fault."""
    h = hosted()
    r, keys = _saved_mid_run(h)
    h.lose_node("n1")
    first = h.stop_trainers()
    states = h.save_states(first)
    resumes_at = {
        rank: [s["step"] + 1, 0] if s["microbatch"] == 1 else [s["step"], s["microbatch"] + 1]
        for rank, s in ((rank, first[rank]["state"]) for rank in first)
    }
    # the surviving node plans on: n1's units move to n0 once its heartbeat lapses
    until(lambda: (r.hget(keys.placement, "constructor1") or b"").decode() == "n0", h, what="n1's roles to move to n0")
    h.restart_node("n1")
    for rank, path in states.items():
        h.start_trainers(ranks=[rank], **{"load-state": str(path)})
    second = _as_reference(h, first, reference, corpus_keys, timeout=150)
    assert {rank: second[rank]["steps"][0] for rank in second} == resumes_at, h.log()
    rewound = (h.workdir / "sidecar-n0.log").read_text()
    assert "loaded an earlier state" in rewound, "n0's sidecar never went back"
    assert h.stop() == {n: 0 for n in NODES}, h.log()


def test_a_node_cut_off_for_the_whole_of_a_rewind_joins_the_rewound_run(hosted, reference, corpus_keys):
    """Every trainer restarts from its saved state while n1's link is down: n0 goes back
    without it (n1's heartbeat lapsed, so the barrier does not wait for it), publishes
    the job again, and decides the step once n1's rank tells its position. n1's sidecar
    sees none of it (here: stopped from before the cut until the step is decided, as a
    longer cut would leave it; stopped only once the link is down, a command it sent in
    the cut can land once the link is back and show it the rewind still under way, and
    it goes back with the others, late to the barrier). Back, it finds the job published
    without it and joins the rewound run; its rank, which waited for that, reads on.
    Exactly once, with the bytes of a run without a fault."""
    h = hosted()
    r, keys = _saved_mid_run(h)
    first = h.stop_trainers()
    states = h.save_states(first)
    h.sidecars["n1"].send_signal(signal.SIGSTOP)
    try:
        h.hosts["n1"].cut()
        h.start_trainers(ranks=[0], **{"load-state": str(states[0])})
        until(lambda: rewind.published(r, keys) == "n0", h, what="n0 to publish the rewound run without n1")
        h.hosts["n1"].mend()
        h.start_trainers(ranks=[1], **{"load-state": str(states[1])})
        until(lambda: r.hget(keys.resume, RESUME_STEP) is not None, h, what="the rewound run's step to be decided")
        assert not rewind.under_way(r, keys)
    finally:
        h.sidecars["n1"].send_signal(signal.SIGCONT)
        os.kill(h.sidecars["n1"].popen.pid, signal.SIGCONT)  # nsenter stopped itself with its child
    _as_reference(h, first, reference, corpus_keys, timeout=150)
    assert "joining the job again" in (h.workdir / "sidecar-n1.log").read_text(), h.log()
    assert h.stop() == {n: 0 for n in NODES}, h.log()
