"""A unit placed on another node stops here: SIGTERM, and past a grace its stacks are
dumped to its log and it is killed (overlord.sidecar.membership Membership.retire).

A real forked child stands in for the role; it ignores SIGTERM as a role whose thread
never turns back to its stop event does."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

from overlord import BatchSpec, Job, Mesh, Source
from overlord.sidecar import membership
from overlord.sidecar.membership import Membership
from overlord.sidecar.spawn import RoleProcess
from overlord.sidecar.supervision import Roles
from overlord.store import Keys


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
