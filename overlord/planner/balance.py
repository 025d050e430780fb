"""Moved to `overlord.plan.balance` (the balancers); kept so a job config or strategy that
names `overlord.planner.balance` (the spelling before the plan had a package of its own)
still resolves to the same objects."""

from overlord.plan.balance import *  # noqa: F403
