"""Benchmark: shared-memory ring throughput and latency against memcpy and torch queues.

What is measured (all in one run, on this machine):

- ring_gb_per_s: a producer process encodes `--count` batches of one `--size-mb` float32
  tensor with `write_batch` (one copy: source array -> ring) into a ring; this consumer
  process `read`s each, `decode_batch`es it and copies the tensor out into a
  preallocated array (the copy a trainer makes into its own or pinned memory), checking
  the meta step and two values. Timed from the first timed batch to the last, after a
  warm-up that faults in every page of the ring. Bytes = tensor bytes (headers excluded).
- memcpy_gb_per_s: single-thread np.copyto between two preallocated arrays of the same
  size, repeated `--count` times in this process.
- ratio: ring / memcpy. Two copies happen per batch in the ring path, one per process,
  in parallel on two cores, so 1.0 is the ceiling when memory bandwidth is not shared.
- copy_out_gb_per_s, copy_out_ratio: the consumer's np.copyto of each tensor out of the
  ring in the ring_gb_per_s run, timed alone (the same copy as memcpy's, but of bytes
  the producer process wrote moments before on another core), and its ratio to memcpy.
  The ring path cannot outrun its own copy out, so copy_out_ratio bounds `ratio` on the
  machine: where it is low, cache lines crossing between cores cost it, not the ring.
- ring_vs_copy_out: ring / copy_out, what the ring itself (waits, headers, decode,
  release) leaves of that bound.
- next_latency_us: median time of `Ring.read()` when the next batch is already in the
  ring (written by the producer process; read() releases the previous record, wakes
  the producer and returns a view: no copy). next_decode_latency_us adds `decode_batch`.
- leased_gb_per_s, leased_ratio: the ring read as overlord.torch.DataLoader reads it: a
  `LeasedReader` hands out each record (the batch leases its ring space until its arrays
  die, so a trainer may hold it), decoded, wrapped in torch tensors, copied out, and
  dropped (the lease ends). leased_ratio is against memcpy measured in the same run.
- next_leased_latency_us: median time of what `DataLoader.__next__` does with a batch
  that is already in the ring: end the previous batch's lease, `LeasedReader.read()`,
  `decode_batch`, `torch.from_numpy` of its tensors (no copy).
- torch_queue_gb_per_s: the same transfer with torch.multiprocessing: a producer process
  allocates each batch tensor in shared memory (as DataLoader workers do), fills it from
  the source and puts it on a torch.multiprocessing Queue; this process gets it and
  copies it out. The fd passing and per-batch segment creation are the costs compared.

Usage: python bench/ring.py [--size-mb 4] [--count 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
try:
    import overlord.shm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from overlord.config import BatchSpec  # noqa: E402
from overlord.shm import Ring, batch_nbytes, decode_batch, segment_name, write_batch  # noqa: E402
from overlord.shm._lease import LeasedReader  # noqa: E402

WARMUP = 20
TIMEOUT_S = 60.0


def source(nbytes: int) -> np.ndarray:
    return np.arange(nbytes // 4, dtype=np.float32)


def bench_memcpy(nbytes: int, count: int) -> float:
    src, dst = source(nbytes), np.empty(nbytes // 4, np.float32)
    for _ in range(WARMUP):
        np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(count):
        np.copyto(dst, src)
    return nbytes * count / (time.perf_counter() - t0) / 1e9


def ring_producer(name: str, nbytes: int, count: int) -> None:
    """Child process: write WARMUP + count batches, then close the ring."""
    src = source(nbytes)
    with Ring.attach(name, timeout=TIMEOUT_S) as ring:
        ring.claim_producer()
        for step in range(WARMUP + count):
            src[0] = step  # each batch differs, as real ones do
            write_batch(ring, {"x": src}, {"step": step}, timeout=TIMEOUT_S)
        ring.close_writer()


def ring_capacity(nbytes: int) -> int:
    """A client ring of the job's default size (BatchSpec.ring_bytes, 16 MiB), or two
    batches if they are larger. (Four 4 MiB batches and their headers round up to a
    32 MiB ring, which with the source array outgrows a 32 MiB L3 cache and measured
    the cache, not the ring: 38 against 59 GB/s for the producer's copy alone.)"""
    return max(BatchSpec().ring_bytes, 2 * batch_nbytes({"x": source(nbytes)}, {"step": 0}))


class _Producer:
    """A ring (this process consumes) fed by `ring_producer` in a child process."""

    def __init__(self, nbytes: int, count: int) -> None:
        name = segment_name(f"bench-{uuid.uuid4().hex[:8]}", "local", "ring")
        self.ring = Ring.create(name, ring_capacity(nbytes))
        self.ring.claim_consumer()
        cmd = [sys.executable, __file__, "--role", "producer", "--name", self.ring.name,
               "--bytes", str(nbytes), "--count", str(count)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.child = subprocess.Popen(cmd, env=env)

    def __enter__(self) -> Ring:
        return self.ring

    def __exit__(self, *exc: object) -> None:
        self.ring.unlink()
        self.ring.close()
        if self.child.wait(timeout=TIMEOUT_S) != 0 and exc[0] is None:
            raise RuntimeError(f"producer exited {self.child.returncode}")


def bench_ring(nbytes: int, count: int, leased: bool = False) -> tuple[float, float]:
    """(ring GB/s, copy-out GB/s): the transfer's rate, and the rate of the consumer's
    copy of each tensor out of the ring timed alone (0.0 for the leased path, which
    does not copy)."""
    import torch

    dst = np.empty(nbytes // 4, np.float32)
    last = source(nbytes)[-1]
    copying = 0.0
    with _Producer(nbytes, count) as ring:
        read = LeasedReader(ring).read if leased else ring.read
        for step in range(WARMUP + count):
            if step == WARMUP:
                t0, copying = time.perf_counter(), 0.0
            tensors, meta = decode_batch(read(timeout=TIMEOUT_S))
            if leased:  # zero-copy: the trainer uses the tensor where it lies
                batch = {k: torch.from_numpy(v) for k, v in tensors.items()}
                x = batch["x"]
                dst[0], dst[-1] = x[0].item(), x[-1].item()
                del batch, tensors, x  # the trainer is done with it: the lease ends
            else:
                c0 = time.perf_counter()
                np.copyto(dst, tensors["x"])
                copying += time.perf_counter() - c0
            if meta["step"] != step or dst[0] != step or dst[-1] != last:
                raise RuntimeError(f"batch {step} arrived wrong: meta {meta}, x[0]={dst[0]}")
        elapsed = time.perf_counter() - t0
    return nbytes * count / elapsed / 1e9, (nbytes * count / copying / 1e9 if copying else 0.0)


def bench_leased_latency(nbytes: int, samples: int = 200) -> float:
    """Median time of DataLoader.__next__'s work on a batch already in the ring."""
    import torch

    times = []
    batch = None
    with _Producer(nbytes, samples) as ring:
        reader = LeasedReader(ring)
        for step in range(WARMUP + samples):
            time.sleep(0.002)  # a trainer's step: the producer refills and waits for space
            t0 = time.perf_counter()
            batch = None  # the previous batch's last tensor dies: its lease ends
            tensors, _ = decode_batch(reader.read(timeout=TIMEOUT_S))
            batch = {k: torch.from_numpy(v) for k, v in tensors.items()}
            del tensors
            t1 = time.perf_counter()
            if step >= WARMUP:
                times.append(t1 - t0)
        del batch  # held across the timed step above, as a trainer holds its batch
    return statistics.median(times) * 1e6


def bench_latency(nbytes: int, samples: int = 200) -> tuple[float, float]:
    """Median read() and read()+decode_batch() times when the next batch is already there.

    The consumer pauses 2 ms before each timed read (a trainer's step between next()
    calls), so the producer has refilled the ring and is asleep waiting for space: the
    timed read() also releases the previous record and wakes it, as in real use.
    """
    reads, decodes = [], []
    dst = np.empty(nbytes // 4, np.float32)
    with _Producer(nbytes, samples) as ring:
        for step in range(WARMUP + samples):
            time.sleep(0.002)
            t0 = time.perf_counter()
            view = ring.read(timeout=TIMEOUT_S)
            t1 = time.perf_counter()
            tensors, _ = decode_batch(view)
            t2 = time.perf_counter()
            np.copyto(dst, tensors["x"])
            if step >= WARMUP:
                reads.append(t1 - t0)
                decodes.append(t2 - t0)
    return statistics.median(reads) * 1e6, statistics.median(decodes) * 1e6


def torch_producer(queue, done, nbytes: int, count: int) -> None:
    import torch

    src = torch.from_numpy(source(nbytes))
    for step in range(WARMUP + count):
        # DataLoader workers allocate each batch in a fresh shared-memory storage.
        batch = torch.empty(0, dtype=torch.float32).set_(torch.UntypedStorage._new_shared(nbytes))
        batch.copy_(src)
        batch[0] = step
        queue.put(batch)
        del batch
    # The fds are handed over by this process on get(): stay alive until all are taken.
    done.wait(TIMEOUT_S)


def bench_torch_queue(nbytes: int, count: int) -> float:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue = ctx.Queue(maxsize=4)  # about what the ring holds
    done = ctx.Event()
    proc = ctx.Process(target=torch_producer, args=(queue, done, nbytes, count))
    proc.start()
    dst = torch.empty(nbytes // 4, dtype=torch.float32)
    try:
        for step in range(WARMUP + count):
            if step == WARMUP:
                t0 = time.perf_counter()
            batch = queue.get(timeout=TIMEOUT_S)
            dst.copy_(batch)
            del batch
            if dst[0].item() != step:
                raise RuntimeError(f"torch batch {step} arrived wrong")
        elapsed = time.perf_counter() - t0
    finally:
        done.set()
        proc.join(timeout=TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    return nbytes * count / elapsed / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=4.0, help="batch tensor size in MiB")
    p.add_argument("--count", type=int, default=200, help="timed batches per measurement")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "producer":
        ring_producer(args.name, args.bytes, args.count)
        return
    nbytes = int(args.size_mb * (1 << 20)) // 4 * 4
    memcpy = bench_memcpy(nbytes, args.count)
    ring, copy_out = bench_ring(nbytes, args.count)
    latency, decode_latency = bench_latency(nbytes)
    leased, _ = bench_ring(nbytes, args.count, leased=True)
    leased_latency = bench_leased_latency(nbytes)
    torch_q = bench_torch_queue(nbytes, args.count)
    result = {
        "batch_bytes": nbytes,
        "count": args.count,
        "ring_gb_per_s": round(ring, 3),
        "memcpy_gb_per_s": round(memcpy, 3),
        "ratio": round(ring / memcpy, 3),
        "copy_out_gb_per_s": round(copy_out, 3),
        "copy_out_ratio": round(copy_out / memcpy, 3),
        "ring_vs_copy_out": round(ring / copy_out, 3),
        "next_latency_us": round(latency, 2),
        "next_decode_latency_us": round(decode_latency, 2),
        "leased_gb_per_s": round(leased, 3),
        "leased_ratio": round(leased / memcpy, 3),
        "next_leased_latency_us": round(leased_latency, 2),
        "torch_queue_gb_per_s": round(torch_q, 3),
        "ring_vs_torch_queue": round(ring / torch_q, 2),
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"batch {nbytes / (1 << 20):.1f} MiB x {args.count}, {os.cpu_count()} CPUs")
    print(f"  ring (producer -> consumer process, copy out): {ring:8.2f} GB/s")
    print(f"  memcpy (one core, same size):                  {memcpy:8.2f} GB/s  ratio {ring / memcpy:.2f}")
    print(f"  the consumer's copy out of the ring, alone:    {copy_out:8.2f} GB/s  ratio {copy_out / memcpy:.2f}")
    print(f"  torch.multiprocessing queue:                   {torch_q:8.2f} GB/s  ring is {ring / torch_q:.1f}x")
    print(f"  leased, as the DataLoader reads:               {leased:8.2f} GB/s  ratio {leased / memcpy:.2f}")
    print(f"  read() of a ready batch: {latency:.1f} us median ({decode_latency:.1f} us with decode_batch)")
    print(f"  DataLoader's next() work on a ready batch (lease, decode, tensors): {leased_latency:.1f} us median")


if __name__ == "__main__":
    main()
