"""The plan: mixing, costing and balancing of each step's samples, and what every role
reads of it (plans, checkpoints, the wait for a step).

The declarative data plane (the paper's names): a strategy builds a `DGraph` over the
step's buffer metadata and the `ClientPlaceTree` of the trainer mesh, and composes
`mix`, `distribute`, `cost`, `balance`, `broadcast_at` and `plan`. This package is
pure of processes: the Planner role that runs it each step is `overlord.planner`.
"""

from overlord.plan.buffer import ITEM, NeedMetadata
from overlord.plan.core import PlannerCore, resolve_strategy
from overlord.plan.dgraph import DGraph, Planned, StepData
from overlord.plan.lowlevel import constructor_do_plan, loader_do_plan
from overlord.plan.meta import MetaChunk
from overlord.plan.step_plan import Plan
from overlord.plan.tree import ClientPlaceTree

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
