"""Low-level plan interfaces: what each Source Loader and Data Constructor does with a plan.

`loader_do_plan` and `constructor_do_plan` are pure functions of a plan and the mesh;
the loader and constructor processes call them, and a strategy author can call them to
see exactly who will send and receive what (`overlord plan --dry-run` does).
"""

from __future__ import annotations

from overlord.config import Mesh
from overlord.plan.dgraph import Plan
from overlord.plan.tree import ClientPlaceTree


def bucket_group(plan: Plan, mesh: Mesh, bucket: int) -> int:
    """The data-parallel group (hence the Data Constructor) that delivers `bucket`."""
    tree = ClientPlaceTree(mesh)
    return mesh.coords(tree.ranks(plan.axis, bucket)[0])["dp"]


def loader_do_plan(plan: Plan, mesh: Mesh, hosted: set[int]) -> list[tuple[int, int, int, tuple[int, int, int]]]:
    """(dp group, bucket, micro-batch, (stream, epoch, seq)) a loader sends, in plan order.

    A sample goes once to each Data Constructor that needs it: the one of the DP group
    that trains its tokens and, when the plan places its images on an encoder rank of
    another group, that group's too (bucket and micro-batch -1).
    """
    out = []
    sent: set[tuple[int, tuple[int, int, int]]] = set()
    for b, bucket in enumerate(plan.buckets):
        group = None
        for m, items in enumerate(bucket):
            for item in items:
                if item[0] in hosted:
                    group = bucket_group(plan, mesh, b) if group is None else group
                    out.append((group, b, m, item))
                    sent.add((group, item))
    for rank, items in enumerate(plan.encoder or ()):
        group = mesh.coords(rank)["dp"]
        for item in items:
            if item[0] in hosted and (group, item) not in sent:
                out.append((group, -1, -1, item))
                sent.add((group, item))
    return out


def encoder_destinations(plan: Plan) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """(stream, epoch, seq) -> (bucket, micro-batch, document index) where its tokens train
    (the bucket is a DP group when the plan's axis is DP)."""
    out = {}
    for b, bucket in enumerate(plan.buckets):
        for m, items in enumerate(bucket):
            for doc, item in enumerate(items):
                out[item] = (b, m, doc)
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
