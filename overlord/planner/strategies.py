"""Moved to `overlord.plan.strategies` (the shipped strategies); kept so a job config or strategy that
names `overlord.planner.strategies` (the spelling before the plan had a package of its own)
still resolves to the same objects."""

from overlord.plan.strategies import *  # noqa: F403
