"""The job's layout on a node: which process hosts which Source Loader and Data Constructor.

A Source Loader is a role, not a process: streams (source partitions) are spread over
`loader_processes` processes, so the process count follows the CPU budget, not the
number of sources. Ring names between roles are built here too, from the layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from overlord.config import Job
from overlord.errors import PlanError
from overlord.runtime.reshard import RETIRED, Reshard, check_record
from overlord.shm.names import segment_name


def stream_name(source: str, partition: int) -> str:
    """A Source Loader's stream id: `<source>.<partition>`."""
    return f"{source}.{partition}"


@dataclass(frozen=True, slots=True)
class Layout:
    streams: list[str]
    stream_source: list[int]
    loader_of: list[int]  # stream -> loader process index
    loaders: int
    constructor_hosts: int
    constructor_of: list[int]  # dp group -> constructor host index
    shadowed: list[int]  # loader processes that have a Shadow Loader process
    generation: int = 0  # reshards applied (`grown`): their streams follow the start's

    @property
    def live(self) -> list[int]:
        """The streams no reshard retired, in order."""
        return [i for i, k in enumerate(self.loader_of) if k != RETIRED]

    @classmethod
    def plan(cls, job: Job, partitioning=None) -> Layout:
        """Streams round robin over `loader_processes` processes, or where an
        auto-partitioning (overlord.autoscale) put each one."""
        streams, stream_source = [], []
        for i, src in enumerate(job.sources):
            for p in range(src.partitions):
                streams.append(stream_name(src.name, p))
                stream_source.append(i)
        if partitioning is not None:
            home = {stream_name(n, p): k for k, hosted in enumerate(partitioning.loaders) for n, p in hosted}
            loader_of = [home[name] for name in streams]
            loaders = len(partitioning.loaders)
        else:
            cpus = len(os.sched_getaffinity(0))
            loaders = job.loader_processes or max(1, min(len(streams), cpus // 2 or 1))
            loaders = min(loaders, len(streams))
            loader_of = [i % loaders for i in range(len(streams))]
        shadowed = sorted({loader_of[i] for i, src in enumerate(stream_source) if job.sources[src].shadow})
        # one Data Constructor host per node, hosting the DP groups whose ranks live there
        # (a group spread over nodes is built on the node of its first rank)
        nodes = job.node_ids
        constructor_of = [nodes.index(job.node_of_rank(job.mesh.ranks_of_dp(dp)[0])) for dp in range(job.mesh.dp)]
        return cls(
            streams=streams,
            stream_source=stream_source,
            loader_of=loader_of,
            loaders=loaders,
            constructor_hosts=len(nodes),
            constructor_of=constructor_of,
            shadowed=shadowed,
        )

    def grown(self, reshards: Sequence[Reshard]) -> Layout:
        """This layout with the reshards it does not hold yet (overlord.runtime.reshard):
        each one's new streams appended, served first by its `homes`, and the streams it
        retired served by none (RETIRED). Stream indices never change: a plan's rows name
        a retired stream's samples up to the step before the reshard, the new ones' after."""
        fresh = [r for r in reshards if r.generation > self.generation]
        if not fresh:
            return self
        streams, sources, loader_of = list(self.streams), list(self.stream_source), list(self.loader_of)
        index = {name: i for i, name in enumerate(streams)}
        fresh.sort(key=lambda r: r.generation)
        if [r.generation for r in fresh] != list(range(self.generation + 1, self.generation + 1 + len(fresh))):
            raise PlanError(
                f"the planner checkpoint holds reshards {[r.generation for r in reshards]}, which do not follow "
                f"the {self.generation} this layout holds one by one; the checkpoint is not this job's: run one "
                "job configuration on every node, or start the job fresh (without --resume)"
            )
        for r in fresh:
            check_record(r, streams, sources, [k != RETIRED for k in loader_of], self.loaders)
            for name, _, _ in r.parents:
                loader_of[index[name]] = RETIRED
            for name, home in zip(r.streams, r.homes):
                index[name] = len(streams)
                streams.append(name)
                sources.append(r.source_index)
                loader_of.append(home)
        return replace(
            self, streams=streams, stream_source=sources, loader_of=loader_of, generation=fresh[-1].generation
        )

    def units(self) -> list[str]:
        """The roles placed on nodes, by name: `loader<k>` and `constructor<h>`."""
        return [f"loader{k}" for k in range(self.loaders)] + [f"constructor{h}" for h in range(self.constructor_hosts)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        return cls(**json.loads(text))


def sample_ring(job: Job, loader: int, dp: int) -> str:
    """Ring from loader process `loader` to the Data Constructor of DP group `dp`."""
    return segment_name(job.name, job.node, f"l{loader}-c{dp}")


def client_ring(job: Job, rank: int) -> str:
    """Ring from a Data Constructor to the trainer client of global `rank`."""
    return segment_name(job.name, job.node, f"client{rank}")
