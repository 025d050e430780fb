"""A job on three nodes that are hosts of their own (hosts.py): each node in its own
network, IPC, mount (private /dev/shm) and PID namespaces on a private bridge, Redis on
a fourth host reached over TCP, Flight between the nodes' own addresses, and one
trainer rank on each node.

Loader processes are spread over the nodes, so every Data Constructor pulls most of
its samples from the other two hosts over Arrow Flight. Killing a node's sidecar (its
roles die with it) moves its roles to the other nodes and its trainer to reading over
Flight; its sidecar back, they come home. A node over its CPU budget hands its costly
loader to a node with room. Every run delivers every sample exactly once, with the
bytes of the run without a fault, and leaves no segment in any host's /dev/shm.

test_hosts.py holds the two-node tests; these need three nodes (a constructor with
two remote loaders, two nodes with room to take a loader) and share one reference run.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow.flight as flight
import pytest
from harness import assert_delivered, make_job
from hosted import FLIGHT_PORT, HostedJob, HostedJobs, until
from hosts import unavailable

from overlord import BatchSpec, Mesh
from overlord.remote.endpoint import job_token
from overlord.remote.flight import RemoteReader
from overlord.store import Keys, connect
from overlord.store.schema import PLANNER_NODE_PRESSURE, log_entries

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,  # make test-slow
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

NODES = ("n0", "n1", "n2")
JOB = dict(
    seed=5,
    epochs=1,
    mesh=Mesh(dp=3),
    loader_processes=3,
    plan_ahead=2,
    timeout_s=30.0,
    nodes=NODES,
    flight_port=FLIGHT_PORT,
    batch=BatchSpec(global_batch=30, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)
SLEEP = "0.03"


@pytest.fixture
def hosted(corpus, tmp_path):
    """A factory of jobs on three hosts, each job on a fabric of its own."""
    jobs = HostedJobs(corpus, tmp_path, **JOB)
    yield jobs.make
    jobs.close()


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The run with no fault: every rank's ledger, and its job (for its Redis and logs)."""
    jobs = HostedJobs(corpus, tmp_path_factory.mktemp("reference"), **JOB)
    try:
        h = jobs.make()
        h.start(sleep=SLEEP)
        out = h.finish()
        r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)
        placement = {k.decode(): v.decode() for k, v in r.hgetall(keys.placement).items()}
        members = {k.decode(): json.loads(v) for k, v in r.hgetall(keys.nodes).items()}
    finally:
        jobs.close()  # the fabric goes; the logs stay under the work directory
    return out, h, placement, members


class _View:
    """The job's state in Redis, as the tests read it."""

    def __init__(self, h: HostedJob) -> None:
        self.r, self.keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)

    def step(self, dp: int) -> int:
        return int(self.r.hget(self.keys.progress, f"c{dp}") or -1)

    def placed(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.placement).items()}

    def moves(self) -> list[dict[str, str]]:
        return log_entries(self.r.xrange(self.keys.placements))


def test_three_hosts_deliver_every_sample_exactly_once(reference, corpus_keys):
    out, h, placement, members = reference
    assert_delivered(out, corpus_keys, log=h.log)
    assert placement == {
        "loader0": "n0",
        "loader1": "n1",
        "loader2": "n2",
        "constructor0": "n0",
        "constructor1": "n1",
        "constructor2": "n2",
    }
    assert {m: members[m]["ranks"] for m in members} == {"n0": [0], "n1": [1], "n2": [2]}
    # each node registered its own host's address for Flight
    assert all(h.hosts[m].address in json.dumps(members[m]) for m in NODES), members
    # each constructor pulled the samples of the two loaders on the other hosts
    served = [
        line
        for node in NODES
        for line in (h.job.on_node(node).run_path / "flight.log").read_text().splitlines()
        if "served over Flight" in line
    ]
    assert {line.split("ring ")[1].split()[0].rsplit(".", 1)[1] for line in served} == {
        f"l{k}-c{dp}" for k in range(3) for dp in range(3) if k != dp
    }, served


def test_a_wrong_token_or_job_is_refused_by_every_stream(hosted):
    h = hosted()
    h.start_sidecar("n0")
    location = f"grpc://{h.hosts['n0'].address}:{FLIGHT_PORT}"  # n0's own address on this test's fabric
    v = _View(h)
    until(lambda: v.r.exists(v.keys.placement), h, what="the job to be published")
    token = job_token(h.job)
    with pytest.raises(flight.FlightUnauthenticatedError, match="wrong token"):
        next(iter(RemoteReader(h.job, location, token="not-the-token", samples=(0, 0), timeout_s=5)))
    with pytest.raises(flight.FlightUnauthenticatedError, match="wrong token"):
        next(iter(RemoteReader(h.job, location, 0, token="not-the-token", timeout_s=5)))
    other = make_job(
        {"web": list(h.job.sources[0].paths)},
        h.workdir / "other",
        redis_url=h.job.redis_url,
        **{**JOB, "name": "someotherjob"},
    )
    with pytest.raises(flight.FlightUnauthenticatedError, match="serves job"):
        next(iter(RemoteReader(other, location, token=token, samples=(0, 0), timeout_s=5)))


def test_killed_node_moves_its_trainer_to_flight_and_back(hosted, reference, corpus_keys):
    ref = reference[0]
    # rings of a few steps and a slower step than the other tests: the job must still run
    # when n1's roles are home, or rank 1 ends over Flight with nothing to switch back to
    # (with 1 MiB rings at 0.03 s a step, the other node had built all of dp1's remaining
    # batches before a loaded CI machine had n1's sidecar back; now ~20 steps take 4 s)
    h = hosted(batch=dataclasses.replace(JOB["batch"], ring_bytes=128 << 10))
    h.start(sleep="0.2")
    v = _View(h)
    until(lambda: min(v.step(d) for d in range(3)) >= 6, h, what="step 6")
    h.sidecars["n1"].kill()  # its roles die with it (PR_SET_PDEATHSIG); its trainer lives
    h.sidecars["n1"].wait(timeout=10)
    killed_at = v.step(1)
    until(lambda: v.placed()["constructor1"] != "n1" and v.placed()["loader1"] != "n1", h, what="n1's roles to move")
    until(lambda: v.step(1) >= killed_at + 4, h, what="dp1 to be built on another node")
    assert h.segments("n1"), "the dead roles' rings stay in n1's /dev/shm until a process of the job runs there"
    h.start_sidecar("n1")  # as systemd would (Restart=always)
    until(
        lambda: v.placed()["constructor1"] == "n1" and v.placed()["loader1"] == "n1", h, what="n1's roles to come home"
    )
    out = h.finish()  # every rank to its end, no segment left on a host
    for rank, rec in out.items():
        assert rec["digests"] == ref[rank]["digests"], (
            f"rank {rank}: bytes differ from the run without a fault ({len(rec['digests'])} vs "
            f"{len(ref[rank]['digests'])} batches, steps {rec['steps'][:3]}..{rec['steps'][-3:]}, "
            f"switches {rec['switches']}, dropped {rec['dropped']})\n{h.log()}"
        )
    assert out[1]["switches"] >= 2, out[1]  # to another node over Flight, and back
    assert_delivered(out, corpus_keys, log=h.log)
    moves = [(m["unit"], m["from"], m["to"]) for m in v.moves()]
    assert any(m[0] == "constructor1" and m[1] == "n1" for m in moves), moves  # moved away ...
    assert any(m[0] == "constructor1" and m[2] == "n1" for m in moves), moves  # ... and home


def _budgeted(h: HostedJob, budgets: dict[str, str]) -> dict[int, dict]:
    # n1 starts the job: the partitioning takes its budget
    h.start({node: ("--cpus", budgets[node]) for node in ("n1", "n0", "n2")}, sleep=SLEEP)
    return h.finish()


def test_a_node_over_its_cpu_budget_hands_its_costly_loader_to_a_node_with_room(hosted, corpus, corpus_keys, tmp_path):
    # books costs 5 ms a sample; n0 gives the sidecar 0.4 CPUs (0.05 for loaders), n1 and n2 four
    sources = tuple(
        dataclasses.replace(s, transform="tests.integration.strategies:busy_text") if s.name == "books" else s
        for s in make_job(corpus, tmp_path / "unused").sources
    )
    scaled = dict(
        sources=sources,
        epochs=2,
        autoscale={"cpus": 4, "memory_mb": 8000, "profile_samples": 8, "scale_interval": 2, "cluster_size": 1},
    )
    tight = hosted(**scaled)
    out = _budgeted(tight, {"n0": "0.4", "n1": "4", "n2": "4"})
    v = _View(tight)
    moves = v.moves()
    relief = [m for m in moves if "over budget" in m["reason"]]
    assert relief and all(
        m["from"] == "n0" and m["to"] in ("n1", "n2") and m["unit"].startswith("loader") for m in relief
    ), (moves, tight.log())
    pressure = json.loads(v.r.hget(v.keys.planner, PLANNER_NODE_PRESSURE))
    for unit in {m["unit"] for m in relief}:  # n0 stays over budget with it: it does not swing back
        assert [m["to"] for m in moves if m["unit"] == unit] == [m["to"] for m in relief if m["unit"] == unit], moves
    assert set(pressure) == set(NODES), pressure
    members = {k.decode(): json.loads(raw) for k, raw in v.r.hgetall(v.keys.nodes).items()}
    assert members["n0"]["loader_cpus"] < 0.1 < members["n1"]["loader_cpus"], members
    # the same job with room everywhere: nothing moves, and the trainers get the same bytes
    roomy = hosted(**{**scaled, "name": tight.job.name + "b"})
    ref = _budgeted(roomy, {"n0": "4", "n1": "4", "n2": "4"})
    assert not [m for m in _View(roomy).moves() if "over budget" in m["reason"]]
    for rank, rec in out.items():
        assert rec["digests"] == ref[rank]["digests"], f"rank {rank}: bytes differ from the run with no move"
    assert_delivered(out, corpus_keys, times=2, log=tight.log)
    assert_delivered(ref, corpus_keys, times=2, log=roomy.log)
