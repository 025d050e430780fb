"""Online repartitioning: the partitions a source is read by follow the mixing schedule,
decided at step boundaries from the schedule, the costs and the budget alone."""

from __future__ import annotations

import numpy as np

from overlord.autoscale.partition import Budget, SourceCost, partition
from overlord.autoscale.repartition import Repartitioner

NAMES = ("video", "images", "text")
COSTS = [
    SourceCost(name="video", weight=1.0, transform_ms=40.0),
    SourceCost(name="images", weight=0.1, transform_ms=30.0),
    SourceCost(name="text", weight=1.0, transform_ms=0.5),
]
BUDGET = Budget(cpus=16, memory_mb=16000, cluster_size=1, max_workers_per_loader=1)
TURN = 40  # the schedule turns from video to images here


def weights(step: int) -> np.ndarray:
    return np.array([1.0, 0.1, 1.0]) if step < TURN else np.array([0.1, 1.0, 1.0])


def start() -> dict[str, int]:
    mixes = [dict(zip(NAMES, map(float, weights(s)))) for s in (0, TURN)]
    return {s.name: s.partitions for s in partition(COSTS, BUDGET, mixtures=mixes).sources}


def make(**kw) -> Repartitioner:
    args = dict(interval=4, horizon=8, patience=2)
    args.update(kw)
    return Repartitioner(COSTS, BUDGET, weights, start(), **args)


def run(rp: Repartitioner, steps: int, live: dict[str, int]) -> list[tuple[int, str, int]]:
    """Every look to `steps`, each move applied to `live` as the Planner would."""
    moves = []
    for step in range(1, steps):
        move = rp.look(step, live)
        if move is not None:
            name, parts, why = move
            assert why.startswith("autoscaler: the mixing schedule of steps")
            moves.append((step, name, parts))
            live[name] = parts
    return moves


def test_partitions_follow_the_schedule_once_it_settles():
    live = start()
    assert live["video"] > 1 and live["images"] > 1  # the start sizes both for their peaks
    moves = run(make(), 120, live)
    # before the turn comes into the horizon, both were sized for their shares at once:
    # images (0.1 of the mix) goes down first, then video, once the turn passed
    assert moves, moves
    assert all(step % 4 == 0 for step, _, _ in moves)
    names = [name for _, name, _ in moves]
    assert "images" in names and "video" in names and "text" not in names
    assert live["video"] < start()["video"]  # left: fewer partitions
    images = [(s, p) for s, n, p in moves if n == "images"]
    assert images[0][1] < start()["images"] and images[-1][1] == start()["images"], images  # down, then up for the turn
    assert images[-1][0] >= TURN - 8 - 4  # taken up as the turn enters the horizon (and held a look)


def test_a_constant_schedule_never_reshards():
    mix = np.array([1.0, 0.1, 1.0])
    sized = {s.name: s.partitions for s in partition(COSTS, BUDGET, mixtures=[dict(zip(NAMES, mix))]).sources}
    rp = Repartitioner(COSTS, BUDGET, lambda step: mix, sized, interval=4, horizon=8)
    assert run(rp, 200, dict(sized)) == []


def test_the_decision_is_stateless():
    # a Planner that takes over at any step decides what the one before it would have
    live = start()
    moves = run(make(), 120, dict(live))
    for step, name, parts in moves:
        before = dict(live)
        for s, n, p in moves:
            if s < step:
                before[n] = p
        assert make().look(step, before) == (name, parts, make().look(step, before)[2])


def test_an_operators_reshard_is_kept_until_the_target_changes_again():
    live = start()
    live["text"] = 5  # an operator's: the schedule never changes text's target
    assert all(name != "text" for _, name, _ in run(make(), 120, live))
    assert live["text"] == 5


def test_patience_delays():
    eager = run(make(patience=1), 120, start())
    patient = run(make(patience=3), 120, start())
    assert eager[0][0] < patient[0][0]


def test_a_budget_that_cannot_hold_the_target_makes_no_reshard():
    tight = Budget(cpus=16, memory_mb=16000, cluster_size=1, max_workers_per_loader=1, max_partitions=1)
    rp = Repartitioner(COSTS, tight, weights, start(), interval=4, horizon=8)
    assert rp.target(8) is None
    assert run(rp, 120, start()) == []
