"""A unit that exits SUPERSEDED (another process took it over while its node was out of
Redis's reach) is no failure: the sidecar forgets it and starts it again once it is
placed here and no live process of it beats elsewhere (Membership.forget_superseded,
then Membership.follow). Before, it stood stopped, and its DP group with it.

A real forked child stands in for the stale role, against a real Redis; the new role's
fork is recorded instead of run (it would need a whole job)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from overlord import BatchSpec, Job, Mesh, Source
from overlord.sidecar.membership import Membership
from overlord.sidecar.role import SUPERSEDED, superseded_note
from overlord.sidecar.spawn import RoleProcess
from overlord.sidecar.supervision import Roles
from overlord.store import EmbeddedRedis, Keys, connect
from overlord.store.schema import PLANNER_STEP


@pytest.fixture
def r(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield connect(server.url)
    finally:
        server.stop()


def _job(tmp_path, name: str) -> Job:
    """A job of two nodes, seen from n0 (the home of constructor0)."""
    return Job(
        name=name,
        sources=(Source(name="a", paths=(str(tmp_path / "x"),)),),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=4),
        nodes=("n0", "n1"),
        node="n0",
        redis_url="redis://127.0.0.1:1/0",
        flight_port=8815,
    )


def _exited(code: int, note: Path | None = None) -> RoleProcess:
    """A forked child that exits `code` (having written its pid to `note`, as a role
    that stopped superseded does)."""
    pid = os.fork()
    if pid == 0:
        if note is not None:
            note.write_text(str(os.getpid()))
        os._exit(code)
    proc = RoleProcess("constructor0", pid)
    deadline = time.monotonic() + 10
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    return proc


def test_a_superseded_unit_placed_here_starts_again_once_its_other_process_is_gone(tmp_path, r):
    job = _job(tmp_path, "sup")
    keys = Keys(job.name)
    roles = Roles(job, keys, tmp_path)
    m = Membership(job, keys, roles)
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


def test_a_unit_that_stopped_of_itself_or_failed_is_not_forgotten_as_superseded(tmp_path):
    """Exit 0, 1, or 3 without the note: a transform may call os._exit(3) in a loader
    process, and the sidecar must name that death, not take it for a takeover."""
    job = _job(tmp_path, "sup2")
    roles = Roles(job, Keys(job.name), tmp_path)
    m = Membership(job, Keys(job.name), roles)
    for code in (0, 1, SUPERSEDED):
        roles.children["constructor0"] = _exited(code)
        codes = roles.codes()
        m.forget_superseded(codes)
        assert codes == {"constructor0": code} and "constructor0" in roles.children
