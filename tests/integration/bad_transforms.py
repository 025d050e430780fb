"""Transforms that break the transform output contract on some rows (Source Loaders
load them as module:function, in their own processes), and a factory that fails.

A row is bad when `is_bad(text)`: about one row in seven, the same in every process."""

from __future__ import annotations

import zlib

import numpy as np

from overlord.transforms import text


def is_bad(value: str) -> bool:
    return zlib.crc32(value.encode("utf-8")) % 7 == 0


def fractional_ids(row):
    """float64 input_ids: integral on good rows (accepted, cast), +0.5 on bad ones."""
    ids = text(row)["input_ids"].astype(np.float64)
    return {"input_ids": ids + 0.5 if is_bad(row["text"]) else ids}


def nan_ids(row):
    """float32 input_ids with a NaN on bad rows."""
    ids = text(row)["input_ids"].astype(np.float32)
    if is_bad(row["text"]):
        ids[len(ids) // 2] = np.nan
    return {"input_ids": ids}


def ids_2d(row):
    """input_ids as [n, 1] on bad rows."""
    ids = text(row)["input_ids"]
    return {"input_ids": ids.reshape(-1, 1) if is_bad(row["text"]) else ids}


def string_field(row):
    """A str array next to the ids on bad rows."""
    out = text(row)
    if is_bad(row["text"]):
        out["source_text"] = np.array([row["text"]])
    return out


def object_field(row):
    """An object array next to the ids on bad rows."""
    out = text(row)
    if is_bad(row["text"]):
        out["meta"] = np.array([{"text": row["text"]}], dtype=object)
    return out


def failing_factory(**kwargs):
    """A transform factory (Source.transform_args) that cannot build its transform."""
    raise FileNotFoundError(f"tokenizer file {kwargs.get('tokenizer')!r} does not exist")
