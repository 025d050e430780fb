"""The sections of a `Job` that were dicts: `Mixing` (how the mixture changes over the job)
and `Autoscale` (the node's budget and the limits of the auto-partitioning).

Each is written in YAML as before (`mixing: {kind: warmup, ...}`, `autoscale: {cpus: 8}`)
and may be given as a dict in Python; `Job` turns the dict into the section, refusing an
unknown key by name. Which sources a mixture names is checked by the Job (it knows them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlord.config._checks import checked_keys
from overlord.errors import ConfigError

MIXING_KINDS = ("constant", "piecewise", "warmup", "dynamic")
MIXING_UNITS = ("step", "substep", "epoch")
_NEEDS = {"constant": ("weights",), "piecewise": ("points",), "warmup": ("start", "end", "steps"), "dynamic": ()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Mixing:
    """A mixing schedule (overlord.plan.schedule): the weight of each source over the job.

    Attributes:
        kind: constant (`weights` at every step), piecewise (`points`: the last point at
            or before the step applies), warmup (from `start` to `end` linearly over
            `steps` steps from step `begin`) or dynamic (`fn` recomputes the weights from
            the trainers' reported metrics every `every` steps).
        unit: what the schedule's time axis counts: step, substep (micro-batch m of step
            t mixes as t + m/micro_batches) or epoch (the job's epoch).
        weights: source name -> weight (constant); a source left out weighs 0.
        points: [[step, {source: weight}], ...] starting at step 0 (piecewise).
        start, end: source name -> weight at the warmup's first and last step (warmup).
        begin: the step the warmup starts at (warmup).
        steps: the warmup's length in steps, >= 1 (warmup).
        fn: "module:function" computing weights from metrics (dynamic; default
            overlord.plan.schedule:loss_proportional).
        every: steps between two recomputations, >= 1 (dynamic).
    """

    kind: str
    unit: str = "step"
    weights: Mapping[str, float] | None = None
    points: tuple[tuple[int, Mapping[str, float]], ...] | None = None
    start: Mapping[str, float] | None = None
    end: Mapping[str, float] | None = None
    begin: int = 0
    steps: int | None = None
    fn: str = "overlord.plan.schedule:loss_proportional"
    every: int = 1

    def __post_init__(self) -> None:
        if self.kind not in MIXING_KINDS:
            raise ConfigError(f"mixing.kind={self.kind!r}; use one of {', '.join(MIXING_KINDS)}")
        if self.unit not in MIXING_UNITS:
            raise ConfigError(f"mixing.unit={self.unit!r}; use one of {', '.join(MIXING_UNITS)}")
        missing = [name for name in _NEEDS[self.kind] if getattr(self, name) is None]
        if missing:
            raise ConfigError(f"mixing of kind {self.kind!r} needs {', '.join(missing)}; see docs/config.md (Mixing)")
        for name in ("weights", "start", "end"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"mixing.{name} must map source names to weights, got {value!r}")
        if self.points is not None:
            try:
                points = tuple((int(step), dict(mixture)) for step, mixture in self.points)
            except (TypeError, ValueError):
                raise ConfigError(f"mixing.points={self.points!r} must be [[step, {{source: weight}}], ...]") from None
            object.__setattr__(self, "points", points)
        for name, low in (("begin", 0), ("steps", 1), ("every", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"mixing.{name}={value!r} must be an int >= {low}")
        if not isinstance(self.fn, str) or ":" not in self.fn:
            raise ConfigError(f"mixing.fn={self.fn!r} must be 'module:function'")

    @classmethod
    def of(cls, value: Mixing | Mapping[str, Any]) -> Mixing:
        """`value` as a Mixing: itself, or built from its YAML/JSON mapping."""
        return value if isinstance(value, Mixing) else cls(**checked_keys(cls, value, "mixing"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Autoscale:
    """Size the Source Loaders to the sources' profiled costs (overlord.autoscale).

    Every budget field left out (None) is filled from the machine by
    `overlord.autoscale.apply.budget_of`; the others are `overlord.autoscale.Budget`'s.

    Attributes:
        cpus: CPUs for the whole sidecar (default: the CPUs this process may run on, or
            `$OVERLORD_CPUS` / a sidecar's `--cpus`).
        memory_mb: memory for the whole sidecar, MiB (default: half the available memory,
            or `$OVERLORD_MEMORY_MB` / `--memory-mb`).
        constructor_cpus: CPUs the Data Constructors take (default: an eighth of `cpus`,
            between 0.25 and 1).
        constructor_mb: MiB the Data Constructors take.
        planner_cpus: CPUs the Planner takes (default: a sixteenth of `cpus`, between 0.1
            and 0.5).
        planner_mb: MiB the Planner takes.
        process_mb: the fixed MiB of one loader process (interpreter, libraries).
        buffer_bytes: byte cap of each loader partition's read buffer in the memory
            budget (default Job.buffer_bytes).
        buffer_samples: sample cap of each read buffer in the memory budget (default
            Job.buffer_samples).
        max_workers_per_source: the most workers one source may get.
        max_workers_per_loader: the most workers one loader process may run (default 1).
        max_partitions: the most partitions one source may be split into.
        max_loader_mb: the file-access state one loader process may hold for one source.
        cluster_size: sources per cluster.
        profile_samples: samples of the short profile of a source no journal covers.
        online: whether the Planner scales transform threads with the mixture while the
            job runs.
        max_threads: the most transform threads per partition when scaling online.
        scale_interval: steps between two scaling decisions.
        handoffs: whether, scaling online, the Planner also moves streams (source
            partitions) between loader processes while the job runs, when one
            process's transform demand stays above the others' (a step boundary,
            exactly once: overlord.planner.handoff).
        reshards: whether, scaling online, the Planner also changes how many partitions
            a source has while the job runs, following the mixing schedule: every
            `scale_interval` steps it sizes the sources for the mixtures of the steps
            about to be planned, with the costs and budget of the start, and reshards
            one whose target changed and held (a step boundary, every sample once:
            overlord.autoscale.repartition). Off by default: a reshard changes which
            samples the later steps draw, so the bytes differ from a job without it
            (they are the same in every run with the same profile and schedule).
    """

    cpus: float | None = None
    memory_mb: float | None = None
    constructor_cpus: float | None = None
    constructor_mb: float | None = None
    planner_cpus: float | None = None
    planner_mb: float | None = None
    process_mb: float | None = None
    buffer_bytes: int | None = None
    buffer_samples: int | None = None
    max_workers_per_source: int | None = None
    max_workers_per_loader: int | None = None
    max_partitions: int | None = None
    max_loader_mb: float | None = None
    cluster_size: int | None = None
    profile_samples: int | None = None
    online: bool = True
    max_threads: int = 4
    scale_interval: int = 8
    handoffs: bool = True
    reshards: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("online", "handoffs", "reshards"):
                if not isinstance(value, bool):
                    raise ConfigError(f"autoscale.{f.name}={value!r} must be true or false")
            elif value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                raise ConfigError(f"autoscale.{f.name}={value!r} must be a number > 0 (or left out)")

    def budget_fields(self) -> dict[str, float]:
        """The budget fields this config sets (the rest come from the machine)."""
        # deferred: autoscale is layers above config (pyproject's import-linter exception); only this check needs it
        from overlord.autoscale.partition import Budget

        names = {f.name for f in dataclasses.fields(Budget)}
        return {name: value for name in sorted(names) if (value := getattr(self, name, None)) is not None}

    @classmethod
    def of(cls, value: Autoscale | Mapping[str, Any]) -> Autoscale:
        """`value` as an Autoscale: itself, or built from its YAML/JSON mapping."""
        return value if isinstance(value, Autoscale) else cls(**checked_keys(cls, value, "autoscale"))
