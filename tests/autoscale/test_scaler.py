"""Mixture-driven scaling: workers follow the demanded share times cost, with patience."""

from overlord.autoscale.scaler import Scaler


def _run(scaler, steps, counts, start=0):
    changes = []
    for step in range(start, start + steps):
        changed = scaler.observe(step, counts)
        if changed:
            changes.append((step, changed))
    return changes


def test_a_shift_to_the_costly_source_scales_it_up_and_back_down():
    s = Scaler(costs_ms={"text": 0.1, "images": 5.0}, current={"text": 1, "images": 1}, max_workers=4,
               interval=4, patience=2)
    assert _run(s, 40, {"text": 60, "images": 4}) == [(7, {"images": 4})]  # even a small share of images dominates
    s2 = Scaler(costs_ms={"text": 0.1, "images": 5.0}, current={"text": 1, "images": 1}, max_workers=4,
                interval=4, patience=2)
    _run(s2, 40, {"text": 1000, "images": 1})  # text-heavy: text's demand leads
    assert s2.current == {"text": 4, "images": 1}
    changes = _run(s2, 80, {"text": 10, "images": 54}, start=40)  # the mixture shifts to images
    assert s2.current == {"text": 1, "images": 4}
    assert len(changes) == 1 and changes[0][1] == {"text": 1, "images": 4}


def test_a_brief_swing_does_not_change_workers():
    s = Scaler(costs_ms={"a": 1.0, "b": 1.0}, current={"a": 4, "b": 4}, max_workers=4, interval=2, patience=3, alpha=1.0)
    _run(s, 2, {"a": 50, "b": 50})
    assert _run(s, 2, {"a": 95, "b": 5}, start=2) == []  # one interval of a skewed mix
    assert _run(s, 4, {"a": 50, "b": 50}, start=4) == []
    assert s.current == {"a": 4, "b": 4}
