"""Micro-batch transforms: packing or padding samples into fixed-length rows.

Pure functions over numpy arrays. A micro-batch from `pack` has

    input_ids     int64   [rows, L]  documents laid end to end, 0 after the last one
    labels        int64   [rows, L]  next token inside each document, -100 elsewhere
    position_ids  int64   [rows, L]  0.. restarting at every document
    loss_mask     float32 [rows, L]  1 where labels count
    cu_seqlens    int32   [segments + 1]  segment boundaries over the flattened rows*L
                                          tokens; each row's padding is a segment of
                                          its own so the last entry is rows*L
    max_seqlen    int32   []         longest segment
    doc_lengths   int32   [docs]     length of every document, in order
    pixel_values  uint8   [patches, 768]  (image sources only) all images' patches
    image_grid    int32   [images, 2]     patch rows and columns of each image
    image_doc     int32   [images]        index of the document each image belongs to

With packing off, every document gets its own row padded to the longest one (at most
L) and `attention_mask` replaces cu_seqlens. Documents longer than L are truncated to L
(the caller counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IGNORE_INDEX = -100


def _tokens(sample: dict[str, np.ndarray], limit: int) -> np.ndarray:
    ids = sample.get("input_ids")
    if ids is None:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(ids).reshape(-1)[:limit]


def _rows_next_fit(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Documents (in order) into rows of `limit` tokens: next-fit, so order is kept."""
    rows: list[list[int]] = []
    used = limit
    for i, n in enumerate(lengths):
        if used + n > limit or not rows:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def _images(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    pix, grid, doc = [], [], []
    for i, s in enumerate(samples):
        if "pixel_values" in s:
            pix.append(s["pixel_values"].reshape(len(s["pixel_values"]), -1))
            g = s.get("image_grid")
            g = (
                np.asarray(g, dtype=np.int32).reshape(-1, 2)
                if g is not None
                else np.array([[len(pix[-1]), 1]], np.int32)
            )
            grid.append(g)
            doc.extend([i] * len(g))
    if not pix:
        return {}
    return {
        "pixel_values": np.concatenate(pix),
        "image_grid": np.concatenate(grid).astype(np.int32),
        "image_doc": np.asarray(doc, dtype=np.int32),
    }


def pack(samples: Sequence[dict[str, np.ndarray]], context_length: int) -> tuple[dict[str, np.ndarray], int]:
    """Pack documents into rows of `context_length` tokens.

    Returns:
        (micro-batch arrays, number of documents that were truncated).
    """
    L = context_length
    docs = [_tokens(s, L) for s in samples]
    truncated = sum(1 for s in samples if "input_ids" in s and np.asarray(s["input_ids"]).size > L)
    rows = _rows_next_fit([len(d) for d in docs], L)
    R = len(rows)
    input_ids = np.zeros((R, L), dtype=np.int64)
    labels = np.full((R, L), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((R, L), dtype=np.int64)
    cu = [0]
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            d = docs[i]
            n = len(d)
            input_ids[r, at : at + n] = d
            if n > 1:
                labels[r, at : at + n - 1] = d[1:]
            position_ids[r, at : at + n] = np.arange(n)
            at += n
            cu.append(r * L + at)
        if at < L:
            position_ids[r, at:] = np.arange(L - at)
            cu.append((r + 1) * L)
    cu_seqlens = np.asarray(cu, dtype=np.int32)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "loss_mask": (labels != IGNORE_INDEX).astype(np.float32),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": np.asarray(np.diff(cu_seqlens).max() if len(cu_seqlens) > 1 else 0, dtype=np.int32),
        "doc_lengths": np.asarray([len(d) for d in docs], dtype=np.int32),
    }
    out.update(_images(samples))
    return out, truncated


def pad(samples: Sequence[dict[str, np.ndarray]], context_length: int) -> tuple[dict[str, np.ndarray], int]:
    """One document per row, padded to the longest (at most `context_length`)."""
    docs = [_tokens(s, context_length) for s in samples]
    truncated = sum(1 for s in samples if "input_ids" in s and np.asarray(s["input_ids"]).size > context_length)
    L = max((len(d) for d in docs), default=0)
    B = len(docs)
    input_ids = np.zeros((B, L), dtype=np.int64)
    labels = np.full((B, L), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((B, L), dtype=np.int64)
    for r, d in enumerate(docs):
        n = len(d)
        input_ids[r, :n] = d
        labels[r, : max(n - 1, 0)] = d[1:]
        attention_mask[r, :n] = 1
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": np.broadcast_to(np.arange(L, dtype=np.int64), (B, L)).copy(),
        "loss_mask": (labels != IGNORE_INDEX).astype(np.float32),
        "doc_lengths": np.asarray([len(d) for d in docs], dtype=np.int32),
    }
    out.update(_images(samples))
    return out, truncated
