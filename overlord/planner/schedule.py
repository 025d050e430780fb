"""Mixing schedules: the sampling weight of every source at every step.

A schedule is a pure function of the step (and of its own small state, which the
Planner checkpoints), so a restarted Planner mixes exactly as before. Declared in the
job config as `mixing:`; without it, each source's constant `weight` applies.

    mixing: {kind: piecewise, points: [[0, {web: 1.0}], [1000, {web: 0.5, code: 0.5}]]}
    mixing: {kind: warmup, start: {web: 1.0}, end: {web: 0.3, images: 0.7}, steps: 2000}

A source a mixture does not name gets weight 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from overlord.errors import ConfigError


def _vector(mixture: Mapping[str, float], sources: Sequence[str], where: str) -> np.ndarray:
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

    vector: np.ndarray

    def weights(self, step: int) -> np.ndarray:
        return self.vector


@dataclass(frozen=True, slots=True)
class Piecewise:
    """Weights that change at given steps: the last point at or before the step applies."""

    steps: np.ndarray
    vectors: np.ndarray

    def weights(self, step: int) -> np.ndarray:
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        return self.vectors[max(i, 0)]


@dataclass(frozen=True, slots=True)
class Warmup:
    """Linear interpolation from `start` to `end` over `steps` steps from `begin`, then `end`."""

    start: np.ndarray
    end: np.ndarray
    begin: int
    steps: int

    def weights(self, step: int) -> np.ndarray:
        t = min(max((step - self.begin) / self.steps, 0.0), 1.0)
        return (1 - t) * self.start + t * self.end


def from_config(mixing: Mapping[str, Any] | None, sources: Sequence[str], default: Sequence[float]):
    """Build the job's schedule from its `mixing` config (None: constant source weights)."""
    if mixing is None:
        return Constant(np.asarray(default, dtype=np.float64))
    kind = mixing.get("kind")
    if kind == "constant":
        return Constant(_vector(mixing["weights"], sources, "mixing.weights"))
    if kind == "piecewise":
        points = sorted(mixing.get("points") or [], key=lambda p: p[0])
        if not points or points[0][0] != 0:
            raise ConfigError("mixing.points must start at step 0, e.g. [[0, {web: 1.0}], [1000, {...}]]")
        return Piecewise(
            np.array([p[0] for p in points], dtype=np.int64),
            np.stack([_vector(p[1], sources, f"mixing.points[{i}]") for i, p in enumerate(points)]),
        )
    if kind == "warmup":
        steps = int(mixing.get("steps", 0))
        if steps < 1:
            raise ConfigError(f"mixing.steps={mixing.get('steps')!r} must be an int >= 1")
        return Warmup(
            _vector(mixing["start"], sources, "mixing.start"),
            _vector(mixing["end"], sources, "mixing.end"),
            int(mixing.get("begin", 0)),
            steps,
        )
    raise ConfigError(f"mixing.kind={kind!r}; use constant, piecewise or warmup")
