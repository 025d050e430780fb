"""The read-buffer budget's arithmetic: weights, sample sizes, floor, cap, demand."""

from __future__ import annotations

import math

import pytest

from overlord.runtime.readbuffer import MIN_SAMPLES, TOP_UP, ReadBudget, draw_per_step, floor_samples, target_bytes

MiB = 1 << 20


def held(draw: float, steps: int) -> float:
    """1.5 x the draw over `steps` plus three standard deviations (the module docstring)."""
    return 1.5 * (draw * steps + 3 * math.sqrt(draw * steps))


def test_the_draw_follows_the_weight_share_and_the_partitions():
    weights = [3.0, 1.0, 0.0]
    assert draw_per_step(64, weights, 0, 1) == pytest.approx(48.0)
    assert draw_per_step(64, weights, 0, 4) == pytest.approx(12.0)
    assert draw_per_step(64, weights, 1, 1) == pytest.approx(16.0)
    assert draw_per_step(64, weights, 2, 1) == 0.0


def test_the_target_is_one_and_a_half_times_the_horizon_draw_with_its_spread_times_mean_size():
    assert TOP_UP == 0.5
    # 12 samples a step, plan_ahead 4 + 1 refill step, 10 KiB each: 1.5 x (60 + 3 sqrt 60)
    assert target_bytes(12.0, 4, 1, 10240, 64 * MiB) == int(held(12.0, 5) * 10240)
    assert held(12.0, 5) == pytest.approx(124.9, abs=0.1)
    # a slower refill (3 steps) holds more
    assert target_bytes(12.0, 4, 3, 10240, 64 * MiB) == int(held(12.0, 7) * 10240)
    # the refill latency is at least one step
    assert target_bytes(12.0, 4, 0, 10240, 64 * MiB) == int(held(12.0, 5) * 10240)


def test_the_floor_holds_two_steps_and_the_cap_wins_over_it():
    # a rare source: 0.01 sample a step -> the floor (MIN_SAMPLES)
    assert floor_samples(0.01) == MIN_SAMPLES
    assert target_bytes(0.01, 4, 1, 1000, 64 * MiB) == MIN_SAMPLES * 1000
    assert floor_samples(30.0) == 60
    # images of 2 MiB, 48 a step over 5 steps: 480 MiB derived, capped at 64 MiB
    assert target_bytes(48.0, 4, 1, 2 * MiB, 64 * MiB) == 64 * MiB
    # the cap wins over the floor too
    assert target_bytes(48.0, 4, 1, 2 * MiB, 8 * MiB) == 8 * MiB


def test_heavier_samples_hold_fewer_and_weight_follows():
    light = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB)
    light.observe([1000] * 10)
    heavy = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB)
    heavy.observe([1 << 20] * 10)
    assert light.target_samples() == math.ceil(held(8.0, 5))  # 1.5 x (40 + 3 sqrt 40) = 89
    assert light.target_bytes() == int(held(8.0, 5) * 1000)
    assert heavy.target_samples() == 64  # 88 MiB, capped at 64 MiB
    rare = ReadBudget(draw=0.005, plan_ahead=4, cap_bytes=64 * MiB)
    rare.observe([1000])
    assert rare.target_samples() == MIN_SAMPLES
    big = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB)
    big.observe([4 << 20] * 3)
    assert big.target_samples() == 16  # 64 MiB / 4 MiB


def test_the_running_mean_follows_the_prepared_samples():
    b = ReadBudget(draw=1.0, plan_ahead=1, cap_bytes=MiB)
    b.observe([100, 300])
    assert b.mean_nbytes == pytest.approx(200.0)
    b.observe([600])
    assert b.mean_nbytes == pytest.approx(1000 / 3)
    assert b.seen == 3


def test_before_any_sample_the_first_read_is_the_floor():
    b = ReadBudget(draw=20.0, plan_ahead=4, cap_bytes=64 * MiB)
    assert b.room(0, 0) == 40
    assert ReadBudget(draw=20.0, plan_ahead=4, cap_bytes=64 * MiB, cap_samples=8).room(0, 0) == 8


def test_low_water_is_need_in_bytes_and_a_refill_tops_up_half_of_it():
    b = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB)
    b.observe([1000] * 40)  # need 59 samples; target 89 samples, 89,000 B; low water 59,333 B
    assert b.target_samples() == 89
    assert b.low_water_bytes() == 59333
    assert b.room(0, 0) == 89
    assert b.room(75, 75000) == 0  # above low water
    assert b.room(60, 60000) == 0
    assert b.room(59, 59000) == 30  # below: top up to the target
    # twenty large samples are above low water in bytes though few in count
    assert b.room(20, 75000) == 0
    assert b.room(89, 89000) == 0


def test_the_sample_cap_bounds_the_buffer_over_the_bytes():
    b = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB, cap_samples=10)
    b.observe([1000] * 40)
    assert b.target_samples() == 10
    assert b.room(0, 0) == 10
    assert b.room(10, 10000) == 0


def test_what_the_planner_asks_for_wins_over_cap_and_low_water():
    b = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=4000)  # the cap holds 4 samples of 1000 B
    b.observe([1000] * 4)
    assert b.target_samples() == 4
    assert b.room(4, 4000) == 0
    assert b.room(4, 4000, wanted=30) == 26  # one step needs 30: hold them
    assert b.room(30, 30000, wanted=30) == 0


def test_the_pace_sets_the_refill_steps_within_bounds():
    b = ReadBudget(draw=8.0, plan_ahead=4, cap_bytes=64 * MiB)
    b.pace(refill_s=0.25, step_s=0.1)
    assert b.refill_steps == 3
    b.pace(refill_s=0.001, step_s=0.1)
    assert b.refill_steps == 1
    b.pace(refill_s=10.0, step_s=0.001)  # a burst of plans is not a pace
    assert b.refill_steps == 8
    b.pace(refill_s=1.0, step_s=0.0)  # no pace measured: unchanged
    assert b.refill_steps == 8


def test_a_draw_larger_than_the_weights_give_is_measured_and_followed():
    # a mixing schedule turned to this source: the plans take 20 a step, the weights said 2
    b = ReadBudget(draw=2.0, plan_ahead=4, cap_bytes=64 * MiB)
    b.observe([1000] * 10)
    assert b.target_samples() == math.ceil(held(2.0, 5))  # 30
    for _ in range(60):
        b.took(20)
    assert b.step_draw() == pytest.approx(20.0, rel=0.01)
    assert b.target_samples() == pytest.approx(held(20.0, 5), abs=2)  # 1.5 x (100 + 30)
    # a schedule that turns away keeps the weights' share
    for _ in range(200):
        b.took(0)
    assert b.step_draw() == 2.0
