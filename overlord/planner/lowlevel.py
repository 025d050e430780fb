"""Low-level plan interfaces: what each Source Loader and Data Constructor does with a plan.

`loader_do_plan` and `constructor_do_plan` are pure functions of a plan and the mesh;
the loader and constructor processes call them, and a strategy author can call them to
see exactly who will send and receive what (`overlord plan --dry-run` does).
"""

from __future__ import annotations

from overlord.config import Mesh
from overlord.planner.dgraph import Plan
from overlord.planner.tree import ClientPlaceTree


def bucket_group(plan: Plan, mesh: Mesh, bucket: int) -> int:
    """The data-parallel group (hence the Data Constructor) that delivers `bucket`."""
    tree = ClientPlaceTree(mesh)
    return mesh.coords(tree.ranks(plan.axis, bucket)[0])["dp"]


def loader_do_plan(plan: Plan, mesh: Mesh, hosted: set[int]) -> list[tuple[int, int, int, tuple[int, int, int]]]:
    """(dp group, bucket, micro-batch, (stream, epoch, seq)) a loader sends, in plan order."""
    out = []
    for b, bucket in enumerate(plan.buckets):
        group = None
        for m, items in enumerate(bucket):
            for item in items:
                if item[0] in hosted:
                    group = bucket_group(plan, mesh, b) if group is None else group
                    out.append((group, b, m, item))
    return out


def constructor_do_plan(plan: Plan, mesh: Mesh, dp: int) -> dict[int, int]:
    """Rank -> bucket it receives, for the ranks of data-parallel group `dp`."""
    tree = ClientPlaceTree(mesh)
    out = {}
    for b in range(len(plan.buckets)):
        for rank in tree.ranks(plan.axis, b):
            if mesh.coords(rank)["dp"] == dp:
                out[rank] = b
    return out
