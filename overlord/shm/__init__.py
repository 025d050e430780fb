"""Shared memory on one node: the SPSC ring, the batch wire format, segment names.

The local data path (Source Loader -> Data Constructor -> Client) moves records
through `Ring`s in POSIX shared memory; batches are encoded with `write_batch` and
read back zero-copy with `decode_batch`. Segment names come only from
`segment_name`; `cleanup_stale` removes what crashed processes left behind.
"""

from overlord.shm._batch import SampleMeta, batch_nbytes, decode_batch, encode_batch_into, write_batch
from overlord.shm._proc import pid_alive
from overlord.shm._pyring import Ring, wait_marks
from overlord.shm._segment import segment_bytes, unlink_segment
from overlord.shm.names import cleanup_stale, job_prefix, list_segments, segment_name, unlink_all

__all__ = [  # sorted
    "Ring",
    "SampleMeta",
    "batch_nbytes",
    "cleanup_stale",
    "decode_batch",
    "encode_batch_into",
    "job_prefix",
    "list_segments",
    "pid_alive",
    "segment_bytes",
    "segment_name",
    "unlink_all",
    "unlink_segment",
    "wait_marks",
    "write_batch",
]
