"""A ring's two notes: a few bytes its consumer leaves for whoever watches the ring (a
trainer's running totals) and a few its producer leaves for the consumer (a Data
Constructor host's last contact with the job's Redis), in the header's reserved bytes
(native/ring.h), so a ring that never had one reads zero.

Each is a sequence word, a length and the bytes. The one writer makes the word odd,
writes the bytes, then makes it even; a reader takes the bytes only between two equal,
even reads of the word, and looks up to three times. x86-64 keeps stores (and loads) in
order; a weakly ordered CPU (arm64) may in theory show a torn note, so notes carry
figures for operators, never data.
"""

from __future__ import annotations

import struct
import time

CONSUMER_NOTE = 2304
PRODUCER_NOTE = 2560
NOTE_BYTES = 248
_HEAD = struct.Struct("<II")  # sequence word, length
_SEQ = struct.Struct("<I")


def write_note(mv: memoryview, offset: int, note: bytes) -> None:
    """Replace the note at `offset` of a ring's mapping with `note`."""
    if len(note) > NOTE_BYTES:
        raise ValueError(f"a ring note holds at most {NOTE_BYTES} bytes, not {len(note)}")
    seq = _SEQ.unpack_from(mv, offset)[0] | 1
    _SEQ.pack_into(mv, offset, seq)  # odd: being written
    start = offset + _HEAD.size
    mv[start : start + len(note)] = note
    _HEAD.pack_into(mv, offset, (seq + 1) & 0xFFFFFFFF or 2, len(note))


def read_note(mv: memoryview, offset: int) -> bytes | None:
    """The note at `offset`, or None: none was set, or it was being rewritten at each
    of three looks."""
    start = offset + _HEAD.size
    for _ in range(3):
        seq, n = _HEAD.unpack_from(mv, offset)
        if seq == 0:
            return None
        if seq & 1:
            time.sleep(0)  # its writer is at it: let it finish
            continue
        note = bytes(mv[start : start + min(n, NOTE_BYTES)])
        if _SEQ.unpack_from(mv, offset)[0] == seq:
            return note
    return None
