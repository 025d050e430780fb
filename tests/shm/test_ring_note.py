"""A ring's consumer note: a few bytes the consumer leaves for whoever watches the ring
(a trainer's running totals, which its Data Constructor host publishes), read through
another mapping, in another process, never torn."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from overlord.shm import Ring, _note, segment_name


def test_a_new_ring_has_no_note_and_a_note_reads_back_through_another_mapping(job):
    name = segment_name(job, "n0", "note")
    with Ring.create(name, 4096) as producer, Ring.attach(name, 1) as consumer:
        assert producer.consumer_note() is None
        consumer.set_consumer_note(b'{"batches":3}')
        assert producer.consumer_note() == b'{"batches":3}'
        consumer.set_consumer_note(b"x" * _note.NOTE_BYTES)  # the most it holds
        assert producer.consumer_note() == b"x" * _note.NOTE_BYTES
        consumer.set_consumer_note(b"short")  # replaces the longer one whole
        assert producer.consumer_note() == b"short"
        # the producer's note, for the consumer, is another
        assert consumer.producer_note() is None
        producer.set_producer_note(b"from the producer")
        assert consumer.producer_note() == b"from the producer" and producer.consumer_note() == b"short"
        with pytest.raises(ValueError, match="at most"):
            consumer.set_consumer_note(b"x" * (_note.NOTE_BYTES + 1))
        assert producer.consumer_note() == b"short"
        # the note lives in the header's reserved bytes: records leave it alone
        view = producer.reserve(4000, timeout=1)
        view[:] = b"\xff" * 4000
        producer.commit()
        assert producer.consumer_note() == b"short"
        producer.unlink()


def test_a_note_caught_while_being_written_is_not_returned(job):
    name = segment_name(job, "n0", "torn")
    with Ring.create(name, 4096) as producer:
        producer.set_consumer_note(b"whole")
        with open(f"/dev/shm{name}", "r+b") as fh, mmap.mmap(fh.fileno(), 4096) as raw:
            seq = int.from_bytes(raw[_note.CONSUMER_NOTE : _note.CONSUMER_NOTE + 4], "little")
            assert seq % 2 == 0 and seq > 0
            # a writer stopped halfway (odd sequence word), new bytes over the old
            raw[_note.CONSUMER_NOTE : _note.CONSUMER_NOTE + 4] = (seq + 1).to_bytes(4, "little")
            raw[_note.CONSUMER_NOTE + 8 : _note.CONSUMER_NOTE + 13] = b"WHO.."
            assert producer.consumer_note() is None
            # the next whole note (after a crash mid-write too) reads again
            producer.set_consumer_note(b"again")
            assert producer.consumer_note() == b"again"
            assert int.from_bytes(raw[_note.CONSUMER_NOTE : _note.CONSUMER_NOTE + 4], "little") % 2 == 0
        producer.unlink()


def test_a_note_set_in_another_process_is_read_here(job):
    name = segment_name(job, "n0", "proc")
    with Ring.create(name, 4096) as producer:
        code = (
            "import sys\nfrom overlord.shm import Ring\n"
            "ring = Ring.attach(sys.argv[1], 5)\n"
            "for i in range(200):\n    ring.set_consumer_note(b'%d' % i)\n"
            "ring.close()\n"
        )
        done = subprocess.run([sys.executable, "-c", code, name], env=dict(os.environ), timeout=60)
        assert done.returncode == 0
        assert producer.consumer_note() == b"199"
        producer.unlink()
