"""A job on two nodes that are hosts of their own (hosts.py): each node in its own
network, IPC, mount (private /dev/shm) and PID namespaces on a private bridge, Redis on
a third host reached over TCP, Flight between the nodes' own addresses.

With no fault, every sample reaches the trainers exactly once, each host's /dev/shm
holds only its own node's segments, and none is left once the job ends. With a node's
sidecar and roles killed while its trainer lives, the trainer reads over Flight from the
other host and back once its sidecar is started again, with the bytes of the run
without a fault; the dead roles' segments are gone from its host once the new sidecar
runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from harness import assert_delivered
from hosted import FLIGHT_PORT, HostedJob, HostedJobs, until
from hosts import unavailable

from overlord import BatchSpec, Mesh
from overlord.plan.checkpoint import Checkpoints
from overlord.store import Keys, connect
from overlord.store.schema import PLANNER_DURABLE

# the clean two-host run and the full /dev/shm refusal run in `make test` (about 20 s and
# 5 s); the fault runs are marked slow (make test-slow, which .ci/run also runs)
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

NODES = ("n0", "n1")
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


@pytest.fixture
def hosted(corpus, tmp_path):
    """A factory of jobs on hosts, each job on a fabric of its own."""
    jobs = HostedJobs(corpus, tmp_path, **JOB)
    yield jobs.make
    jobs.close()


def _run_clean(h: HostedJob) -> dict[int, dict]:
    h.start(sleep="0.05")
    until(lambda: all(h.segments(n) for n in NODES), h, what="each node's rings")
    mine = {n: h.segments(n) for n in NODES}
    out = h.finish()  # every rank to its end, no segment left on a host
    # each host saw only its own node's segments (the other's live in its own /dev/shm)
    assert not set(mine["n0"]) & set(mine["n1"]), mine
    return out


@pytest.mark.slow  # 20 s of two namespaced hosts; the slow tier, which CI runs too
def test_two_hosts_deliver_every_sample_once_over_their_own_addresses(hosted, corpus_keys):
    h = hosted()
    out = _run_clean(h)
    assert_delivered(out, corpus_keys, log=h.log)
    served = [
        line
        for node in NODES
        for line in (h.job.on_node(node).run_path / "flight.log").read_text().splitlines()
        if "served over Flight" in line
    ]
    assert served, f"no constructor pulled samples from the other host over Flight\n{h.log()}"
    addresses = {h.hosts[n].address for n in NODES}
    r = connect(h.job.redis_url, ride_through_s=0)
    endpoints = {v.decode() for v in r.hgetall(Keys(h.job.name).nodes).values()}
    assert all(any(a in e for e in endpoints) for a in addresses), (addresses, endpoints)


@pytest.mark.slow
def test_a_nodes_roles_killed_while_its_trainer_lives_reads_over_flight_and_back(hosted, corpus_keys):
    ref = _run_clean(hosted())
    h = hosted()
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(sleep="0.2")
    r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)

    def step(dp: int) -> int:
        return int(r.hget(keys.progress, f"c{dp}") or -1)

    def placed() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(keys.placement).items()}

    until(lambda: min(step(d) for d in range(2)) >= 4, h, what="step 4")
    # the sidecar and every role of n1 die at once; its trainer lives on
    trainer = h.trainers[1].pid
    for pid in h.hosts["n1"].pids()[1:]:  # all but the host's init
        if pid != trainer:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    h.sidecars["n1"].wait(timeout=10)
    killed_at = step(1)
    until(lambda: placed()["constructor1"] != "n1", h, what="n1's roles to move to n0")
    until(lambda: step(1) >= killed_at + 3, h, what="dp1 to be built on n0")
    assert h.segments("n1"), "the dead roles' rings stay in n1's /dev/shm until a process of the job runs there"
    h.start_sidecar("n1")  # as systemd would (Restart=always)
    until(lambda: placed()["constructor1"] == "n1", h, what="n1's roles to come home")
    out = h.results(timeout=180)
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.log()}"
        assert rec["digests"] == ref[rank]["digests"], f"rank {rank}: bytes differ from the run without a fault"
    assert out[1]["switches"] >= 2, out[1]  # to n0 over Flight, and back
    assert_delivered(out, corpus_keys, log=h.log)
    assert h.stop() == {n: 0 for n in NODES}, h.log()
    assert {n: h.segments(n) for n in NODES} == {"n0": [], "n1": []}, "segments left on a host"


def _every_sample_once(h: HostedJob, corpus_keys: set[str]) -> None:
    """Every rank ran to its end, and every sample reached the trainers once."""
    out = h.results(timeout=180)
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.log()}"
    assert_delivered(out, corpus_keys, log=h.log)


def _cut_n1_at_step_4(hosted, redis_outage_s: float):
    """A job on both nodes, trainers pacing 0.2 s a step, n1's link cut once both
    groups built step 4; (job, Redis client, keys)."""
    h = hosted(redis_outage_s=redis_outage_s)
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(sleep="0.2")
    r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)
    until(lambda: min(int(r.hget(keys.progress, f"c{d}") or -1) for d in range(2)) >= 4, h, what="step 4")
    h.hosts["n1"].cut()
    return h, r, keys


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [10, 60])
def test_a_node_cut_off_for_a_while_loses_and_repeats_nothing(hosted, corpus_keys, seconds):
    """n1's link down for `seconds`: its roles move to n0 (their heartbeats lapse) and
    back once it answers again; every sample reaches the trainers once."""
    # the cut-off node's trainer waits for the job's Redis past the cut (as a user who
    # rides out partitions this long sets it)
    h, _, _ = _cut_n1_at_step_4(hosted, redis_outage_s=max(60.0, 2.0 * seconds))
    time.sleep(seconds)
    h.hosts["n1"].mend()
    _every_sample_once(h, corpus_keys)


@pytest.mark.slow
def test_a_trainer_started_while_its_node_is_cut_off_waits_for_redis(hosted, corpus_keys):
    """n0's link down as its trainer starts: the trainer's first call to the job's Redis
    (where its Data Constructor host runs) waits for the link, as the roles do, instead
    of failing as an unreachable URL; every sample reaches the trainers once."""
    h = hosted()
    for node in NODES:
        h.start_sidecar(node)
    h.hosts["n0"].cut()
    h.start_trainers(sleep="0.05")
    time.sleep(8)  # past the trainers' start (torch imports) and past n0's heartbeats
    h.hosts["n0"].mend()
    _every_sample_once(h, corpus_keys)
    assert h.stop() == {n: 0 for n in NODES}, h.log()


@pytest.mark.slow
def test_a_host_placed_home_before_its_node_saw_it_leave_is_started_anew(hosted, corpus_keys):
    """n1's link down: n0 fosters its Data Constructor host. The link comes back while
    n1's sidecar is frozen, and the Planner places the host home (n1's heartbeat, as its
    sidecar writes it, makes n1 live) before that sidecar looks at the placement again:
    it never sees its host leave. The old host, fenced out of its group, must stop and
    the sidecar start a new one; it used to stand, and the group waited for ever (one
    run of the 10 s cut in ten)."""
    h = hosted(redis_outage_s=60.0)
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(sleep="0.2")
    r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)
    until(lambda: min(int(r.hget(keys.progress, f"c{d}") or -1) for d in range(2)) >= 4, h, what="step 4")
    node_beat = keys.heartbeat("sidecar", "n1")
    beat = r.get(node_beat)
    assert beat is not None, h.log()

    def fostered() -> bool:
        raw = r.get(keys.heartbeat("constructor", "1"))
        return raw is not None and json.loads(raw).get("node") == "n0"

    # frozen before the cut: no read of the placement is in flight across it (one sent
    # during the cut was answered after the mend, with the placement of then)
    sidecar = h.sidecars["n1"]
    sidecar.send_signal(signal.SIGSTOP)
    try:
        h.hosts["n1"].cut()
        until(fostered, h, what="n1's Data Constructor run on n0", timeout=60)
        h.hosts["n1"].mend()
        r.set(node_beat, beat, ex=60)  # what the frozen sidecar would write
        until(lambda: r.hget(keys.placement, "constructor1") == b"n1", h, what="the host placed home", timeout=30)
        until(lambda: not fostered(), h, what="n0 to stop its foster", timeout=30)
    finally:
        sidecar.send_signal(signal.SIGCONT)
        # the nsenter that waits for it stopped itself when it saw its child stop
        os.kill(sidecar.popen.pid, signal.SIGCONT)
    _every_sample_once(h, corpus_keys)
    assert "another process runs its unit now" in (h.workdir / "sidecar-n1.log").read_text(), h.log()
    assert h.stop() == {n: 0 for n in NODES}, h.log()


@pytest.mark.slow
def test_a_foster_unit_that_does_not_stop_is_killed_and_every_sample_arrives_once(hosted, corpus_keys):
    """n1's link down: n0 fosters its Data Constructor. That process is frozen (SIGSTOP:
    alive, reading nothing, deaf to SIGTERM) before the link is back, as one that would
    not stop. Sent home, it still holds the consumer side of n0's loader ring for n1's
    group, which n0's Flight endpoint then refuses to the group's constructor on n1:
    the job waited for ever. n0's sidecar kills it once its grace is over, and every
    sample reaches the trainers once."""
    h, r, keys = _cut_n1_at_step_4(hosted, redis_outage_s=60.0)

    def fostered() -> dict | None:
        raw = r.get(keys.heartbeat("constructor", "1"))
        beat = json.loads(raw) if raw else None
        return beat if beat and beat.get("node") == "n0" else None

    until(lambda: fostered() is not None, h, what="n1's Data Constructor run on n0", timeout=60)
    time.sleep(3)  # it claims n0's rings of its group
    foster = h.hosts["n0"].machine_pid(fostered()["pid"])
    assert foster is not None, h.log()
    os.kill(foster, signal.SIGSTOP)
    h.hosts["n1"].mend()
    _every_sample_once(h, corpus_keys)
    assert "did not stop within" in (h.workdir / "sidecar-n0.log").read_text(), h.log()
    assert h.stop() == {n: 0 for n in NODES}, h.log()
    assert {n: h.segments(n) for n in NODES} == {"n0": [], "n1": []}, "segments left on a host"


@pytest.mark.slow
def test_a_second_node_failure_before_the_first_node_is_back_loses_and_repeats_nothing(hosted, corpus_keys):
    """Three nodes. n1's sidecar and roles die (its trainer lives): its Data Constructor
    moves to another node and n1's trainer reads from there over Flight. Before n1 is
    back, that node's roles die too: the constructor moves on to the last node, restarts
    from the first step its trainers may not have read whole, and every trainer follows
    it. Both sidecars then come back; every sample reaches the trainers once."""
    nodes = ("n0", "n1", "n2")
    batch = BatchSpec(global_batch=24, micro_batches=2, context_length=512, ring_bytes=128 << 10)
    h = hosted(nodes=nodes, mesh=Mesh(dp=3), batch=batch)
    for node in nodes:
        h.start_sidecar(node)
    h.start_trainers(sleep="0.2")
    r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)

    def placed(unit: str) -> str | None:
        raw = r.hget(keys.placement, unit)
        return raw.decode() if raw is not None else None

    until(lambda: min(int(r.hget(keys.progress, f"c{d}") or -1) for d in range(3)) >= 3, h, what="step 3")
    h.kill_roles("n1")
    until(lambda: placed("constructor1") not in (None, "n1"), h, what="n1's Data Constructor on another node")
    second = placed("constructor1")
    built = int(r.hget(keys.progress, "c1") or -1)
    until(lambda: int(r.hget(keys.progress, "c1") or -1) >= built + 1, h, what=f"dp1 built on {second}")
    h.kill_roles(second)  # the node serving n1's trainer dies before n1 is back
    last = next(n for n in nodes if n not in ("n1", second))
    until(lambda: placed("constructor1") == last, h, what=f"n1's Data Constructor on {last}")
    time.sleep(2.0)  # the job runs on one node's roles for a while
    h.start_sidecar("n1")
    h.start_sidecar(second)
    out = h.results(timeout=240)
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.where()}"
    assert_delivered(out, corpus_keys, log=h.log)
    assert h.stop() == {n: 0 for n in nodes}, h.log()
    assert {n: h.segments(n) for n in nodes} == {n: [] for n in nodes}, "segments left on a host"


@pytest.mark.slow
def test_the_redis_primarys_host_lost_mid_run_the_sentinels_fail_over_and_nothing_is_lost(hosted, corpus_keys):
    """The job's Redis is a primary and a replica on hosts of their own, watched by
    three Sentinels; the primary's host vanishes mid-run (its Sentinel with it): the
    two Sentinels left promote the replica, every role and trainer finds it through
    them, and every sample reaches the trainers once. The last step the Planner had
    acknowledged as durable before the loss is still there after it."""
    h = hosted(sentinel=True)
    for node in NODES:
        h.start_sidecar(node)
    h.start_trainers(sleep="0.1")
    r, keys = connect(h.job.redis_url, timeout_s=2, ride_through_s=60), Keys(h.job.name)
    until(lambda: min(int(r.hget(keys.progress, f"c{d}") or -1) for d in range(2)) >= 4, h, what="step 4")
    acknowledged = int(r.hget(keys.planner, PLANNER_DURABLE))
    assert h.sentinels is not None
    lost = h.sentinels.kill_primary()
    out = h.results(timeout=240)
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{h.log()}"
    assert_delivered(out, corpus_keys, log=h.log)
    assert h.sentinels.primary() != lost
    assert int(r.hget(keys.planner, PLANNER_DURABLE)) >= acknowledged  # no acknowledged step went back
    Checkpoints(keys).load(r, acknowledged + 1)  # its checkpoint survived the failover (PlanError if not)
    assert h.stop() == {n: 0 for n in NODES}, h.log()


def test_a_node_whose_dev_shm_is_full_is_refused_at_start_naming_the_fix(hosted):
    """The node's own /dev/shm (a tmpfs of its mount namespace) filled to 1 MiB free:
    its sidecar refuses to start, naming the bytes its rings need and the fix, before
    any ring is used (no SIGBUS later)."""
    h = hosted()
    h.start_sidecar("n0")
    filler = h.hosts["n1"].fill_shm(leave_bytes=1 << 20)
    proc = h.hosts["n1"].run(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(h.config), "--node", "n1"],
        env=h.env("n1"),
        log=h.workdir / "sidecar-n1.log",
    )
    assert proc.wait(timeout=60) != 0
    text = (h.workdir / "sidecar-n1.log").read_text()
    assert "/dev/shm" in text and ("size=" in text or "shm-size" in text), text[-2000:]
    assert not h.segments("n1"), "a refused sidecar left segments behind"
    filler.unlink()


@pytest.mark.slow
def test_streams_handed_to_a_loader_process_on_the_other_host_lose_and_repeat_nothing(hosted, corpus_keys):
    from overlord.planner.request import request_handoff
    from overlord.runtime.layout import Layout
    from overlord.store.schema import log_entries

    h = hosted()
    h.start(sleep="0.1")
    r, keys = connect(h.job.redis_url, ride_through_s=0), Keys(h.job.name)
    until(lambda: r.get(keys.plan(2)) is not None, h, what="the first plans")
    placed = {k.decode(): v.decode() for k, v in r.hgetall(keys.placement).items()}
    assert placed["loader0"] != placed["loader1"], placed  # one loader process a host
    layout = Layout.plan(h.job)
    on0 = [n for n, k in zip(layout.streams, layout.loader_of) if k == 0]
    on1 = [n for n, k in zip(layout.streams, layout.loader_of) if k == 1]
    # a stream of each host's process to the other's, and the first one back
    for stream, to in ((on0[0], 1), (on1[0], 0), (on0[0], 0)):
        code, message = request_handoff(r, keys, stream, to, timeout_s=30)
        assert code == 0, f"{message}\n{h.log()}"
    taken = [e for e in log_entries(r.xrange(keys.handoffs)) if e["from"] != e["to"]]
    out = h.finish()
    assert [(e["stream"], e["to"]) for e in taken] == [(on0[0], "1"), (on1[0], "0"), (on0[0], "0")], taken
    assert_delivered(out, corpus_keys, log=h.log)
    logs = "".join(
        (h.job.on_node(node).run_path / f"loader{k}.log").read_text()
        for node in NODES
        for k in (0, 1)
        if (h.job.on_node(node).run_path / f"loader{k}.log").exists()
    )
    assert f"serving stream(s) ['{on0[0]}'] from step" in logs, logs[-3000:]
