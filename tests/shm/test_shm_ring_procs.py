"""Ring behaviour across processes: ordering and bytes, wake-ups, dead peers.

Children are `python -c` scripts that get only the segment name and ints in argv.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.errors import PeerDied, RingClosed, RingError
from overlord.shm import Ring, decode_batch, segment_name
from overlord.shm._batch import STREAM_BYTES

PRELUDE = """
import json, os, sys, time
import numpy as np
from overlord.shm import Ring, write_batch

def pattern(seed, i, n):
    return np.random.default_rng([seed, i]).integers(0, 256, n, dtype=np.uint8).tobytes()
"""

PRODUCER = (
    PRELUDE
    + """
name, seed, sizes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
r = Ring.attach(name, timeout=10)
r.claim_producer()
print("ready", flush=True)
for i, n in enumerate(sizes):
    r.write(pattern(seed, i, n), timeout=20)
r.close_writer()
"""
)

CONSUMER = (
    PRELUDE
    + """
name, seed, sizes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
r = Ring.attach(name, timeout=10)
r.claim_consumer()
print("ready", flush=True)
for i, n in enumerate(sizes):
    got = bytes(r.read(timeout=20))
    if got != pattern(seed, i, n):
        sys.exit(f"record {i}: {len(got)} B differ from the expected {n} B")
print("ok", len(sizes), flush=True)
"""
)

SERVER = (
    PRELUDE
    + """
from overlord.errors import RingClosed
ctl = Ring.attach(sys.argv[1], timeout=10)
ctl.claim_consumer()
print("ready", flush=True)
while True:
    try:
        cmd = json.loads(bytes(ctl.read(timeout=30)))
    except RingClosed:
        break
    with Ring.attach(cmd["ring"], timeout=10) as r:
        r.claim_producer()
        for i, n in enumerate(cmd["sizes"]):
            r.write(pattern(cmd["seed"], i, n), timeout=20)
        r.close_writer()
"""
)

IDLE = """
import sys, time
from overlord.shm import Ring
r = Ring.attach(sys.argv[1], timeout=10)
getattr(r, sys.argv[2])()
print("ready", flush=True)
time.sleep(60)
"""


def pattern(seed: int, i: int, n: int) -> bytes:
    return np.random.default_rng([seed, i]).integers(0, 256, n, dtype=np.uint8).tobytes()


def _drain(ring: Ring) -> None:
    try:
        while True:
            ring.read(timeout=20)
    except RingError:  # RingClosed, or the child died or stalled
        pass


@pytest.mark.timeout(60)
def test_records_cross_processes_in_order(job, spawn):
    """Child producer, parent consumer: any sizes 0..capacity-8 keep every byte and the order.

    One child serves every hypothesis example (process start-up dominates otherwise): it
    reads a JSON command per example from a control ring, attaches to that example's
    fresh data ring, writes the records and closes it.
    """
    ctl = Ring.create(segment_name(job, "n0", "ctl"), 4096)
    server = spawn(SERVER, ctl.name)
    server.ready()
    ctl.unlink()
    examples = iter(range(10**6))

    @settings(max_examples=100, deadline=None)
    @given(sizes=st.lists(st.integers(0, 4088), max_size=60), seed=st.integers(0, 2**16))
    def check(sizes, seed):
        r = Ring.create(segment_name(job, "n0", f"x{next(examples)}"), 4096)
        try:
            r.claim_consumer()
            ctl.write(json.dumps({"ring": r.name, "seed": seed, "sizes": sizes}).encode(), timeout=10)
            for i, n in enumerate(sizes):
                assert bytes(r.read(timeout=20)) == pattern(seed, i, n), f"record {i} of {sizes}"
            with pytest.raises(RingClosed):
                r.read(timeout=20)
        except BaseException:
            _drain(r)  # let the child finish this example so it can serve the next
            raise
        finally:
            r.close()
            r.unlink()

    check()
    assert next(examples) >= 20, "hypothesis ran too few examples to mean anything"
    ctl.close_writer()
    server.finish()
    ctl.close()


@pytest.mark.timeout(60)
def test_producer_blocks_until_consumer_frees_space(job, spawn):
    """Parent producer, child consumer, many wrap-arounds and full-ring waits."""
    name = segment_name(job, "n0", "stress")
    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(0, 3000, 3000)]
    with Ring.create(name, 8192) as r:
        r.claim_producer()
        child = spawn(CONSUMER, name, 7, json.dumps(sizes))
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        for i, n in enumerate(sizes):
            r.write(pattern(7, i, n), timeout=20)
        assert child.finish().split() == ["ok", str(len(sizes))]


BATCHES = """
r = Ring.attach(sys.argv[1], timeout=10)
r.claim_producer()
print("ready", flush=True)
for step in range(int(sys.argv[2])):
    write_batch(r, batch(step), {"step": step}, timeout=20)
r.close_writer()
"""


def batches_from_a_child(spawn, name: str, capacity: int, batch: str, steps: int):
    """Each (step, tensors) a child process writes with write_batch into a new ring of
    `capacity`, `batch` defining its `batch(step)`; then the end of the stream."""
    with Ring.create(name, capacity) as r:
        child = spawn(PRELUDE + textwrap.dedent(batch) + BATCHES, name, steps)
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        for step in range(steps):
            tensors, meta = decode_batch(r.read(timeout=20))
            assert meta == {"step": step}
            yield step, tensors
        with pytest.raises(RingClosed):
            r.read(timeout=20)
        child.finish()


@pytest.mark.timeout(60)
def test_batches_cross_processes(job, spawn):
    batch = """
    def batch(step):
        return {"x": np.arange(step * 1000, dtype=np.float32).reshape(-1, 10), "ids": np.full(3, step, np.int64)}
    """
    for step, tensors in batches_from_a_child(spawn, segment_name(job, "n0", "batch"), 1 << 20, batch, 20):
        np.testing.assert_array_equal(tensors["x"], np.arange(step * 1000, dtype=np.float32).reshape(-1, 10))
        np.testing.assert_array_equal(tensors["ids"], [step] * 3)


@pytest.mark.timeout(60)
def test_large_batches_streamed_in_by_another_process_arrive_whole(job, spawn):
    """Arrays past STREAM_BYTES go into the ring with streaming stores (weakly ordered:
    the producer fences them before its commit). Each batch is a fresh random pattern
    and the ring holds two a lap, so bytes of an earlier lap, or a record read before
    its bytes landed, would not match."""
    n = 3 * STREAM_BYTES // 2 + 40
    batch = f"""
    def batch(step):
        return {{"x": np.frombuffer(pattern(7, step, {n}), np.uint8)}}
    """
    for step, tensors in batches_from_a_child(spawn, segment_name(job, "n0", "big"), 4 << 20, batch, 24):
        want = np.random.default_rng([7, step]).integers(0, 256, n, dtype=np.uint8)
        assert np.array_equal(tensors["x"], want), f"batch {step} arrived with other bytes"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reaped", [False, True])
def test_consumer_sees_peer_died_when_producer_is_killed(job, spawn, reaped):
    name = segment_name(job, "n0", "dead")
    with Ring.create(name, 4096) as r:
        r.claim_consumer()
        child = spawn(IDLE, name, "claim_producer")
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        assert r.producer_pid == child.pid
        killed_at = []

        def kill():
            killed_at.append(time.monotonic())
            os.kill(child.pid, signal.SIGKILL)
            if reaped:
                child.proc.wait()

        threading.Timer(0.2, kill).start()
        with pytest.raises(PeerDied) as e:
            r.read(timeout=30)
        assert time.monotonic() - killed_at[0] < 5
        assert str(child.pid) in str(e.value) and name in str(e.value)


@pytest.mark.timeout(60)
def test_producer_sees_peer_died_when_consumer_is_killed(job, spawn):
    name = segment_name(job, "n0", "deadc")
    with Ring.create(name, 4096) as r:
        r.claim_producer()
        child = spawn(IDLE, name, "claim_consumer")
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        r.write(b"x" * 4000, timeout=1)  # ring full: the next write must wait
        os.kill(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match=f"consumer pid {child.pid}"):
            r.write(b"y" * 100, timeout=30)
        assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_error_set_in_another_process_wakes_the_consumer(job, spawn):
    name = segment_name(job, "n0", "err")
    script = """
import sys, time
from overlord.shm import Ring
r = Ring.attach(sys.argv[1], timeout=10)
r.claim_producer()
print("ready", flush=True)
time.sleep(0.3)
r.set_error("constructor dp0 on node n0 (pid %d): packing failed" % r.producer_pid)
"""
    with Ring.create(name, 4096) as r:
        child = spawn(script, name)
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        t0 = time.monotonic()
        with pytest.raises(RingError, match="packing failed") as e:
            r.read(timeout=20)
        assert time.monotonic() - t0 < 5
        assert str(child.pid) in str(e.value)
        child.finish()


@pytest.mark.timeout(60)
def test_close_writer_in_another_process_ends_the_stream(job, spawn):
    name = segment_name(job, "n0", "eof")
    with Ring.create(name, 4096) as r:
        child = spawn(PRODUCER, name, 3, json.dumps([10, 20]))
        child.ready()
        r.unlink()  # the child has it mapped; the name is no longer needed
        assert [len(r.read(timeout=20)) for _ in range(2)] == [10, 20]
        with pytest.raises(RingClosed):
            r.read(timeout=20)
        child.finish()
