"""Sizing the Source Loaders to the sources' real costs (paper, Section 5)."""

from overlord.autoscale.partition import Budget, PartitionError, Partitioning, SourceCost, SourcePlan, partition

__all__ = [
    "Budget",
    "PartitionError",
    "Partitioning",
    "SourceCost",
    "SourcePlan",
    "partition",
]
