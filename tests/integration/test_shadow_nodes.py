"""Shadow Loaders across nodes: a job on two nodes that are hosts of their
own (hosts.py), every source with `shadow: true`. Each loader process's shadow runs on
the other node; when a node's sidecar and roles die (its trainer lives) or its link
goes down, the shadows on the other node take its loaders over, hot: one promotion
per loader, at a step boundary, every sample delivered once, with the bytes of the run
without a fault. The trainers' stall is measured from the times each batch arrived
(ledger_trainer.py) against the median gap between batches (hosted.stall).
"""

from __future__ import annotations

import json
import time

import pytest
from harness import assert_delivered
from hosted import FLIGHT_PORT, HostedJob, HostedJobs, resumed, stall, until
from hosts import unavailable

from overlord import BatchSpec, Mesh
from overlord.store import Keys, connect
from overlord.store.schema import decode_active, log_entries

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,  # make test-slow
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

NODES = ("n0", "n1")
SLEEP_S = 0.2  # each trainer's step: the median gap between its batches
JOB = dict(
    seed=5,
    epochs=1,
    mesh=Mesh(dp=2),
    loader_processes=2,
    plan_ahead=2,
    timeout_s=30.0,
    nodes=NODES,
    flight_port=FLIGHT_PORT,
    batch=BatchSpec(global_batch=20, micro_batches=2, context_length=512, ring_bytes=128 << 10),
)
_reference: dict[int, dict] = {}  # the run without a fault, made once per session


@pytest.fixture
def hosted(corpus, tmp_path):
    """A factory of jobs on hosts, each on a fabric of its own, every source shadowed."""
    jobs = HostedJobs(corpus, tmp_path, **JOB)
    yield lambda: jobs.make(shadow=True)
    jobs.close()


def _reference_run(hosted, corpus_keys) -> dict[int, dict]:
    if not _reference:
        h = hosted()
        for node in NODES:
            h.start_sidecar(node)
        h.start_trainers(sleep=str(SLEEP_S))
        out = h.results(timeout=180)
        assert all(rec["end"] == "stop" for rec in out.values()), h.log()
        assert_delivered(out, corpus_keys, log=h.log)
        assert h.stop() == {n: 0 for n in NODES}, h.log()
        print("no fault:", json.dumps(stall(out)))
        _reference.update(out)
    return _reference


class _View:
    """The job's state in Redis, as the test reads it."""

    def __init__(self, h: HostedJob) -> None:
        self.r, self.keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)

    def step(self) -> int:
        return min(int(self.r.hget(self.keys.progress, f"c{dp}") or -1) for dp in range(2))

    def placed(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.placement).items()}

    def beats(self, role: str, k: int) -> str | None:
        raw = self.r.get(self.keys.heartbeat(role, str(k)))
        return json.loads(raw)["node"] if raw else None

    def promotions(self) -> list[dict[str, str]]:
        return log_entries(self.r.xrange(self.keys.promotions))

    def moves(self) -> list[dict[str, str]]:
        return log_entries(self.r.xrange(self.keys.placements))


def _start(h: HostedJob) -> _View:
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(sleep=str(SLEEP_S))
    v = _View(h)
    until(lambda: v.step() >= 4, h, what="step 4")
    # every loader's shadow stands by on the other node
    assert {u: n for u, n in v.placed().items() if u.startswith("shadow")} == {"shadow0": "n1", "shadow1": "n0"}
    until(lambda: (v.beats("shadow", 0), v.beats("shadow", 1)) == ("n1", "n0"), h, what="both shadows to beat")
    return v


def _check_taken_over(h: HostedJob, v: _View, out: dict, ref: dict, corpus_keys) -> None:
    """n1's loader went to its shadow on n0, once, hot; every sample once, same bytes."""
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.log()}"
        assert rec["digests"] == ref[rank]["digests"], f"rank {rank}: bytes differ from the run without a fault"
    assert_delivered(out, corpus_keys, log=h.log)
    promoted = [p for p in v.promotions() if p["loader"] == "1"]
    assert len(promoted) == 1 and promoted[0]["node"] == "n0", (v.promotions(), h.log())
    assert decode_active(v.r.hget(v.keys.active, "1"))[1] == "n0"
    moves = [m for m in v.moves() if m["unit"] == "loader1"]
    assert [m["reason"] for m in moves] == ["its shadow was promoted"], moves  # not restarted cold
    text = (h.job.on_node("n0").run_path / "shadow1.log").read_text()
    assert "promoted: shadow of loader process 1" in text, text[-2000:]


def test_a_node_s_roles_killed_its_loaders_are_taken_over_by_their_shadows_on_the_other_node(hosted, corpus_keys):
    ref = _reference_run(hosted, corpus_keys)
    h = hosted()
    v = _start(h)
    killed = h.kill_roles("n1")  # n1's sidecar and roles die; its trainer lives and reads over Flight
    until(lambda: v.promotions(), h, what="the promotion of n1's loader's shadow")
    until(lambda: v.placed().get("shadow0") is None, h, what="n1's shadow of loader0 to be unplaced")
    taken = v.step()
    until(lambda: v.step() >= taken + 3, h, what="three more steps after the takeover")
    assert h.segments("n1"), "the dead roles' rings stay in n1's /dev/shm until a process of the job runs there"
    back = time.time()
    h.start_sidecar("n1")  # as systemd would: the node's shadows come back, its segments are cleaned
    until(
        lambda: v.placed().get("shadow0") == "n1" and v.placed().get("shadow1") == "n1",
        h,
        what="n1 to stand by for both loaders",
    )
    out = h.results(timeout=180)
    _check_taken_over(h, v, out, ref, corpus_keys)
    assert v.placed()["loader1"] == "n0", "a promoted loader stays where it runs hot"
    # the stall is printed, not asserted: a timed bound fails on a loaded machine (2.62x
    # once in CI); bench/nodes.py measures it against the run without a fault. That the
    # takeover was hot, not a cold restart, _check_taken_over asserts from the moves.
    measured = stall(out, since=killed, until=back)
    print("n1's roles killed:", json.dumps(measured), "no fault:", json.dumps(stall(ref)))
    assert h.stop() == {n: 0 for n in NODES}, h.log()
    assert {n: h.segments(n) for n in NODES} == {"n0": [], "n1": []}, "segments left on a host"


def test_a_node_cut_off_for_10_s_loses_its_loaders_to_their_shadows_and_delivers_nothing_after(hosted, corpus_keys):
    ref = _reference_run(hosted, corpus_keys)
    h = hosted()
    v = _start(h)
    down, up = h.cut_for("n1", 10.0)
    out = h.results(timeout=180)
    _check_taken_over(h, v, out, ref, corpus_keys)
    # once the link was back the cut-off loader stopped: it saw its successor in `active`, or
    # its sidecar saw the placement first and stopped it
    superseded = "superseded" in (h.job.on_node("n1").run_path / "loader1.log").read_text()
    stopped = "loader1 (pid" in (text := (h.workdir / "sidecar-n1.log").read_text()) and "stopping it here" in text
    assert superseded or stopped, h.log()
    # every trainer waits out the cut: n1's cannot reach anything, and the Planner keeps within
    # plan_ahead of the slowest trainer (as a job whose collectives span the nodes would)
    measured, after = stall(out, since=down), resumed(out, up)
    print("n1 cut off for 10 s:", json.dumps(measured), "after the mend:", after, "no fault:", json.dumps(stall(ref)))
    # measured 0.77-0.81 s (4x the median gap): TCP's retransmission backoff over the cut and the
    # clients' reconnects, not the takeover (done 5 s into the cut); bounded here against a hang only
    assert max(after.values()) < 15.0, f"slow to resume after the mend: {after}\n{h.log()}"
    assert h.stop() == {n: 0 for n in NODES}, h.log()
    assert {n: h.segments(n) for n in NODES} == {"n0": [], "n1": []}, "segments left on a host"
