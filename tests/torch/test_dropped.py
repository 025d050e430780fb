"""A micro-batch a rank already has is dropped, and the ring the rank reads says how far
the rank is. On several nodes a rank reads another node's stream while its own node's
constructor host runs there; back on its own ring it drops what the new host there
sends again (and the other way round, the endpoint skips it). The mark of the ring it
reads must follow: the Data Constructor publishes it for the Planner, which plans no
step past it + plan_ahead, so a mark left behind while the rank waits for the next step
held the whole job (found by random kills and link cuts on two namespaced hosts)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.remote.flight import RemoteReader, serve
from overlord.runtime.layout import client_ring
from overlord.shm import Ring, decode_batch, write_batch
from overlord.torch import DataLoader


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _job(tmp_path) -> Job:
    path = tmp_path / "web.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(8)]}), path)
    return Job(
        name=f"drop{time.monotonic_ns() % 10**9}",
        sources=(Source(name="web", paths=(str(path),)),),
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=2, micro_batches=2, context_length=16),
        run_dir=str(tmp_path / "run"),
    )


def _send(ring: Ring, step: int, mb: int) -> None:
    """What a Data Constructor writes: micro-batch `mb` of `step`."""
    write_batch(ring, {"input_ids": np.full(4, step * 2 + mb, np.int64)}, {"step": step, "microbatch": mb}, timeout=5)


def _steps_3_and_4_again(ring: Ring) -> None:
    """What a new constructor host sends from the rank's published mark on: steps the
    rank had already from elsewhere."""
    for step in (3, 4):
        for mb in (0, 1):
            _send(ring, step, mb)


def test_a_micro_batch_the_rank_has_is_dropped_and_its_ring_says_how_far_the_rank_is(tmp_path):
    job = _job(tmp_path)
    ring = Ring.create(client_ring(job, 0), 1 << 16)  # this process plays the sidecar
    try:
        ring.claim_producer()
        loader = DataLoader(job, rank=0, world_size=1, spawn_sidecar=False, timeout_s=10)
        # the rank had steps 3 and 4 from another node's stream before it came back to
        # its own ring (white-box: what ServingNodeReader delivered from there)
        loader._last = (4, 1)
        _steps_3_and_4_again(ring)
        got: list = []
        reading = threading.Thread(target=lambda: got.append(next(loader)), daemon=True)
        reading.start()
        _until(lambda: loader.dropped == 4, f"the 4 batches the rank has were not dropped: {loader.dropped}")
        _until(lambda: ring.consumer_mark == 5, f"the ring's mark stayed at {ring.consumer_mark}, not 5 (step 4 + 1)")
        assert not got, "nothing new was sent"
        _send(ring, 5, 0)
        reading.join(timeout=10)
        assert got and int(got[0]["input_ids"][0]) == 10 and loader.last_meta["step"] == 5
        assert ring.consumer_mark == 6
        loader.close()
    finally:
        ring.close()
        ring.unlink()


def test_a_stream_over_flight_after_what_the_rank_has_marks_the_ring_at_once(tmp_path):
    job = _job(tmp_path)
    ring = Ring.create(client_ring(job, 0), 1 << 16)
    server = reader = None
    try:
        ring.claim_producer()
        _steps_3_and_4_again(ring)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = serve(job, port, "secret", host="127.0.0.1")
        # the rank read steps 3 and 4 from its own node's ring before it came here
        reader = RemoteReader(job, f"grpc://127.0.0.1:{port}", 0, token="secret", after=(4, 1), timeout_s=10)
        got: list = []
        reading = threading.Thread(target=lambda: got.append(bytes(next(reader))), daemon=True)
        reading.start()
        _until(lambda: ring.consumer_mark == 5, f"the ring's mark stayed at {ring.consumer_mark}, not 5 (step 4 + 1)")
        assert not got, "nothing new was sent"
        _send(ring, 5, 0)
        reading.join(timeout=10)
        assert got and decode_batch(memoryview(got[0]))[1]["step"] == 5
    finally:
        if reader is not None:
            reader.close()
        if server is not None:
            server.shutdown()
        ring.close()
        ring.unlink()
