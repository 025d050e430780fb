"""The pure parts of a rewind of a job on several nodes (overlord.sidecar.rewind): what a
sidecar does at boot, whom the barrier waits for, what a publish keeps, and the
positions a rewound run starts from."""

from __future__ import annotations

import time

import pytest

from overlord.config import Job, Mesh, Source
from overlord.sidecar import rewind
from overlord.store import Keys
from overlord.store.schema import asked_field, encode_rewind, rewind_published, stopped_field, stopped_nodes

KEYS = Keys("job")


@pytest.mark.parametrize(
    ("rewinding", "under_way", "published", "others_live", "stored", "action"),
    [
        (False, False, None, False, False, rewind.START),  # the first sidecar of a job
        (False, False, None, False, True, rewind.START),  # a stopped job started again (its keys are stale)
        (False, False, None, True, True, rewind.JOIN),  # a node joining the running job
        (False, True, None, True, True, rewind.JOIN),  # (a sidecar takes part in a rewind only past its barrier)
        (True, True, None, True, True, rewind.REPUBLISH),  # the first one back from the barrier
        (True, True, None, False, True, rewind.REPUBLISH),  # ... also alone (the other node is lost)
        (True, True, "n1", True, True, rewind.JOIN),  # another one published the rewound run
        (True, False, None, True, True, rewind.JOIN),  # decided while it waited: the rewound run runs
        (True, True, None, False, False, rewind.START),  # nothing stored to go back to: lay the job out
    ],
)
def test_boot_action(rewinding, under_way, published, others_live, stored, action):
    got = rewind.boot_action(
        rewinding=rewinding, under_way=under_way, published=published, others_live=others_live, stored=stored
    )
    assert got == action


def test_the_barrier_waits_for_every_live_node_that_has_not_stopped():
    assert rewind.pending({"n0", "n1", "n2"}, {"n1"}) == ["n0", "n2"]
    assert rewind.pending({"n0"}, {"n0", "n1"}) == []  # a stopped node that died since is not waited for
    assert rewind.pending(set(), set()) == []


def test_a_publish_keeps_the_checkpoints_on_a_resume_and_the_rewind_and_fence_on_a_rewind():
    fresh = rewind.kept(KEYS, resume=False, rewinding=False, autoscale=False)
    assert fresh == {KEYS.profile.encode(), KEYS.boot.encode()}
    resumed = rewind.kept(KEYS, resume=True, rewinding=False, autoscale=True)
    assert {KEYS.ckpt.encode(), KEYS.ckpt_delta.encode(), KEYS.ckpt_layout.encode(), KEYS.autoscale.encode()} <= resumed
    assert KEYS.fence.encode() not in resumed and KEYS.rewind.encode() not in resumed
    rewound = rewind.kept(KEYS, resume=False, rewinding=True, autoscale=False)
    assert {KEYS.ckpt.encode(), KEYS.rewind.encode(), KEYS.fence.encode(), KEYS.flight_token.encode()} <= rewound
    # the positions start again from the asks: the resume hash of the run before goes
    assert KEYS.resume.encode() not in rewound


def test_a_rewind_forgets_role_heartbeats_and_keeps_the_sidecars():
    keep = rewind.kept(KEYS, resume=False, rewinding=True, autoscale=False)
    sidecar = KEYS.heartbeat("sidecar", "n1").encode()
    planner = KEYS.heartbeat("planner", "0").encode()
    assert not rewind.forgets(sidecar, keep, KEYS, rewinding=True)
    assert rewind.forgets(planner, keep, KEYS, rewinding=True)
    assert rewind.forgets(sidecar, keep, KEYS, rewinding=False)  # a fresh start: no other node is live
    assert not rewind.forgets(KEYS.fence.encode(), keep, KEYS, rewinding=True)
    assert rewind.forgets(KEYS.plan(3).encode(), keep, KEYS, rewinding=True)


def test_the_rewound_run_starts_from_the_positions_the_trainers_asked_with():
    state = {
        asked_field(0).encode(): encode_rewind(11, (20, 0)).encode(),
        asked_field(3).encode(): encode_rewind(12, (22, 1)).encode(),
        stopped_field("n0").encode(): b"1700000000.000",
        b"published": b"n1",
    }
    assert rewind.asked_positions(state) == {0: [20, 0], 3: [22, 1]}
    assert stopped_nodes(state) == {"n0"}
    assert rewind_published(state) == "n1"
    assert rewind_published({}) is None


def test_a_node_late_to_a_decided_rewind_marks_nothing_and_goes_through_the_barrier(r, tmp_path):
    """A rewind's hash goes once its step is decided. A node whose sidecar reaches the
    barrier after that (its link was cut while the others went through) must not write
    its `stopped` mark: the mark alone would be a new rewind no trainer asked for, which
    every sidecar stops for, and whose positions never come (found by random link cuts
    and trainer restarts on two namespaced hosts)."""
    r.hset(KEYS.rewind, asked_field(0), encode_rewind(11, (24, 1)))
    noted = rewind.mark_stopped(r, KEYS, "n1")  # under way: noted
    assert stopped_nodes(r.hgetall(KEYS.rewind)) == {"n1"}
    r.delete(KEYS.rewind)  # decided: the rewound run runs
    late = rewind.mark_stopped(r, KEYS, "n0")
    assert not rewind.under_way(r, KEYS), "a late mark made a new rewind"
    assert (noted, late) == (True, False)
    job = Job(
        name="job",
        sources=(Source(name="web", paths=(str(tmp_path / "web.jsonl"),)),),
        mesh=Mesh(dp=2),
        nodes=("n0", "n1"),
        node="n0",
        redis_url="redis://127.0.0.1:1/0",
        flight_port=28815,
        timeout_s=5.0,
    )
    started = time.monotonic()
    rewind.await_stopped(job, r, KEYS, lambda: {"n0", "n1"}, lambda: None)  # returns: nothing to wait for
    assert time.monotonic() - started < 2
    assert not rewind.under_way(r, KEYS)
