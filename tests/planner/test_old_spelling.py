"""Configs and strategy modules written before the plan had a package of its own name
`overlord.planner.{strategies,schedule,cost,balance}` and import the strategy API from
`overlord.planner`: they resolve to the very objects of `overlord.plan`."""

from __future__ import annotations

import overlord.plan
import overlord.planner
import overlord.planner.cost as old_cost
from overlord.config import Job, Source
from overlord.plan import cost, schedule, strategies
from overlord.plan.core import resolve_strategy
from overlord.plan.schedule import Dynamic, from_config


def test_a_strategy_named_by_its_old_module_is_the_same_function():
    assert resolve_strategy("overlord.planner.strategies:balanced") is strategies.balanced
    assert resolve_strategy("overlord.planner.strategies:vanilla") is strategies.vanilla


def test_a_dynamic_mixing_named_by_its_old_module_builds_the_same_schedule(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    job = Job(
        name="old",
        sources=(Source(name="a", paths=(str(tmp_path / "a.jsonl"),)),),
        mixing={"kind": "dynamic", "fn": "overlord.planner.schedule:loss_proportional"},
    )
    made = from_config(job.mixing, ["a"], [1.0])
    assert isinstance(made, Dynamic)
    assert made.fn is schedule.loss_proportional


def test_the_strategy_api_is_importable_from_both_packages():
    for name in overlord.planner.__all__:
        assert getattr(overlord.planner, name) is getattr(overlord.plan, name)
    assert old_cost.transformer_cost is cost.transformer_cost
