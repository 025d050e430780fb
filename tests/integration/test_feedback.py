"""Feedback within plan_ahead steps (issue 16, item 8), with real processes: the Planner
plans at most plan_ahead steps past what the trainers consumed, whatever the ring size,
so a loss reported with DataLoader.report_metrics at step t shapes the plan of step
t + plan_ahead + 1 at the latest. The schedule is the shipped dynamic one
(`mixing: {kind: dynamic}`, loss_proportional): a loss of 30 on books against 0
elsewhere gives books e^22.5 times the others' weight, so from the first plan that
read it every sample is a book; under the base weights (books 0.2) a step of 16 books
has odds 0.2^16."""

from __future__ import annotations

import json

import pytest
from meta_trainer import results, start

from overlord import BatchSpec, Mesh

pytestmark = pytest.mark.timeout(240)

REPORT_AT = 12
LOSSES = json.dumps({"loss/books": 30.0, "loss/web": 0.0, "loss/code": 0.0, "loss/images": 0.0})


def first_all_books(batches: list[dict]) -> int | None:
    steps: dict[int, list[str]] = {}
    for b in batches:
        steps.setdefault(b["step"], []).extend(b["keys"])
    return min((s for s, keys in steps.items() if all(k.startswith("books:") for k in keys)), default=None)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
@pytest.mark.parametrize("plan_ahead", [1, 4])
@pytest.mark.parametrize("ring_bytes", [1 << 20, 16 << 20])
def test_a_reported_loss_shapes_the_plan_within_plan_ahead_steps(cluster, tmp_path, ring_bytes, plan_ahead):
    c = cluster(
        mesh=Mesh(dp=2),
        plan_ahead=plan_ahead,
        mixing={"kind": "dynamic", "every": 1},
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=ring_bytes),
    )
    c.start_sidecar()
    outs = {r: tmp_path / f"rank{r}.json" for r in range(2)}
    steps = REPORT_AT + plan_ahead + 6
    # a trainer slower than the loaders: rings (hundreds of steps at 16 MiB) would fill far ahead
    procs = {
        r: start(c, r, outs[r], batches=2 * steps, sleep=0.02, report_at=REPORT_AT, report=LOSSES) for r in range(2)
    }
    got = results(procs, outs)
    for rank, rec in got.items():
        assert rec["end"] == "limit" and rec["reported"] == REPORT_AT, f"rank {rank}: {rec['end']}\n{c.log()}"
        first = first_all_books(rec["batches"])
        assert first is not None, f"rank {rank}: no step followed the reported loss\n{c.log()}"
        # no plan made before the report can use it, and the bound makes the next ones wait for it
        assert REPORT_AT < first <= REPORT_AT + plan_ahead + 1, (rank, first, plan_ahead)
        later = [b for b in rec["batches"] if b["step"] > REPORT_AT + plan_ahead + 1]
        assert later and all(k.startswith("books:") for b in later for k in b["keys"])
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_rank_read_over_flight_is_bounded_too_and_does_not_stall_the_job(cluster, tmp_path):
    from harness import free_port

    port, plan_ahead = free_port(), 2
    c = cluster(
        mesh=Mesh(dp=2),
        plan_ahead=plan_ahead,
        mixing={"kind": "dynamic", "every": 1},
        flight_port=port,
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=16 << 20),
    )
    c.start_sidecar()
    outs = {r: tmp_path / f"rank{r}.json" for r in range(2)}
    steps = REPORT_AT + 30
    procs = {
        r: start(
            c,
            r,
            outs[r],
            batches=2 * steps,
            sleep=0.02,
            report_at=REPORT_AT,
            report=LOSSES,
            **({"remote": f"grpc://127.0.0.1:{port}"} if r == 1 else {}),
        )
        for r in range(2)
    }
    got = results(procs, outs)
    firsts = {}
    for rank, rec in got.items():
        assert rec["end"] == "limit", f"rank {rank}: {rec['end']}\n{c.log()}"
        firsts[rank] = first_all_books(rec["batches"])
    # the Flight endpoint marks a batch consumed when gRPC takes it to send, a few
    # micro-batches before the trainer has it: the bound holds up to that
    assert all(f is not None and REPORT_AT < f <= REPORT_AT + plan_ahead + 1 + 4 for f in firsts.values()), firsts
    assert c.stop() == 0
