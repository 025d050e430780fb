"""Mixing schedules: the sampling weight of every source at every step.

A schedule is a pure function of the step (and of its own small state, which the
Planner checkpoints), so a restarted Planner mixes exactly as before. Declared in the
job config as `mixing:`; without it, each source's constant `weight` applies.

    mixing: {kind: piecewise, points: [[0, {web: 1.0}], [1000, {web: 0.5, code: 0.5}]]}
    mixing: {kind: warmup, start: {web: 1.0}, end: {web: 0.3, images: 0.7}, steps: 2000}
    mixing: {kind: dynamic, fn: "overlord.plan.schedule:loss_proportional", every: 50}
    mixing: {kind: warmup, unit: epoch, start: {...}, end: {...}, steps: 3}   # over epochs
    mixing: {kind: warmup, unit: substep, ...}   # micro-batch m of step t mixes as t + m/M

A source a mixture does not name gets weight 0 there. A dynamic schedule is driven by
metrics the trainers report (`DataLoader.report_metrics`): every `every` steps the
Planner reads them (one HGETALL) and asks `fn(step, metrics, base, sources)` for new
weights, which hold until the next update and are part of the planner checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from overlord.config import Mixing
from overlord.errors import ConfigError
from overlord.transforms import resolve

Weights = NDArray[np.float64]  # one weight per source, in the job's source order
# fn(step, metrics, base weights, source names) -> new weights (a `kind: dynamic` mixing)
MixingFn = Callable[[int, dict[str, float], Weights, list[str]], Any]


class Schedule(Protocol):
    """What the Planner asks of a mixing schedule: every source's weight at `step` (a
    step, a step plus a fraction of it under substep mixing, or an epoch)."""

    def weights(self, step: float) -> Weights: ...

    def mixtures(self) -> list[Weights]:
        """The mixtures the schedule goes through (its extremes: every mixture it
        reaches lies between them), for sizing the loaders for its peaks."""
        ...


def _vector(mixture: Mapping[str, float], sources: Sequence[str], where: str) -> Weights:
    unknown = sorted(set(mixture) - set(sources))
    if unknown:
        raise ConfigError(f"{where}: unknown source(s) {unknown}; the job's sources are {list(sources)}")
    vec = np.array([float(mixture.get(s, 0.0)) for s in sources])
    if (vec < 0).any() or not np.isfinite(vec).all() or vec.sum() <= 0:
        raise ConfigError(f"{where}: weights {dict(mixture)} must be finite, >= 0 and not all 0")
    return vec


@dataclass(frozen=True, slots=True)
class Constant:
    """The same weights at every step."""

    vector: Weights

    def weights(self, step: float) -> Weights:
        return self.vector

    def mixtures(self) -> list[Weights]:
        return [self.vector]


@dataclass(frozen=True, slots=True)
class Piecewise:
    """Weights that change at given steps: the last point at or before the step applies."""

    steps: NDArray[np.int64]
    vectors: NDArray[np.float64]  # [points, sources]

    def weights(self, step: float) -> Weights:
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        row: Weights = self.vectors[max(i, 0)]
        return row

    def mixtures(self) -> list[Weights]:
        return list(self.vectors)


@dataclass(frozen=True, slots=True)
class Warmup:
    """Linear interpolation from `start` to `end` over `steps` steps from `begin`, then `end`."""

    start: Weights
    end: Weights
    begin: int
    steps: int

    def weights(self, step: float) -> Weights:
        t = min(max((step - self.begin) / self.steps, 0.0), 1.0)
        return (1 - t) * self.start + t * self.end

    def mixtures(self) -> list[Weights]:
        return [self.start, self.end]


class Dynamic:
    """Weights recomputed from trainer-reported metrics every `every` steps."""

    def __init__(self, fn: MixingFn, base: Weights, sources: Sequence[str], every: int) -> None:
        self.fn, self.base, self.sources, self.every = fn, base, list(sources), every
        self.current = base.copy()
        self.updated = -1  # step of the last update

    def due(self, step: int) -> bool:
        return step % self.every == 0 and self.updated != step

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """New weights from the metrics the trainers reported by `step`."""
        try:
            weights = np.asarray(self.fn(step, dict(metrics), self.base.copy(), list(self.sources)), dtype=np.float64)
        except Exception as exc:  # noqa: BLE001 - user code: report it with its origin
            raise ConfigError(
                f"dynamic mixing function {getattr(self.fn, '__name__', self.fn)!r} raised at step {step}: "
                f"{type(exc).__name__}: {exc}; fix mixing.fn"
            ) from exc
        if (
            weights.shape != self.base.shape
            or (weights < 0).any()
            or not np.isfinite(weights).all()
            or weights.sum() <= 0
        ):
            raise ConfigError(
                f"dynamic mixing function returned {weights!r} at step {step}; it must return "
                f"{len(self.base)} finite weights >= 0, not all 0"
            )
        self.current, self.updated = weights, step

    def weights(self, step: float) -> Weights:
        return self.current

    def mixtures(self) -> list[Weights]:
        return [self.base]  # what the metrics will ask for is not known ahead

    def state(self) -> dict[str, Any]:
        return {"weights": self.current.tolist(), "updated": self.updated}

    def load(self, state: Mapping[str, Any]) -> None:
        """Resume with the weights in force at a checkpoint."""
        self.current, self.updated = np.asarray(state["weights"], dtype=np.float64), int(state["updated"])


def loss_proportional(
    step: int, metrics: Mapping[str, float], base: Weights, sources: Sequence[str], temperature: float = 1.0
) -> Weights:
    """Up-weight sources whose reported loss (`loss/<source>`) is above the mean.

    weight_s = base_s * exp(temperature * (loss_s - mean loss)); a source without a
    reported loss keeps its base weight.
    """
    losses = np.array([metrics.get(f"loss/{s}", np.nan) for s in sources], dtype=np.float64)
    if np.isnan(losses).all():
        return base
    gap = np.where(np.isnan(losses), 0.0, losses - np.nanmean(losses))
    return base * np.exp(temperature * gap)


UNITS = ("step", "substep", "epoch")


def mixing_unit(mixing: Mixing | Mapping[str, Any] | None) -> str:
    """What the schedule's time axis counts: steps (default), micro-batches within a
    step ("substep": micro-batch m of step t mixes as t + m/M), or the job's epochs."""
    return Mixing.of(mixing).unit if mixing is not None else "step"


def from_config(
    mixing: Mixing | Mapping[str, Any] | None, sources: Sequence[str], default: Sequence[float]
) -> Constant | Piecewise | Warmup | Dynamic:
    """Build the job's schedule from its `mixing` config (a `Mixing`, or a dict of its
    fields; None: constant source weights)."""
    if mixing is None:
        return Constant(np.asarray(default, dtype=np.float64))
    mixing = Mixing.of(mixing)
    kind = mixing.kind
    if kind == "constant" and mixing.weights is not None:
        return Constant(_vector(mixing.weights, sources, "mixing.weights"))
    if kind == "piecewise":
        points = sorted(mixing.points or (), key=lambda p: p[0])
        if not points or points[0][0] != 0:
            raise ConfigError("mixing.points must start at step 0, e.g. [[0, {web: 1.0}], [1000, {...}]]")
        return Piecewise(
            np.array([p[0] for p in points], dtype=np.int64),
            np.stack([_vector(p[1], sources, f"mixing.points[{i}]") for i, p in enumerate(points)]),
        )
    if kind == "warmup" and mixing.start is not None and mixing.end is not None and mixing.steps is not None:
        return Warmup(
            _vector(mixing.start, sources, "mixing.start"),
            _vector(mixing.end, sources, "mixing.end"),
            mixing.begin,
            mixing.steps,
        )
    if kind == "dynamic":
        every = mixing.every
        try:
            fn = resolve(mixing.fn)
        except ConfigError as exc:
            raise ConfigError(f"mixing.fn: {exc}") from None
        return Dynamic(fn, np.asarray(default, dtype=np.float64), sources, every)
    raise ConfigError(f"mixing.kind={kind!r}; use constant, piecewise, warmup or dynamic")
