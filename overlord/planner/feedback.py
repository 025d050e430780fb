"""Feedback: the metrics trainers report shape a dynamic mixing schedule.

Trainers report metrics per rank (`metrics` hash: rank -> JSON {"metrics": {...}});
when a `Dynamic` schedule is due at a step, it observes their mean over ranks before
that step is planned (see schedule.py).
"""

from __future__ import annotations

import json

import redis

from overlord.plan.schedule import Dynamic
from overlord.store import Keys


def reported_metrics(r: redis.Redis, keys: Keys) -> dict[str, float]:
    """The mean over ranks of each metric the trainers last reported."""
    sums: dict[str, list[float]] = {}
    for raw in r.hvals(keys.metrics):
        for name, value in json.loads(raw)["metrics"].items():
            sums.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sums.items()}


def feed(r: redis.Redis, keys: Keys, schedule, step: int) -> bool:
    """Give a dynamic `schedule` the reported metrics if it is due at `step`; returns
    whether it observed."""
    if not isinstance(schedule, Dynamic) or not schedule.due(step):
        return False
    schedule.observe(step, reported_metrics(r, keys))
    return True
