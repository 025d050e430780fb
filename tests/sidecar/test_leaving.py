"""Units that stop here (overlord.sidecar.membership):

- one placed on another node: SIGTERM, and past a grace its stacks are dumped to its
  log and it is killed (Membership.retire);
- one that exits SUPERSEDED (another process took it over while its node was out of
  Redis's reach) is no failure: the sidecar forgets it and starts it again once it is
  placed here and no live process of it beats elsewhere (Membership.forget_superseded,
  then Membership.follow). Before, it stood stopped, and its DP group with it.

Real forked children stand in for the roles (one ignores SIGTERM as a role whose thread
never turns back to its stop event does), against a real Redis where one is needed; a
new role's fork is recorded instead of run (it would need a whole job)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import pytest

from overlord import BatchSpec, Job, Mesh, Source
from overlord.sidecar import membership
from overlord.sidecar.membership import Membership
from overlord.sidecar.role import SUPERSEDED, superseded_note
from overlord.sidecar.spawn import RoleProcess
from overlord.sidecar.supervision import Roles
from overlord.store import Keys
from overlord.store.schema import PLANNER_STEP, encode_active


def _job(tmp_path) -> Job:
    return Job(
        name="leave",
        sources=(Source(name="a", paths=(str(tmp_path / "x"),)),),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=4),
        nodes=("n0", "n1"),
        node="n0",
        redis_url="redis://127.0.0.1:1/0",
        flight_port=8815,
    )


def _child(log, ignore_term: bool) -> RoleProcess:
    """A forked process that registers the role's stack dump and sleeps; returned once
    its handlers are set."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        return RoleProcess("constructor1", pid)
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)
        os.write(ready_w, b"1")
        deadline = time.monotonic() + 60  # bounded: the test kills it long before
        while time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os._exit(0)


def _membership(tmp_path) -> tuple[Membership, Roles]:
    job = _job(tmp_path)
    roles = Roles(job, Keys(job.name), tmp_path)
    return Membership(job, Keys(job.name), roles), roles


def _retire_until(m: Membership, roles: Roles, name: str, timeout: float) -> float:
    """Call retire as the sidecar's loop does until `name` is forgotten; the seconds it took."""
    start = time.monotonic()
    while name in roles.children:
        assert time.monotonic() - start < timeout, f"{name} still watched after {timeout}s"
        m.retire(roles.codes())
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_unit_that_stops_on_sigterm_is_forgotten_without_a_kill(tmp_path):
    m, roles = _membership(tmp_path)
    proc = _child(tmp_path / "role.log", ignore_term=False)
    roles.children["constructor1"] = proc
    proc.terminate()
    m.leaving["constructor1"] = time.monotonic()
    _retire_until(m, roles, "constructor1", timeout=membership.STOP_GRACE_S)
    assert proc.returncode == -signal.SIGTERM
    assert "constructor1" not in m.leaving
    assert "Thread" not in (tmp_path / "role.log").read_text()  # no stacks: it stopped in time


def test_a_unit_that_ignores_sigterm_dumps_its_stacks_and_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(membership, "STOP_GRACE_S", 0.5)
    m, roles = _membership(tmp_path)
    proc = _child(tmp_path / "role.log", ignore_term=True)
    roles.children["constructor1"] = proc
    proc.terminate()
    m.leaving["constructor1"] = time.monotonic()
    took = _retire_until(m, roles, "constructor1", timeout=10)
    assert took >= 0.5 + membership.DUMP_S  # the grace, then the time for the dump
    assert proc.returncode == -signal.SIGKILL
    assert "constructor1" not in m.leaving
    stacks = (tmp_path / "role.log").read_text()
    assert "most recent call first" in stacks and "_child" in stacks  # where it waited


def _exited(code: int, note: Path | None = None, name: str = "constructor0") -> RoleProcess:
    """A forked child started as `name` that exits `code` (having written its pid to
    `note`, as a role that stopped superseded does)."""
    pid = os.fork()
    if pid == 0:
        if note is not None:
            note.write_text(str(os.getpid()))
        os._exit(code)
    proc = RoleProcess(name, pid)
    deadline = time.monotonic() + 10
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    return proc


def test_a_superseded_unit_placed_here_starts_again_once_its_other_process_is_gone(tmp_path, r):
    m, roles = _membership(tmp_path)
    keys = m.keys
    started = []
    roles.spawn = lambda role, index, attempt=0: started.append((role, index, attempt))
    r.hset(keys.planner, PLANNER_STEP, 41)  # the job runs: a new process recovers from Redis

    roles.children["constructor0"] = _exited(SUPERSEDED, superseded_note(tmp_path, "constructor0"))
    codes = roles.codes()
    m.forget_superseded(codes)
    assert codes == {} and roles.children == {}, "a superseded exit is no failure and not watched"
    assert not superseded_note(tmp_path, "constructor0").exists()

    # the process that took it over (on n1) still beats: nothing starts here yet
    foster = {"pid": os.getpid(), "node": "n1", "time": time.time()}
    r.set(keys.heartbeat("constructor", "0"), json.dumps(foster), ex=30)
    m.follow(r, {"constructor0": "n0", "constructor1": "n1"})
    assert started == []
    r.delete(keys.heartbeat("constructor", "0"))  # it stopped (placed back here)
    r.hset(keys.rewind, "asked", 1)  # but the job goes back: the rewind starts every role anew
    m.follow(r, {"constructor0": "n0", "constructor1": "n1"})
    assert started == []
    r.delete(keys.rewind)
    m.follow(r, {"constructor0": "n0", "constructor1": "n1"})
    assert started == [("constructor", 0, 1)]


def test_a_shadow_promoted_here_then_superseded_is_no_failure(tmp_path):
    """A shadow promoted on this node is watched as its loader (`Roles.adopt`), but the
    process notes its takeover under the name it was started as. Two nodes' chaos found
    it: the promoted shadow was superseded by the loader its node's restarted sidecar
    started from the placement it joined with, and this sidecar took the exit for a
    failure and ended the job."""
    m, roles = _membership(tmp_path)
    proc = _exited(SUPERSEDED, superseded_note(tmp_path, "shadow1"), name="shadow1")
    roles.children["shadow1"] = proc
    roles.adopt({b"1": encode_active(proc.pid, "n0").encode()})
    assert list(roles.children) == ["loader1"]
    codes = roles.codes()
    m.forget_superseded(codes)
    assert codes == {} and roles.children == {}, "a superseded exit is no failure and not watched"
    assert m.superseded == {"loader1"}, "the loader unit starts again while placed here"
    assert not superseded_note(tmp_path, "shadow1").exists()


def test_a_promoted_shadow_that_fails_is_named_with_the_log_it_wrote(tmp_path):
    """The job's error for a promoted shadow points at the log the process writes
    (`shadow<k>.log`, named when it was forked), not at a `loader<k>.log` that does not
    exist."""
    m, roles = _membership(tmp_path)
    proc = _exited(1, name="shadow1")
    roles.children["shadow1"] = proc
    roles.adopt({b"1": encode_active(proc.pid, "n0").encode()})
    message = roles.failure_message("loader1", 1)
    assert f"see {tmp_path / 'shadow1.log'}" in message and "loader1.log" not in message, message


def test_a_unit_that_stopped_of_itself_or_failed_is_not_forgotten_as_superseded(tmp_path):
    """Exit 0, 1, or 3 without the note: a transform may call os._exit(3) in a loader
    process, and the sidecar must name that death, not take it for a takeover."""
    m, roles = _membership(tmp_path)
    for code in (0, 1, SUPERSEDED):
        roles.children["constructor0"] = _exited(code)
        codes = roles.codes()
        m.forget_superseded(codes)
        assert codes == {"constructor0": code} and "constructor0" in roles.children


def test_a_placement_of_a_run_published_without_this_node_is_not_followed(tmp_path, r):
    """The job was published again while this node was cut off (a rewind decided
    without it): the new run's placement is not this node's to follow beside its old
    run's rings and roles. Nothing starts or stops; the sidecar hears Republished (and
    joins the new run). While the job is being published (no run token yet) it waits."""
    m, roles = _membership(tmp_path)
    keys = m.keys
    started = []
    roles.spawn = lambda role, index, attempt=0: started.append((role, index, attempt))
    child = _child(tmp_path / "role.log", ignore_term=False)
    roles.children["constructor1"] = child  # this node runs a unit the new run placed on n1
    r.hset(keys.placement, mapping={"constructor0": "n0", "constructor1": "n1"})
    roles.run = b"old-run"
    try:
        r.set(keys.run, b"new-run")
        with pytest.raises(membership.Republished):
            m.follow(r)
        r.delete(keys.run)  # being published right now
        m.follow(r)
        assert started == [] and not m.leaving and child.poll() is None
        r.set(keys.run, b"old-run")  # its own run: followed
        m.follow(r)
        assert started == [("constructor", 0, 0)] and "constructor1" in m.leaving
    finally:
        child.kill()
        child.wait(timeout=10)
