"""The Planner: mixing, costing and balancing of each step's samples.

The declarative data plane (the paper's names): a strategy builds a `DGraph` over the
step's buffer metadata and the `ClientPlaceTree` of the trainer mesh, and composes
`mix`, `distribute`, `cost`, `balance`, `broadcast_at` and `plan`.
"""

from overlord.planner.buffer import ITEM, NeedMetadata
from overlord.planner.core import PlannerCore, resolve_strategy
from overlord.planner.dgraph import DGraph, Plan, Planned, StepData
from overlord.planner.lowlevel import constructor_do_plan, loader_do_plan
from overlord.planner.meta import MetaChunk
from overlord.planner.tree import ClientPlaceTree

__all__ = [
    "ClientPlaceTree",
    "DGraph",
    "ITEM",
    "MetaChunk",
    "NeedMetadata",
    "Plan",
    "Planned",
    "PlannerCore",
    "StepData",
    "constructor_do_plan",
    "loader_do_plan",
    "resolve_strategy",
]
