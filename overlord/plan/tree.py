"""`ClientPlaceTree`: the trainer mesh as a tree, for deciding who receives what.

    WORLD
     └─ dp 0 .. dp-1            a data-parallel group: one batch, one Data Constructor
         └─ pp 0 .. pp-1        pipeline stages: first gets inputs, last gets labels
             └─ cp 0 .. cp-1    context-parallel ranks: a zigzag slice of every document
                 └─ tp 0 .. tp-1  tensor-parallel ranks: same data (or a broadcast marker)

Leaves are global ranks, numbered dp-major with tp fastest (`Mesh.coords`). A strategy
distributes samples over the nodes of one level (`buckets(axis)`), and the tree says
which ranks consume a bucket and which of them need bytes at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlord.config import Mesh
from overlord.errors import ConfigError

AXES = ("DP", "CP", "WORLD")
BROADCAST_DIMS = ("TP",)


@dataclass(slots=True)
class ClientPlaceTree:
    """The job's mesh as a tree of consumers.

    Args:
        mesh: the backbone's mesh.
        broadcast: dimensions at which the trainer broadcasts data itself (e.g. {"TP"}),
            so only rank 0 of that dimension fetches bytes.
    """

    mesh: Mesh
    broadcast: set[str] = field(default_factory=set)

    def buckets(self, axis: str) -> int:
        """How many consumers the level `axis` has (DP groups, DPxCP ranks, or all ranks)."""
        if axis == "DP":
            return self.mesh.dp
        if axis == "CP":
            return self.mesh.dp * self.mesh.cp
        if axis == "WORLD":
            return self.mesh.world_size
        raise ConfigError(f"distribute axis {axis!r} is not one of {AXES}")

    def ranks(self, axis: str, bucket: int) -> list[int]:
        """Global ranks that consume `bucket` of level `axis`."""
        m = self.mesh
        if axis == "DP":
            return m.ranks_of_dp(bucket)
        if axis == "CP":
            dp, cp = divmod(bucket, m.cp)
            return [r for r in m.ranks_of_dp(dp) if m.coords(r)["cp"] == cp]
        if axis == "WORLD":
            return [bucket]
        raise ConfigError(f"distribute axis {axis!r} is not one of {AXES}")

    def broadcast_at(self, dim: str) -> None:
        if dim not in BROADCAST_DIMS:
            raise ConfigError(f"broadcast_at({dim!r}): only {BROADCAST_DIMS} is supported")
        self.broadcast.add(dim)

    def needs_bytes(self, rank: int) -> bool:
        """Whether `rank` receives sample bytes (tokens, labels, images), not only
        metadata: False for tp > 0 under broadcast at TP (the trainer broadcasts) and
        for middle PP stages (they need only the packing metadata)."""
        at = self.mesh.coords(rank)
        if "TP" in self.broadcast and at["tp"] > 0:
            return False
        return at["pp"] in (0, self.mesh.pp - 1)
