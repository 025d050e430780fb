"""Buffer metadata: what a Source Loader tells the Planner about its prepared samples.

One Redis stream entry (`overlord:{job}:meta:<stream>`) describes a chunk of samples
that entered the loader's read buffer, in the loader's order: per sample its seq in the
epoch order, token count, image patches (0 for text) and prepared bytes; the chunk's
epoch, the epochs completed, whether the loader read every configured epoch, and the
Planner generation it reported to (see below). The entry's fields and encodings are
`overlord.store.schema`'s (`meta_entry`), listed in docs/reference/redis.md.

A Planner that takes over knows only its checkpoint's cursors, so every loader, on
seeing the new token, reports its whole unsent read buffer again tagged with it; the
Planner reads only chunks tagged with its own token. Chunks reported to the old
Planner would otherwise arrive ahead of the repeated ones, out of order.

A chunk may carry no samples (only `ended`/`final`). Everything is a plain array or
JSON: nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from overlord.store.schema import META_ARRAYS, meta_entry, meta_fields


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
    arrays = {name: getattr(chunk, name) for name in META_ARRAYS}
    return meta_entry(arrays, chunk.epoch, chunk.ended, chunk.final, chunk.token)


def decode(fields: dict[bytes, bytes]) -> MetaChunk:
    """Inverse of `encode` (field names as bytes, as redis-py returns them).

    Raises:
        ValueError: the chunk's arrays disagree in length.
    """
    return MetaChunk(**meta_fields(fields))  # the entry's fields are MetaChunk's
