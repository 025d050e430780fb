"""The transform output contract: what a transform may return, checked where the sample
is made (the Source Loader, before a sample enters its read buffer).

A transform returns ``dict[str, numpy.ndarray]``. Pure functions over that dict:

- Every array's dtype is one the batch format carries (`overlord.shm` `_batch`): bool,
  int8..int64, uint8..uint64, float16, float32, float64. A string, bytes or object
  array is refused.
- Integer-bound fields (`INTEGER_FIELDS`: the token ids the packing reads, ``labels``,
  and ``image_grid``) hold integers. A float array is accepted only if every value is
  finite and integral, and is then cast to int64; fractions are never truncated and
  NaN or inf never cast (numpy would turn NaN into -9223372036854775808).
- Token ids (`TOKEN_FIELDS`) are 1-D and within ``[0, vocab_size)`` when the job states
  ``BatchSpec.vocab_size`` (never negative either way); ``labels`` may also hold the
  ignore index -100.
- Images as `overlord.transforms.image_text` defines them: ``image_grid`` is
  ``[images, 2]`` (patch rows, patch columns, each >= 1) and ``pixel_values`` is
  ``[patches, patch bytes]`` with as many patches as the grid announces.

A violation raises `ContractError` naming the field, the values and the fix; the Source
Loader adds the source, file and row and applies the source's ``on_error`` policy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from overlord.constructor.packing import IGNORE_INDEX

TOKEN_FIELDS = ("input_ids", "labels")
"""Token ids: 1-D, integral, within the vocabulary."""
INTEGER_FIELDS = (*TOKEN_FIELDS, "image_grid")
"""Fields whose values the packing uses as integers (ids, counts)."""

_ALLOWED = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
))  # fmt: skip
_ALLOWED_TEXT = "bool, int8..int64, uint8..uint64, float16, float32, float64"


class ContractError(ValueError):
    """A transform's output breaks the contract; the message names the field."""


def _dtype_allowed(dtype: np.dtype) -> bool:
    return dtype.newbyteorder("=") in _ALLOWED


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.reshape(-1))[0])


def _integral(name: str, arr: np.ndarray) -> np.ndarray:
    """`arr` as integers: ints as they are, floats only when all finite and integral."""
    if arr.dtype.kind in "iu":
        return arr
    if arr.dtype.kind != "f":
        raise ContractError(
            f"field {name!r} has dtype {arr.dtype}; it holds integers: return an integer array (e.g. np.int32)"
        )
    flat = arr.reshape(-1)
    finite = np.isfinite(flat)
    if not finite.all():
        at = _first(~finite)
        raise ContractError(
            f"field {name!r} (dtype {arr.dtype}) holds {float(flat[at])} at index {at} "
            f"({int((~finite).sum())} non-finite of {flat.size}); it holds integers: "
            "fix the transform so it never yields NaN or inf there"
        )
    fractional = flat != np.floor(flat)
    if fractional.any():
        at = _first(fractional)
        raise ContractError(
            f"field {name!r} (dtype {arr.dtype}) holds the fraction {float(flat[at])} at index {at} "
            f"({int(fractional.sum())} of {flat.size} values not integral); it holds integers: "
            "return an integer array (e.g. np.int32) from the transform"
        )
    return arr.astype(np.int64)


def _token_range(name: str, ids: np.ndarray, vocab_size: int | None) -> None:
    low = ids < 0
    if name == "labels":
        low &= ids != IGNORE_INDEX
    if vocab_size is not None:
        high = ids >= vocab_size
    elif ids.dtype == np.uint64:  # the packing's int64 would wrap these to negative ids
        high = ids > np.iinfo(np.int64).max
    else:
        high = np.zeros(ids.shape, dtype=bool)
    bad = low | high
    if bad.any():
        at = _first(bad)
        bound = f"[0, {vocab_size})" if vocab_size is not None else f"[0, {np.iinfo(np.int64).max}]"
        fix = (
            "fix the transform's tokenizer, or BatchSpec.vocab_size if the model's vocabulary is larger"
            if vocab_size is not None
            else "fix the transform"
        )
        ignore = f" (or {IGNORE_INDEX})" if name == "labels" else ""
        raise ContractError(
            f"field {name!r} holds token id {int(ids[at])} at index {at} ({int(bad.sum())} of {ids.size} outside "
            f"{bound}{ignore}); token ids must lie in {bound}{ignore}: {fix}"
        )


def _images(out: dict[str, np.ndarray]) -> None:
    grid = out.get("image_grid")
    if grid is not None:
        if grid.ndim != 2 or grid.shape[1] != 2:
            raise ContractError(
                f"field 'image_grid' has shape {grid.shape}; it is [images, 2] (patch rows, patch columns per image), "
                "e.g. np.array([[h, w]], dtype=np.int32)"
            )
        if (grid < 1).any():
            raise ContractError(
                f"field 'image_grid' holds {grid.tolist()}; every image has at least 1 patch row and column"
            )
    pixels = out.get("pixel_values")
    if pixels is not None:
        if pixels.ndim != 2:
            raise ContractError(
                f"field 'pixel_values' has shape {pixels.shape}; it is [patches, bytes per patch] "
                "(image_text: [h_patches * w_patches, 16 * 16 * 3]): reshape it so"
            )
        if grid is not None:
            announced = int((grid[:, 0].astype(np.int64) * grid[:, 1]).sum())
            if announced != pixels.shape[0]:
                raise ContractError(
                    f"field 'pixel_values' has {pixels.shape[0]} patches but 'image_grid' {grid.tolist()} announces "
                    f"{announced}; make the grid the patch rows and columns of each image"
                )


def check_sample(arrays: object, *, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Checks one transform output against the contract.

    Args:
        arrays: what the transform returned for one row.
        vocab_size: the job's vocabulary size (``BatchSpec.vocab_size``); None checks
            only that token ids are not negative.

    Returns:
        The sample: the same arrays, except integer-bound float fields cast to int64.

    Raises:
        ContractError: the output breaks the contract; the message names the field,
            the offending value and what to change.
    """
    if not isinstance(arrays, Mapping):
        raise ContractError(f"returned {type(arrays).__name__}; a transform returns dict[str, numpy.ndarray]")
    out: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        if not isinstance(name, str):
            raise ContractError(f"returned a field named {name!r}; field names are str")
        if not isinstance(arr, np.ndarray):
            raise ContractError(
                f"field {name!r} is a {type(arr).__name__}; a transform returns dict[str, numpy.ndarray] "
                "(wrap it with np.asarray(..., dtype=...))"
            )
        if not _dtype_allowed(arr.dtype):
            raise ContractError(
                f"field {name!r} has dtype {arr.dtype}, which a batch cannot carry (one of: {_ALLOWED_TEXT}); "
                "return numbers, e.g. token ids as np.int32 or bytes as np.frombuffer(data, np.uint8)"
            )
        if name in INTEGER_FIELDS:
            arr = _integral(name, arr)
        if name in TOKEN_FIELDS:
            if arr.ndim != 1:
                raise ContractError(
                    f"field {name!r} has shape {arr.shape}; token ids are 1-D [tokens], one document per sample: "
                    "return one sequence per row (a row with several documents: one source row each)"
                )
            _token_range(name, arr, vocab_size)
        out[name] = arr
    _images(out)
    return out


__all__ = sorted(["INTEGER_FIELDS", "TOKEN_FIELDS", "ContractError", "check_sample"])
