"""How a Data Constructor reads a loader process's ring: in place, so a sample is
copied once on its way from the Source Loader's transform to the trainer's batch.

The loader writes each transformed sample straight into the ring (the one copy); the
constructor decodes the record as numpy views over the shared memory and packs the
micro-batch from them. Each record is a lease (`overlord.shm._lease.LeasedReader`):
its ring space stays the loader's to skip until every array over it is garbage, that
is until the step that uses it was packed and written (or a later step's sample, kept
aside, was). When the leases hold so much of the ring that the loader waits for
space, the reader gives the held pages private copies (counted in `copies`), so a
ring smaller than a step's samples costs a copy, never a deadlock or an overwrite.

A ring taken over from a live consumer (this node's Flight endpoint, serving it to the
group's constructor on another node until this one claimed it) is read by copy: the
endpoint may release one record it read before it saw the claim change, which would
move the tail under a lease.
"""

from __future__ import annotations

import numpy as np

from overlord.errors import PeerDied
from overlord.shm import Ring
from overlord.shm._lease import LeasedReader


class LeasedInput:
    """A loader ring read in place (see the module docstring)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.reader = LeasedReader(ring)

    def try_read(self) -> np.ndarray | None:
        try:
            return self.reader.try_read()
        except PeerDied:
            return None

    def read(self, timeout: float) -> np.ndarray:
        return self.reader.read(timeout)

    @property
    def leased(self) -> int:
        return self.reader.leased

    @property
    def copies(self) -> int:
        return self.reader.copies

    def close(self) -> None:
        self.reader.close()
        self.ring.close()  # a lease still alive keeps its mapping until it is garbage


class CopiedInput:
    """A loader ring read by copy: each record copied out and released at once."""

    leased = 0

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.copies = 0

    def _copy(self, view) -> bytearray:
        record = bytearray(view)
        self.ring.release()
        self.copies += 1
        return record

    def try_read(self) -> bytearray | None:
        try:
            view = self.ring.try_read()
        except PeerDied:
            return None
        return None if view is None else self._copy(view)

    def read(self, timeout: float) -> bytearray:
        return self._copy(self.ring.read(timeout=timeout))

    def close(self) -> None:
        self.ring.close()


def open_input(ring: Ring, *, take_over: bool) -> LeasedInput | CopiedInput:
    """Claim the consumer side of `ring` and read it in place, or by copy when the side
    was taken from a live process (`take_over`, on several nodes)."""
    if ring.claim_consumer(take_over=take_over):
        return CopiedInput(ring)
    return LeasedInput(ring)
