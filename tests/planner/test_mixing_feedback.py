"""Feedback against a real redis-server: the trainers' reported metrics, averaged over
ranks, reach a dynamic schedule when it is due, and nothing else."""

from __future__ import annotations

import json

import numpy as np

from overlord.plan.schedule import from_config
from overlord.planner.feedback import feed, reported_metrics
from overlord.store import Keys

KEYS = Keys("j")


def test_metrics_are_averaged_over_ranks(r):
    r.hset(KEYS.metrics, "0", json.dumps({"metrics": {"loss/a": 1.0, "loss/b": 3.0}}))
    r.hset(KEYS.metrics, "1", json.dumps({"metrics": {"loss/a": 3.0}}))
    assert reported_metrics(r, KEYS) == {"loss/a": 2.0, "loss/b": 3.0}


def test_a_due_dynamic_schedule_observes_the_metrics(r):
    schedule = from_config({"kind": "dynamic", "every": 4}, ["a", "b"], [1.0, 1.0])
    r.hset(KEYS.metrics, "0", json.dumps({"metrics": {"loss/a": 2.0, "loss/b": 1.0}}))
    assert not feed(r, KEYS, schedule, 3)  # not due
    assert feed(r, KEYS, schedule, 4)
    w = schedule.weights(5)
    assert w[0] > w[1] and schedule.updated == 4  # the source with the higher loss is up-weighted
    assert not feed(r, KEYS, schedule, 4)  # once per step
    constant = from_config(None, ["a", "b"], [1.0, 1.0])
    assert not feed(r, KEYS, constant, 4) and np.allclose(constant.weights(4), [1.0, 1.0])
