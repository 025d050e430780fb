"""Moved to `overlord.plan.schedule` (the mixing schedules); kept so a job config or strategy that
names `overlord.planner.schedule` (the spelling before the plan had a package of its own)
still resolves to the same objects."""

from overlord.plan.schedule import *  # noqa: F403
