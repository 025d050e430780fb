"""Mixture-driven scaling: workers follow consumption rate times cost, with patience."""

from overlord.autoscale.scaler import Scaler


def _run(scaler, steps, counts, start=0, step_s=0.04):
    changes = []
    for step in range(start, start + steps):
        changed = scaler.observe(step, counts, now=step * step_s)
        if changed:
            changes.append((step, changed))
    return changes


def _scaler(**kw):
    args = dict(
        costs_ms={"text": 0.03, "images": 5.0}, current={"text": 1, "images": 1}, max_workers=4, interval=4, patience=2
    )
    return Scaler(**{**args, **kw})


def test_workers_follow_the_mixture_up_and_back_down():
    s = _scaler()
    # text-heavy: 0.64 images a step at 25 steps/s is 16/s x 5 ms = 0.08 of a worker
    assert _run(s, 40, {"text": 31, "images": 1}) == []
    assert s.current == {"text": 1, "images": 1}
    # image-heavy: 25.6 a step is 640/s x 5 ms = 3.2 workers; with headroom, the cap
    changes = _run(s, 40, {"text": 6, "images": 26}, start=40)
    assert s.current == {"text": 1, "images": 4} and changes[0][0] == 43  # up at the first interval
    _run(s, 40, {"text": 31, "images": 1}, start=80)
    assert s.current["images"] == 1, "the mixture moved away: its workers are reclaimed"


def test_partitions_share_a_source_demand():
    s = _scaler(partitions={"images": 2})
    _run(s, 40, {"text": 6, "images": 26})
    assert s.current["images"] == 3  # 3.2 x 1.5 over 2 partitions


def test_a_starved_source_doubles_its_workers():
    s = _scaler(max_workers=8)
    # 1 worker supplies 200 images/s (5 ms each): consumed at 8 a step x 25 steps/s, it is busy
    changes = _run(s, 12, {"text": 6, "images": 8})
    assert [c[1]["images"] for c in changes] == [2]
    changes = _run(s, 12, {"text": 6, "images": 16}, start=12)  # 2 busy workers' worth: 3 with headroom
    assert [c[1]["images"] for c in changes] == [3]


def test_a_brief_dip_does_not_take_workers_away():
    s = _scaler(patience=3, alpha=1.0, current={"text": 1, "images": 4})
    _run(s, 8, {"text": 6, "images": 26})
    assert _run(s, 8, {"text": 31, "images": 1}, start=8) == []  # two intervals of a text-heavy mix
    assert _run(s, 8, {"text": 6, "images": 26}, start=16) == []
    assert s.current == {"text": 1, "images": 4}


def test_projected_demand_scales_before_the_shift_is_consumed():
    s = _scaler()
    _run(s, 40, {"text": 31, "images": 1})  # the job runs at 25 steps/s
    # the schedule says images are about to take 26 of the 32 samples a step; the plans
    # so far still hold the old mix
    changed = s.observe(43, {"text": 31, "images": 1}, now=43 * 0.04, ahead={"text": 6.0, "images": 26.0})
    assert changed == {"images": 4}


def test_pressure_says_when_the_mixture_needs_more_than_the_budget():
    s = _scaler(cpus=2.0)
    _run(s, 8, {"text": 31, "images": 1})
    assert s.pressure < 0.1
    _run(s, 16, {"text": 6, "images": 26}, start=8)  # 3.2 busy workers for 2 CPUs
    assert 1.4 < s.pressure < 1.7


def test_the_first_step_starts_the_clock_and_rates_are_exact():
    s = _scaler()
    # 26 images a step every 40 ms is 650/s; the first step's time is not known, so its
    # samples do not count (they made the first window's rate 4/3 too high)
    _run(s, 4, {"text": 6, "images": 26})
    assert abs(s.rate["images"] - 650) < 1e-6 and abs(s.best_pace - 25) < 1e-6
