"""Fault injection under a running 4-rank job, with a sample-key ledger.

Each test kills one part with SIGKILL part-way through a one-epoch job and checks that
every rank still receives exactly the bytes of a run with no fault (hence every sample
exactly once), that the job ends on its own, and (through the `cluster` fixture) that
no shared-memory segment is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import pytest

from overlord import BatchSpec, Mesh
from overlord.errors import StoreError
from overlord.sidecar.sidecar import sidecar_running
from overlord.status import redis_url_of
from overlord.store import Keys, connect
from overlord.store.schema import decode_active

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # make test-slow

JOB = dict(
    seed=3,
    epochs=1,
    mesh=Mesh(dp=4),
    loader_processes=2,
    plan_ahead=2,
    timeout_s=30.0,
    batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)
SLEEP = "0.04"  # per batch: the job runs ~3 s, long enough to hit it in the middle


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Every rank's ledger in a run with no fault."""
    from harness import clean_run, make_job

    tmp = tmp_path_factory.mktemp("reference")
    return clean_run(make_job(corpus, tmp / "run", **JOB), tmp)


def _redis(c):
    socket = c.job.run_path / "redis.sock"
    deadline = time.monotonic() + 30
    while not socket.exists():  # the sidecar holds its lock before its Redis answers
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.02)
    return connect(redis_url_of(c.job), timeout_s=5)


def _wait_step(c, step: int, timeout: float = 60) -> None:
    """Wait until every Data Constructor has written `step`."""
    r, keys = _redis(c), Keys(c.job.name)
    deadline = time.monotonic() + timeout
    while True:
        progress = r.hgetall(keys.progress)
        if all(int(progress.get(f"c{d}".encode(), -1)) >= step for d in range(c.job.mesh.dp)):
            return
        assert time.monotonic() < deadline, f"the job did not reach step {step}: {progress}\n{c.log()}"
        time.sleep(0.02)


def _pid_of(c, role: str, index: int = 0) -> int:
    raw = _redis(c).get(Keys(c.job.name).heartbeat(role, str(index)))
    assert raw is not None, f"no heartbeat of {role}{index}"
    return json.loads(raw)["pid"]


def _until(condition, c, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.02)


def _check(c, reference, corpus_keys, results=None) -> dict:
    out = results or c.results(timeout=120)
    seen = []
    for rank, rec in out.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{c.log()}"
        if rec["digests"] != reference[rank]["digests"]:
            at = next((i for i, (a, b) in enumerate(zip(rec["digests"], reference[rank]["digests"])) if a != b), None)
            raise AssertionError(
                f"rank {rank}: bytes differ from the run without a fault at batch {at} "
                f"({len(rec['digests'])} vs {len(reference[rank]['digests'])} batches; steps {rec['steps'][at - 1 : at + 2] if at else ''})\n{c.log()}"
            )
    for rank in range(c.job.mesh.dp):
        seen += [k for batch in out[rank]["keys"] for k in batch]
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert set(seen) == corpus_keys, "a sample was lost"
    return out


def _running(c):
    """Start the sidecar and trainers; return once every constructor passed step 8."""
    c.start_sidecar()
    c.start_trainers(sleep=SLEEP)
    _wait_step(c, 8)
    return _redis(c), Keys(c.job.name)


def _kill_role_and_check(c, reference, corpus_keys, role: str, index: int = 0) -> dict:
    _running(c)
    pid = _pid_of(c, role, index)
    os.kill(pid, signal.SIGKILL)
    out = _check(c, reference, corpus_keys)
    assert c.stop() == 0, c.log()
    return out


def test_loader_with_shadow_is_replaced_by_its_promoted_shadow(cluster, corpus, reference, corpus_keys):
    sources = tuple(replace(s, shadow=True) for s in _sources(corpus))
    c = cluster(**JOB, sources=sources)
    r, keys = _running(c)
    shadow = _pid_of(c, "shadow", 0)
    os.kill(_pid_of(c, "loader", 0), signal.SIGKILL)
    _until(lambda: r.xrange(keys.promotions), c)
    promotion = r.xrange(keys.promotions)[0][1]
    assert int(promotion[b"pid"]) == shadow and decode_active(r.hget(keys.active, 0))[0] == shadow, promotion
    _check(c, reference, corpus_keys)
    assert c.stop() == 0, c.log()


def test_loader_without_shadow_is_restarted_from_the_planner_cursors(cluster, reference, corpus_keys):
    c = cluster(**JOB)
    _kill_role_and_check(c, reference, corpus_keys, "loader", 1)


def test_planner_is_restarted_from_its_checkpoint_under_a_new_lease(cluster, reference, corpus_keys):
    c = cluster(**JOB)
    r, keys = _running(c)
    token = json.loads(r.get(keys.leader))["token"]
    generation = int(r.hget(keys.planner, "token"))
    os.kill(_pid_of(c, "planner"), signal.SIGKILL)
    _until(lambda: int(r.hget(keys.planner, "token") or 0) > generation, c)  # a new leader reports in
    assert int(r.hget(keys.restarts, "planner0")) == 1
    assert json.loads(r.get(keys.leader))["token"] > token, "a new lease, with a higher fencing token"
    _check(c, reference, corpus_keys)
    assert c.stop() == 0, c.log()


def test_constructor_is_restarted_and_trainers_drop_what_they_had(cluster, reference, corpus_keys):
    c = cluster(**JOB)
    _kill_role_and_check(c, reference, corpus_keys, "constructor", 0)


def test_redis_server_killed_and_restarted_loses_nothing(cluster, reference, corpus_keys):
    from overlord.store.server import server_pids as _redis_pids

    c = cluster(**JOB)
    _running(c)
    (pid,) = _redis_pids(c.job.run_path)
    os.kill(pid, signal.SIGKILL)
    _check(c, reference, corpus_keys)
    assert _redis_pids(c.job.run_path) != [pid], "the sidecar restarts its redis-server"
    assert c.stop() == 0, c.log()


def test_redis_server_killed_while_the_sidecar_starts_its_roles_loses_nothing(cluster, reference, corpus_keys):
    """Killed once the job is published, the embedded server dies while the sidecar
    creates the rings and starts its roles, before its loop watches: the command that finds it
    gone starts it again (the sidecar's client rode through 1 s, then the sidecar died
    with a traceback and the trainers found no sidecar)."""
    from overlord.store.server import server_pids as _redis_pids

    c = cluster(**JOB)
    c.start_sidecar(wait=False)

    def published() -> bool:  # the sidecar reached its server: it publishes, then starts the roles
        try:
            return bool(connect(redis_url_of(c.job), timeout_s=1, ride_through_s=0).exists(Keys(c.job.name).job_config))
        except StoreError:
            return False

    _until(published, c)
    (pid,) = _redis_pids(c.job.run_path)
    os.kill(pid, signal.SIGKILL)
    _until(lambda: sidecar_running(c.job) or c.sidecar.poll() is not None, c)
    c.start_trainers(sleep=SLEEP)
    _check(c, reference, corpus_keys)
    assert _redis_pids(c.job.run_path) != [pid]
    log = c.log()
    restarted = log.find("died; starting it again")
    assert 0 <= restarted < log.find("loader process(es)"), f"not restarted while the sidecar started\n{log}"
    assert c.stop() == 0, log


def test_whole_sidecar_killed_trainers_restart_it_and_resume(cluster, reference, corpus_keys):
    c = cluster(**JOB)
    c.start_trainers(sleep=SLEEP, spawn=1)
    deadline = time.monotonic() + 60
    while not sidecar_running(c.job):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _wait_step(c, 8)
    pid = int((c.job.run_path / "sidecar.lock").read_text())
    os.kill(pid, signal.SIGKILL)
    out = _check(c, reference, corpus_keys)
    assert all(rec["recoveries"] == 1 for rec in out.values()), {r: rec["recoveries"] for r, rec in out.items()}
    deadline = time.monotonic() + 60
    while sidecar_running(c.job):  # the spawned sidecar leaves with its trainers
        assert time.monotonic() < deadline, "the spawned sidecar did not exit"
        time.sleep(0.1)


def test_trainer_rank_killed_all_resume_from_their_last_state_dict(cluster, reference, corpus_keys, tmp_path):
    c = cluster(**JOB)
    states = {r: str(tmp_path / f"state{r}.json") for r in range(4)}
    c.start_trainers(sleep=SLEEP, spawn=1, **{"save-every": 5})

    def saved(r) -> int:
        try:
            return json.loads(c.out(r).read_text())["state"]["batches"]
        except (OSError, KeyError, ValueError):
            return 0

    deadline = time.monotonic() + 60
    while not all(saved(r) >= 20 for r in range(4)):
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.05)
    os.kill(c.trainers[2].pid, signal.SIGKILL)  # rank 2 dies; torchrun then stops the others
    for r in (0, 1, 3):
        c.trainers[r].send_signal(signal.SIGKILL)
    for proc in c.trainers.values():
        proc.wait(timeout=30)
    first = {r: json.loads(c.out(r).read_text()) for r in range(4)}
    for r in range(4):
        with open(states[r], "w") as fh:
            json.dump(first[r]["state"], fh)
    deadline = time.monotonic() + 60
    while sidecar_running(c.job):  # every trainer left: the spawned sidecar exits
        assert time.monotonic() < deadline, "the spawned sidecar did not exit"
        time.sleep(0.1)
    c.trainers.clear()
    for r in range(4):
        c.start_trainers(ranks=[r], sleep="0", spawn=1, **{"load-state": states[r]})
    second = c.results(timeout=120)
    merged = {
        r: {
            "end": second[r]["end"],
            "digests": first[r]["digests"] + second[r]["digests"],
            "keys": first[r]["keys"] + second[r]["keys"],
        }
        for r in range(4)
    }
    _check(c, reference, corpus_keys, merged)
    deadline = time.monotonic() + 60
    while sidecar_running(c.job):
        assert time.monotonic() < deadline, "the spawned sidecar did not exit"
        time.sleep(0.1)


def _sources(corpus):
    from harness import make_job

    return make_job(corpus, "/tmp/unused").sources
