"""A digest of a batch's bytes, to check a resumed or re-run job against another run.

Exactly once and deterministic order are promises about bytes: the same seed and step
give the same batches. `batch_digest` names them in one string (tensor names, dtypes,
shapes and data, in name order), so a script can log one per batch and compare runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def batch_digest(batch: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of a batch's tensors: names, dtypes, shapes and bytes (moved to the CPU
    first if they are elsewhere)."""
    h = hashlib.sha256()
    for name in sorted(batch):
        t = batch[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
