"""Buffer metadata: what a Source Loader tells the Planner about its prepared samples.

One Redis stream entry (`overlord:{job}:meta:<stream>`) describes a chunk of samples
that entered the loader's read buffer, in the loader's order. Fields:

    epoch    ASCII int   epoch of every sample in the chunk
    seq      bytes       int64 little-endian [n]: seq of each sample in the epoch order
    tokens   bytes       int32 little-endian [n]: token count
    patches  bytes       int32 little-endian [n]: image patches (0 for text)
    nbytes   bytes       int64 little-endian [n]: bytes of the prepared sample
    ended    ASCII JSON  [[epoch, samples delivered in that epoch], ...] epochs completed
    final    ASCII 0/1   1 when the loader has read every configured epoch
    token    ASCII int   the Planner lease token the loader reported to (see below)

A Planner that takes over knows only its checkpoint's cursors, so every loader, on
seeing the new token, reports its whole unsent read buffer again tagged with it; the
Planner reads only chunks tagged with its own token. Chunks reported to the old
Planner would otherwise arrive ahead of the repeated ones, out of order.

A chunk may carry no samples (only `ended`/`final`). Everything is a plain array or
JSON: nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_ARRAYS = {"seq": "<i8", "tokens": "<i4", "patches": "<i4", "nbytes": "<i8"}


@dataclass(slots=True)
class MetaChunk:
    epoch: int
    seq: np.ndarray | Sequence[int]
    tokens: np.ndarray | Sequence[int]
    patches: np.ndarray | Sequence[int]
    nbytes: np.ndarray | Sequence[int]
    ended: list[tuple[int, int]] = field(default_factory=list)
    final: bool = False
    token: int = 0

    def __len__(self) -> int:
        return len(self.seq)


def encode(chunk: MetaChunk) -> dict[str, bytes]:
    """Stream-entry fields of a chunk."""
    out = {name: np.ascontiguousarray(getattr(chunk, name), dtype=dt).tobytes() for name, dt in _ARRAYS.items()}
    out["epoch"] = str(chunk.epoch).encode()
    out["ended"] = json.dumps([list(e) for e in chunk.ended]).encode()
    out["final"] = b"1" if chunk.final else b"0"
    out["token"] = str(chunk.token).encode()
    return out


def decode(fields: dict[bytes, bytes]) -> MetaChunk:
    """Inverse of `encode` (field names as bytes, as redis-py returns them)."""
    arrays = {name: np.frombuffer(fields[name.encode()], dtype=dt).astype(dt[1:]) for name, dt in _ARRAYS.items()}
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"meta chunk arrays disagree in length: { {k: len(v) for k, v in arrays.items()} }")
    return MetaChunk(
        epoch=int(fields[b"epoch"]),
        ended=[tuple(e) for e in json.loads(fields[b"ended"])],
        final=fields[b"final"] == b"1",
        token=int(fields.get(b"token", b"0")),
        **arrays,
    )
