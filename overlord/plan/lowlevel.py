"""Low-level plan interfaces: what each Source Loader and Data Constructor does with a plan.

`loader_do_plan` and `constructor_do_plan` are pure functions of a plan and the mesh;
the loader and constructor processes call them, and a strategy author can call them to
see exactly who will send and receive what (`overlord plan --dry-run` does).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from overlord.config import Mesh
from overlord.plan.step_plan import Plan
from overlord.plan.tree import ClientPlaceTree


def bucket_group(plan: Plan, mesh: Mesh, bucket: int) -> int:
    """The data-parallel group (hence the Data Constructor) that delivers `bucket`."""
    tree = ClientPlaceTree(mesh)
    return mesh.coords(tree.ranks(plan.axis, bucket)[0])["dp"]


def bucket_groups(plan: Plan, mesh: Mesh) -> NDArray[np.int64]:
    """[buckets]: the data-parallel group of every bucket of `plan`."""
    tree = ClientPlaceTree(mesh)
    return np.asarray([mesh.coords(tree.ranks(plan.axis, b)[0])["dp"] for b in range(plan.n_buckets)], np.int64)


def loader_do_plan(plan: Plan, mesh: Mesh, hosted: set[int]) -> list[tuple[int, int, int, tuple[int, int, int]]]:
    """(dp group, bucket, micro-batch, (stream, epoch, seq)) a loader sends, in plan order.

    A sample goes once to each Data Constructor that needs it: the one of the DP group
    that trains its tokens and, when the plan places its images on an encoder rank of
    another group, that group's too (bucket and micro-batch -1).
    """
    streams = np.fromiter(hosted, dtype=np.int64, count=len(hosted))
    mine = np.flatnonzero(np.isin(plan.items[:, 0], streams))
    cell = np.repeat(np.arange(len(plan.bounds) - 1, dtype=np.int64), np.diff(plan.bounds))[mine]
    bucket, mb = np.divmod(cell, plan.micro_batches)
    group = bucket_groups(plan, mesh)[bucket] if len(mine) else bucket
    rows = list(map(tuple, plan.items[mine].tolist()))
    out = list(zip(group.tolist(), bucket.tolist(), mb.tolist(), rows))
    if plan.encoder_items is None or plan.encoder_bounds is None:
        return out
    sent = {(g, item) for g, _, _, item in out}
    ranks = np.repeat(np.arange(len(plan.encoder_bounds) - 1), np.diff(plan.encoder_bounds))
    enc = np.flatnonzero(np.isin(plan.encoder_items[:, 0], streams))
    for rank, item in zip(ranks[enc].tolist(), map(tuple, plan.encoder_items[enc].tolist())):
        g = mesh.coords(rank)["dp"]
        if (g, item) not in sent:
            out.append((g, -1, -1, item))
            sent.add((g, item))
    return out


def encoder_destinations(plan: Plan) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """(stream, epoch, seq) -> (bucket, micro-batch, document index) where its tokens train
    (the bucket is a DP group when the plan's axis is DP)."""
    cell = np.repeat(np.arange(len(plan.bounds) - 1, dtype=np.int64), np.diff(plan.bounds))
    bucket, mb = np.divmod(cell, plan.micro_batches)
    doc = np.arange(len(cell)) - plan.bounds[cell]
    rows = map(tuple, plan.items.tolist())
    return dict(zip(rows, zip(bucket.tolist(), mb.tolist(), doc.tolist())))


def constructor_do_plan(plan: Plan, mesh: Mesh, dp: int) -> dict[int, int]:
    """Rank -> bucket it receives, for the ranks of data-parallel group `dp`."""
    tree = ClientPlaceTree(mesh)
    out = {}
    for b in range(plan.n_buckets):
        for rank in tree.ranks(plan.axis, b):
            if mesh.coords(rank)["dp"] == dp:
                out[rank] = b
    return out
