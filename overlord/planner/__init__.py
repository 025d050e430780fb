"""The Planner: mixing and distribution of each step's samples (pure core + Redis loop)."""

from overlord.planner.core import Plan, PlannerCore
from overlord.planner.meta import MetaChunk

__all__ = sorted(["MetaChunk", "Plan", "PlannerCore"])
