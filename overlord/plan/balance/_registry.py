"""The balancers by name: `BALANCERS`, and the extension point `register_balancer`."""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from overlord.errors import ConfigError
from overlord.plan.balance._greedy import greedy
from overlord.plan.balance._kk import karmarkar_karp


class Balancer(Protocol):
    """The signature of a balancer (see the package docstring for the contract).

    `assign` calls one with float64 costs and sizes; it answers one bin in [-1, k) per
    item (int64; an answer of another integer dtype is accepted and converted).
    """

    def __call__(
        self,
        costs: NDArray[np.float64],
        k: int,
        *,
        sizes: NDArray[np.float64] | None = None,
        capacity: float | None = None,
        max_count: int | None = None,
        equal_count: bool = False,
    ) -> NDArray[np.int64]: ...


BALANCERS: dict[str, Balancer] = {"greedy": greedy, "karmarkar_karp": karmarkar_karp}


def register_balancer(name: str, fn: Balancer, *, replace: bool = False) -> None:
    """Add a user-defined balancer (e.g. zig-zag) under `name`.

    Raises:
        ConfigError: `name` is taken (pass replace=True to override) or fn is not callable.
    """
    if not callable(fn):
        raise ConfigError(f"balancer {name!r} must be callable, got {type(fn).__name__}")
    if name in BALANCERS and not replace:
        raise ConfigError(f"balancer {name!r} is already registered; pass replace=True to override")
    BALANCERS[name] = fn


def get_balancer(name: str) -> Balancer:
    """The balancer registered as `name`.

    Raises:
        ConfigError: no balancer has that name; the message lists the known ones.
    """
    try:
        return BALANCERS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown balancer {name!r}; known: {', '.join(sorted(BALANCERS))} (add one with register_balancer)"
        ) from None
