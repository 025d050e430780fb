"""Offline source auto-partitioning (paper, Section 5.1): how many workers and loader
partitions each source gets, and which loader process hosts which partition.

Pure: a cost table and a budget in, a `Partitioning` out. The multi-level algorithm:

1. Source clustering: sort sources by transform cost (CPU ms per sample), descending,
   and cut them into clusters of `cluster_size` (default 4). A cluster's mean cost
   stands for its members, so one noisy profile does not swing a source's share.
2. Resource levels: the CPU left after the Data Constructors and the Planner is split
   into worker blocks (one CPU each). A source's demand is its sampling weight times
   its cluster's mean cost (CPU seconds per delivered sample); the blocks follow the
   demands (largest remainder), every source gets at least a share of one, and no source
   more than `max_workers_per_source`.
3. Configuration: a source needs more loader partitions (data parallelism) when its
   workers exceed `max_workers_per_loader` or when its file-access state (open files,
   footers, row-group window) does not fit `max_loader_mb` in one process. Partitions
   of sources that need a worker or more get processes of their own; the light sources
   are packed together, by cluster, into processes of one worker each. The memory of
   the result is checked against the budget.

A `PartitionError` says what does not fit and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from overlord.errors import ConfigError
from overlord.runtime.readbuffer import draw_per_step, target_bytes


class PartitionError(ConfigError):
    """The budget cannot hold the sources; the message says which limit to raise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceCost:
    """What one source costs to load (profiled, see overlord.autoscale.profile).

    Attributes:
        name: the source.
        weight: its sampling weight (relative).
        transform_ms: CPU milliseconds per sample (read and transform).
        sample_kb: prepared bytes per sample, in KiB (read-buffer memory).
        state_mb: file-access state of the whole source in one process, MiB.
    """

    name: str
    weight: float
    transform_ms: float
    sample_kb: float = 4.0
    state_mb: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """The node's CPU and memory for the sidecar, and the limits of the partitioning.

    Attributes:
        cpus: CPUs for the whole sidecar.
        memory_mb: memory for the whole sidecar, MiB.
        constructor_cpus: CPUs the Data Constructors take (unless given, the sidecar sets an eighth of `cpus`,
            between 0.25 and 1).
        constructor_mb: MiB the Data Constructors take.
        planner_cpus: CPUs the Planner takes (unless given, the sidecar sets a sixteenth of `cpus`, between 0.1
            and 0.5).
        planner_mb: MiB the Planner takes.
        process_mb: the fixed MiB of one loader process (interpreter, libraries).
        buffer_bytes: byte cap of each loader partition's read buffer (Job.buffer_bytes).
        buffer_samples: sample cap of each read buffer (Job.buffer_samples), None for none.
        max_workers_per_source: w_src, the most workers one source may get.
        max_workers_per_loader: w_actor, the most workers one loader process may run.
        max_partitions: the most partitions one source may be split into (its data
            parallelism is bounded by what a step takes from it).
        max_loader_mb: the file-access state one loader process may hold for one source.
        cluster_size: sources per cluster.
    """

    cpus: float
    memory_mb: float
    constructor_cpus: float = 1.0
    constructor_mb: float = 256.0
    planner_cpus: float = 0.5
    planner_mb: float = 128.0
    process_mb: float = 80.0
    buffer_bytes: int = 64 << 20
    buffer_samples: int | None = None
    max_workers_per_source: int = 8
    max_workers_per_loader: int = 4
    max_partitions: int = 16
    max_loader_mb: float = 1024.0
    cluster_size: int = 4

    def __post_init__(self) -> None:
        if self.cpus <= 0 or self.memory_mb <= 0 or self.cluster_size < 1:
            raise ConfigError("Budget.cpus, Budget.memory_mb and Budget.cluster_size must be positive")
        if min(self.max_workers_per_source, self.max_workers_per_loader, self.max_partitions) < 1:
            raise ConfigError("Budget worker and partition limits must be at least 1")

    @property
    def loader_cpus(self) -> float:
        return self.cpus - self.constructor_cpus - self.planner_cpus

    @property
    def loader_mb(self) -> float:
        return self.memory_mb - self.constructor_mb - self.planner_mb


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """One source's configuration."""

    name: str
    cluster: int
    demand: float  # weight x cluster cost, normalised to sum to 1 over sources
    workers: float  # CPU blocks (a light source holds a fraction of one)
    partitions: int  # loader partitions (data parallelism of the source)
    memory_mb: float  # state and read buffers of all its partitions


@dataclass(frozen=True, slots=True)
class Partitioning:
    """Per-source plans, and the loader processes: each a list of (source, partition)."""

    sources: list[SourcePlan]
    loaders: list[list[tuple[str, int]]]
    loader_workers: list[float]
    memory_mb: float
    notes: list[str] = field(default_factory=list)

    def of(self, name: str) -> SourcePlan:
        return next(s for s in self.sources if s.name == name)

    def render(self) -> str:
        lines = [f"{'source':<20} {'cluster':>7} {'demand':>7} {'workers':>8} {'partitions':>10} {'memory MiB':>11}"]
        for s in self.sources:
            lines.append(
                f"{s.name:<20} {s.cluster:>7} {s.demand:>7.3f} {s.workers:>8.2f} {s.partitions:>10} {s.memory_mb:>11.1f}"
            )
        lines.append(
            f"{len(self.loaders)} loader process(es), {sum(self.loader_workers):.1f} worker(s), "
            f"{self.memory_mb:.0f} MiB in all:"
        )
        for k, (hosted, w) in enumerate(zip(self.loaders, self.loader_workers)):
            lines.append(f"  loader {k}: {w:.2f} worker(s): " + ", ".join(f"{n}.{p}" for n, p in hosted))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def partition(
    costs: list[SourceCost],
    budget: Budget,
    *,
    global_batch: int = 32,
    plan_ahead: int = 4,
    buffer_caps: dict[str, int] | None = None,
    mixtures: list[dict[str, float]] | None = None,
) -> Partitioning:
    """Workers, partitions and loader processes for `costs` within `budget`.

    `mixtures` (the mixing schedule's, `Schedule.mixtures`): a source is cut into as
    many partitions as its largest share of the loaders' demand in any of them needs,
    while its workers, and the packing of processes, follow its weight now. Where the
    schedule later makes it costly, live handoffs (overlord.autoscale.rebalance)
    spread those partitions over the processes its predecessors leave idle.

    `global_batch` (BatchSpec.global_batch) and `plan_ahead` (Job.plan_ahead) size the
    read buffers: each holds what the Planner draws from its partition over plan_ahead
    steps and one refill (overlord.runtime.readbuffer), within `budget.buffer_bytes`
    or the source's own cap in `buffer_caps` (Source.buffer_bytes).

    Raises:
        PartitionError: no source, or the CPU or memory budget cannot hold them.
    """
    if not costs:
        raise PartitionError("no sources to partition")
    cpus = budget.loader_cpus
    if cpus < 1:
        raise PartitionError(
            f"the sidecar budget of {budget.cpus:g} CPUs leaves {cpus:g} for Source Loaders after the Data "
            f"Constructors ({budget.constructor_cpus:g}) and the Planner ({budget.planner_cpus:g}); raise the CPU budget"
        )
    order = sorted(costs, key=lambda c: (-c.transform_ms, c.name))
    cluster_of = {c.name: i // budget.cluster_size for i, c in enumerate(order)}
    clusters: dict[int, list[SourceCost]] = {}
    for c in order:
        clusters.setdefault(cluster_of[c.name], []).append(c)
    mean_cost = {g: sum(c.transform_ms for c in members) / len(members) for g, members in clusters.items()}
    raw = {c.name: max(c.weight, 0.0) * max(mean_cost[cluster_of[c.name]], 1e-6) for c in costs}
    total = sum(raw.values()) or 1.0
    demand = {n: d / total for n, d in raw.items()}

    workers = _allocate(demand, math.floor(cpus), budget.max_workers_per_source)
    peak = dict(workers)
    for mix in mixtures or []:
        raw_mix = {c.name: max(mix.get(c.name, 0.0), 0.0) * max(mean_cost[cluster_of[c.name]], 1e-6) for c in costs}
        total_mix = sum(raw_mix.values())
        if total_mix > 0:
            at = _allocate(
                {n: d / total_mix for n, d in raw_mix.items()}, math.floor(cpus), budget.max_workers_per_source
            )
            peak = {n: max(peak[n], at[n]) for n in peak}
    notes = []
    plans, streams = [], []
    for c in order:
        w = workers[c.name]
        by_cpu = math.ceil(peak[c.name] / budget.max_workers_per_loader) if peak[c.name] >= 1 else 1
        by_memory = math.ceil(c.state_mb / budget.max_loader_mb)
        parts = max(by_cpu, by_memory, 1)
        if parts > budget.max_partitions:
            raise PartitionError(
                f"source {c.name!r} needs {parts} loader partitions ({peak[c.name]:g} workers at its peak, at most "
                f"{budget.max_workers_per_loader} per loader, {c.state_mb:g} MiB of file state at most "
                f"{budget.max_loader_mb:g} per loader) but Budget.max_partitions={budget.max_partitions}; "
                "raise max_workers_per_loader, max_loader_mb or max_partitions"
            )
        if by_memory > by_cpu:
            notes.append(f"{c.name}: {parts} partitions for its {c.state_mb:g} MiB of file state")
        cap = (buffer_caps or {}).get(c.name, budget.buffer_bytes)
        buffers = parts * buffer_mb(c, costs, parts, budget, global_batch, plan_ahead, cap)
        plans.append(
            SourcePlan(
                c.name, cluster_of[c.name], round(demand[c.name], 6), round(w, 3), parts, round(c.state_mb + buffers, 1)
            )
        )
        streams += [(c.name, p, w / parts, cluster_of[c.name]) for p in range(parts)]

    loaders, loader_workers = _pack(streams, budget.max_workers_per_loader)
    memory = sum(p.memory_mb for p in plans) + len(loaders) * budget.process_mb
    if memory > budget.loader_mb:
        raise PartitionError(
            f"the Source Loaders need {memory:.0f} MiB ({len(loaders)} processes of {budget.process_mb:g} MiB, file "
            f"state and read buffers of at most {budget.buffer_bytes / 2**20:g} MiB per partition) but the budget "
            f"leaves {budget.loader_mb:.0f} MiB after the Data Constructors and the Planner; raise the memory budget "
            "or lower Job.buffer_bytes"
        )
    return Partitioning(
        sources=sorted(plans, key=lambda p: [c.name for c in costs].index(p.name)),
        loaders=loaders,
        loader_workers=loader_workers,
        memory_mb=round(memory, 1),
        notes=notes,
    )


def buffer_mb(
    c: SourceCost, costs: list[SourceCost], parts: int, budget: Budget, global_batch: int, plan_ahead: int, cap: int
) -> float:
    """MiB one read buffer of source `c` holds when split into `parts` partitions: what
    the Planner draws from it over plan_ahead steps and one refill, at its profiled
    sample size, floored and capped as the loader does (overlord.runtime.readbuffer)."""
    draw = draw_per_step(global_batch, [x.weight for x in costs], costs.index(c), parts)
    nbytes = max(c.sample_kb * 1024, 1.0)
    held = target_bytes(draw, plan_ahead, 1, nbytes, cap)
    if budget.buffer_samples is not None:
        held = min(held, int(budget.buffer_samples * nbytes))
    return held / 2**20


def _allocate(demand: dict[str, float], blocks: int, cap: int) -> dict[str, float]:
    """Worker blocks in proportion to demand (largest remainder), capped per source.

    A source whose share is under one block keeps its fraction: light sources share a
    worker (packed together later). What a cap cuts off goes to the uncapped sources.
    """
    share = {n: d * blocks for n, d in demand.items()}
    for _ in range(len(share)):  # redistribute what the caps cut off
        over = {n: s for n, s in share.items() if s > cap}
        if not over:
            break
        spare = sum(s - cap for s in over.values())
        free = {n: s for n, s in share.items() if s < cap}
        for n in over:
            share[n] = float(cap)
        weight = sum(free.values())
        if not free or weight <= 0:
            break
        for n, s in free.items():
            share[n] = s + spare * s / weight
    whole = {n: s for n, s in share.items() if s >= 1}
    out = {n: s for n, s in share.items() if s < 1}
    floors = {n: math.floor(s) for n, s in whole.items()}
    # the whole blocks left once the light sources' fractions are set aside, dealt by
    # largest remainder: the sum never exceeds `blocks`
    left = math.floor(blocks - sum(out.values()) - sum(floors.values()) + 1e-9)
    for n in sorted(whole, key=lambda n: (-(whole[n] - floors[n]), n)):
        extra = 1 if left > 0 and floors[n] < cap else 0
        out[n] = float(floors[n] + extra)
        left -= extra
    return out


def _pack(streams, per_loader: int) -> tuple[list[list[tuple[str, int]]], list[float]]:
    """Loader processes: a partition with a worker or more runs alone; lighter ones are
    packed, heaviest first, into processes of at most one worker (first fit)."""
    loaders: list[list[tuple[str, int]]] = []
    workers: list[float] = []
    light = []
    for name, part, w, cluster in streams:
        if w >= 1:
            loaders.append([(name, part)])
            workers.append(min(float(per_loader), w))
        else:
            light.append((w, cluster, name, part))
    bins: list[tuple[list[tuple[str, int]], float]] = []
    for w, _, name, part in sorted(light, key=lambda x: (x[1], -x[0], x[2], x[3])):
        for i, (hosted, load) in enumerate(bins):
            if load + w <= 1.0 + 1e-9:
                hosted.append((name, part))
                bins[i] = (hosted, load + w)
                break
        else:
            bins.append(([(name, part)], w))
    for hosted, load in bins:
        loaders.append(hosted)
        workers.append(round(load, 3))
    return loaders, workers
