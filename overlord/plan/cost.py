"""Cost models: sample metadata in, a FLOP-proportional float64 cost out (pure, vectorised).

The Planner's `cost(fn)` primitive turns each sample's metadata (token count, image
patches) into the number the balancers even out across DP ranks and micro-batches.

Transformer forward FLOPs of one document of L tokens, per layer, hidden size h
(MLP width 4h, causal mask ignored, as in the Megatron / PaLM FLOP counts):

    dense matmuls:  24 h^2 L    (QKV 6h^2 + output 2h^2 + MLP 16h^2, 2 FLOPs a MAC)
    attention:       4 h L^2    (QK^T and scores x V, 2 h L^2 each)

so cost(L) = layers * (24 h^2 L + 4 h L^2). Documents are packed with per-document
attention masks (`cu_seqlens`), so a micro-batch costs the sum of its documents' costs
and the quadratic term is per document, not per packed row. Backward is ~2x forward
for every term, which does not change the balance, so it is left out.

A ViT encoder is the same formula over an image's patches with attention inside the
image (bidirectional): `encoder_cost(patches)`, quadratic in patches per image. For a
sample with several images, sum `encoder_cost` over its images.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from overlord.errors import ConfigError, PlanError

CostFn = Callable[[np.ndarray], np.ndarray]


def _lengths(x: ArrayLike, what: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        where = np.unravel_index(int(np.argmax(bad)), arr.shape)
        raise PlanError(
            f"{what} must be finite and >= 0, got {float(arr[where])!r} at index "
            f"{tuple(map(int, where))}; check the sample metadata"
        )
    return arr


def transformer_cost(tokens: ArrayLike, *, hidden: int = 4096, layers: int = 1) -> np.ndarray:
    """Forward FLOPs of a decoder over documents of `tokens` length each.

    Args:
        tokens: document lengths (scalar or array, any shape).
        hidden: model width h.
        layers: number of layers (a common factor: it does not change the balance).

    Returns:
        float64 array of `layers * (24 h^2 L + 4 h L^2)`, the shape of `tokens`.

    Raises:
        PlanError: a length is negative or not finite.
    """
    return _block_flops(_lengths(tokens, "token counts"), hidden, layers)


def encoder_cost(patches: ArrayLike, *, hidden: int = 1024, layers: int = 1) -> np.ndarray:
    """Forward FLOPs of a ViT over images of `patches` patches each (0: no image).

    Args:
        patches: patches per image (scalar or array, any shape).
        hidden: encoder width h.
        layers: number of layers.

    Returns:
        float64 array of `layers * (24 h^2 P + 4 h P^2)`, the shape of `patches`.

    Raises:
        PlanError: a count is negative or not finite.
    """
    return _block_flops(_lengths(patches, "patch counts"), hidden, layers)


def _block_flops(n: np.ndarray, hidden: int, layers: int) -> np.ndarray:
    """Transformer blocks over sequences of n positions: dense matmuls plus attention."""
    h = float(hidden)
    flops: np.ndarray = layers * (24.0 * h * h * n + 4.0 * h * n * n)
    return flops


def token_cost(tokens: ArrayLike) -> np.ndarray:
    """Linear cost: the token count itself (memory / HBM proxy for text pretraining)."""
    return _lengths(tokens, "token counts").copy()


COSTS: dict[str, CostFn] = {
    "tokens": token_cost,
    "attention": transformer_cost,
    "patches": encoder_cost,
}


def get_cost(name: str) -> CostFn:
    """The cost model registered as `name`.

    Raises:
        ConfigError: no cost model has that name; the message lists the known ones.
    """
    try:
        return COSTS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown cost model {name!r}; known: {', '.join(sorted(COSTS))}") from None


__all__ = sorted(["COSTS", "CostFn", "encoder_cost", "get_cost", "token_cost", "transformer_cost"])
