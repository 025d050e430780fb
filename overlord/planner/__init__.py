"""The Planner role: one process per job (a leader and standbys) that plans each step.

`process.py` composes its controllers: leadership, intake of buffer metadata,
publishing plans and checkpoints, promoting shadow loaders, placing roles on nodes,
scaling transform workers and feeding metrics back into the mixing schedule. What a
plan is, and the strategy API, live in `overlord.plan`; the names below stay here so
strategy modules written against `overlord.planner` keep working.
"""

from overlord.plan import (
    ITEM,
    ClientPlaceTree,
    DGraph,
    MetaChunk,
    NeedMetadata,
    Plan,
    Planned,
    PlannerCore,
    StepData,
    constructor_do_plan,
    loader_do_plan,
    resolve_strategy,
)

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
