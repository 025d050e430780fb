"""Moved to `overlord.plan.cost` (the cost models); kept so a job config or strategy that
names `overlord.planner.cost` (the spelling before the plan had a package of its own)
still resolves to the same objects."""

from overlord.plan.cost import *  # noqa: F403
