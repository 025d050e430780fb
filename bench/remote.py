"""Remote data path benchmark: micro-batches through the local ring vs over Arrow Flight.

Usage::

    python bench/remote.py --json

prints ONE JSON line: ``local_gb_per_s``, ``remote_gb_per_s``, ``remote_lz4_gb_per_s``
(image-like batches, the heavy case) and, per kind (``text``, ``image``), GB/s and
batches/s of each path, plus ``switchover_ms`` (null: switching a running trainer
between the local ring and Flight is not built yet).

A producer process writes the same pre-built batch records, in the batch wire format,
into a trainer's client ring as fast as the ring takes them (as a Data Constructor
does); the consumer is either this process reading the ring (local) or a Flight client
in this process fetching them from a `BatchServer` (in the producer's process, like a
sidecar) over loopback TCP, with and without LZ4. Text-like batches: input_ids, labels
and position_ids of 16 packed rows of 4,096 int64 (Zipf-distributed token ids; 1.5
MiB); image-like: 1,024 patches of 16x16x3 uint8 from smooth gradients with noise plus
8,192 token ids (832 KiB). Bytes count the batch records delivered per second of wall
time; every record is decoded (bounds-checked) by the consumer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def _batch(kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens = np.minimum(rng.zipf(1.3, size=16 * 4096), 50_000).astype(np.int64)
    if kind == "text":
        return {"input_ids": tokens, "labels": tokens, "position_ids": np.tile(np.arange(4096), 16)}
    y, x = np.mgrid[0:16, 0:16]
    base = ((x + y) * 8).astype(np.int16)
    patches = np.stack([base + rng.integers(-6, 7, size=(16, 16)) + k % 64 for k in range(1024)])
    pixels = np.clip(patches, 0, 255).astype(np.uint8)[..., None].repeat(3, axis=-1).reshape(1024, 768)
    return {"input_ids": tokens[:8192], "pixel_values": pixels}


def _job(name: str, run_dir: str):
    from overlord import Job, Source

    return Job(name=name, sources=(Source(name="x", paths=("/dev/null",)),), run_dir=run_dir, timeout_s=30.0)


def _producer(name: str, run_dir: str, kind: str, count: int, ring_bytes: int, port: int, token: str, ready) -> None:
    from overlord.remote.flight import serve
    from overlord.shm import Ring, write_batch
    from overlord.sidecar.layout import client_ring

    job = _job(name, run_dir)
    ring = Ring.create(client_ring(job, 0), ring_bytes)
    server = serve(job, port, token, host="127.0.0.1") if port else None
    arrays = _batch(kind, np.random.default_rng(0))
    ready.set()
    try:
        for i in range(count):
            write_batch(ring, arrays, meta={"step": i, "microbatch": 0}, timeout=60)
        ring.close_writer()
        time.sleep(60)  # the parent terminates us once it has read everything
    finally:
        if server is not None:
            server.shutdown()
        ring.close()
        ring.unlink()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, path: str, count: int, ring_bytes: int) -> dict:
    from overlord.errors import RingClosed
    from overlord.remote.flight import RemoteReader
    from overlord.shm import Ring, decode_batch
    from overlord.sidecar.layout import client_ring

    name = f"rb{os.getpid() % 10000}{kind[0]}{path[-2:]}"
    run_dir = tempfile.mkdtemp(prefix="ovl-rb-")
    port = _free_port() if path != "local" else 0
    token = "bench-token"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_producer, args=(name, run_dir, kind, count, ring_bytes, port, token, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise RuntimeError("the producer did not start")
    job = _job(name, run_dir)
    nbytes = got = 0
    try:
        if path == "local":
            ring = Ring.attach(client_ring(job, 0), timeout=30)
            ring.claim_consumer()
            start = time.perf_counter()
            while True:
                try:
                    view = ring.read(timeout=30)
                except RingClosed:
                    break
                decode_batch(view)
                nbytes += len(view)
                got += 1
            ring.close()
        else:
            reader = RemoteReader(job, f"grpc://127.0.0.1:{port}", 0, token=token, lz4=path == "flight_lz4",
                                  timeout_s=60)
            start = time.perf_counter()
            for record in reader:
                decode_batch(record)
                nbytes += len(record)
                got += 1
            reader.close()
        wall = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.join(timeout=10)
    if got != count:
        raise RuntimeError(f"{kind}/{path}: {got} of {count} batches arrived")
    return {"gb_per_s": round(nbytes / wall / 1e9, 3), "batches_per_s": round(got / wall, 1),
            "batch_kib": round(nbytes / got / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="batches per measurement")
    parser.add_argument("--ring-mib", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {kind: {path: measure(kind, path, args.count, args.ring_mib << 20)
                      for path in ("local", "flight", "flight_lz4")} for kind in ("text", "image")}
    line = {
        "local_gb_per_s": results["image"]["local"]["gb_per_s"],
        "remote_gb_per_s": results["image"]["flight"]["gb_per_s"],
        "remote_lz4_gb_per_s": results["image"]["flight_lz4"]["gb_per_s"],
        "switchover_ms": None,
        **results,
        "count": args.count,
    }
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
