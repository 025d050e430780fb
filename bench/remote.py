"""Remote data path benchmark: micro-batches through the local ring vs over Arrow Flight.

Usage::

    python bench/remote.py --json

prints ONE JSON line: ``local_gb_per_s``, ``remote_gb_per_s``, ``remote_lz4_gb_per_s``
(image-like batches, the heavy case) and, per kind (``text``, ``image``), GB/s and
batches/s of each path, plus ``switchover_ms``: the longest gap a trainer sees when its
node's sidecar is killed and it goes on reading its batches over Flight from the node
that takes over its Data Constructor (``switchback_ms``: when its sidecar is back and
it returns to its ring).

A producer process writes the same pre-built batch records, in the batch wire format,
into a trainer's client ring as fast as the ring takes them (as a Data Constructor
does); the consumer is either this process reading the ring (local) or a Flight client
in this process fetching them from a `BatchServer` (in the producer's process, like a
sidecar) over loopback TCP, with and without LZ4. Text-like batches: input_ids, labels
and position_ids of 16 packed rows of 4,096 int64 (Zipf-distributed token ids; 1.5
MiB); image-like: 1,024 patches of 16x16x3 uint8 from smooth gradients with noise plus
8,192 token ids (832 KiB). Bytes count the batch records delivered per second of wall
time; every record is decoded (bounds-checked) by the consumer.

Switch-over: a real one-epoch job on three nodes of this machine (three sidecars with
distinct node ids and loopback Flight ports, one redis-server, one trainer rank per
node sleeping 20 ms per batch, as a training step). Part-way, node n1's sidecar is
killed (kill -9); 3 s later it is started again, as systemd would. Rank 1's gaps
between batches give the switch-over and switch-back times; every rank must still
get every batch once (checked).
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
    from overlord.runtime.layout import client_ring
    from overlord.shm import Ring, write_batch

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
    from overlord.runtime.layout import client_ring
    from overlord.shm import Ring, decode_batch, unlink_all

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
            reader = RemoteReader(
                job, f"grpc://127.0.0.1:{port}", 0, token=token, lz4=path == "flight_lz4", timeout_s=60
            )
            start = time.perf_counter()
            for record in reader:
                decode_batch(record)
                nbytes += len(record)
                got += 1
            reader.close()
        wall = time.perf_counter() - start
    finally:
        proc.terminate()  # SIGTERM ends the producer before its own `finally` can unlink the ring
        proc.join(timeout=10)
        unlink_all(name)
    if got != count:
        raise RuntimeError(f"{kind}/{path}: {got} of {count} batches arrived")
    return {
        "gb_per_s": round(nbytes / wall / 1e9, 3),
        "batches_per_s": round(got / wall, 1),
        "batch_kib": round(nbytes / got / 1024, 1),
    }


def switchover(rows: int = 480, restart_after_s: float = 3.0, sleep_s: float = 0.02) -> dict:
    """Kill one node's sidecar under a running 3-node job; the gaps its trainer sees."""
    import signal
    import subprocess
    import sys

    from overlord import BatchSpec, Job, Mesh, Source
    from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM, generate_corpus
    from overlord.shm import unlink_all
    from overlord.sidecar.sidecar import sidecar_running
    from overlord.store import EmbeddedRedis, Keys, connect

    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = generate_corpus(
            tmp / "corpus",
            seed=5,
            text_sources=3,
            image_sources=1,
            rows_per_source=rows,
            files_per_source=2,
            row_group_size=32,
            max_image_side=96,
        )
        red = EmbeddedRedis(tmp / "redis").start()
        nodes = ("n0", "n1", "n2")
        job = Job(
            name=f"sw{os.getpid()}",
            sources=tuple(
                Source(
                    name=n,
                    paths=tuple(f),
                    shuffle_window=48,
                    transform=IMAGE_TRANSFORM if n.startswith("images") else TEXT_TRANSFORM,
                )
                for n, f in corpus.items()
            ),
            mesh=Mesh(dp=3),
            nodes=nodes,
            redis_url=red.url,
            flight_port=1,
            batch=BatchSpec(global_batch=30, micro_batches=2, context_length=512, ring_bytes=1 << 20),
            seed=5,
            epochs=1,
            loader_processes=3,
            plan_ahead=2,
            timeout_s=30.0,
            run_dir=str(tmp / "run"),
            sample_ring_bytes=2 << 20,
            buffer_samples=128,
        )
        config = tmp / "job.json"
        config.write_text(job.to_json())
        ports = {n: _free_port() for n in nodes}
        env = dict(os.environ, OVERLORD_FLIGHT_HOST="127.0.0.1")
        procs: dict[str, subprocess.Popen] = {}

        def start(node: str) -> None:
            procs[node] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "overlord.cli",
                    "sidecar",
                    "--config",
                    str(config),
                    "--node",
                    node,
                    "--flight-port",
                    str(ports[node]),
                ],
                env=env,
                stdout=open(tmp / f"{node}.log", "ab"),
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 30
            while not sidecar_running(job.on_node(node)):
                if time.monotonic() > deadline or procs[node].poll() is not None:
                    raise RuntimeError(f"sidecar {node} did not start: {(tmp / f'{node}.log').read_text()}")
                time.sleep(0.05)

        trainers = []
        try:
            for node in nodes:
                start(node)
            for rank in range(3):
                trainers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(here / "switchover_trainer.py"),
                            str(config),
                            str(tmp / f"rank{rank}.json"),
                            str(sleep_s),
                        ],
                        env=dict(os.environ, RANK=str(rank), WORLD_SIZE="3"),
                    )
                )
            r, keys = connect(red.url), Keys(job.name)
            deadline = time.monotonic() + 120
            while int(r.hget(keys.progress, "c1") or -1) < 10:
                if time.monotonic() > deadline:
                    raise RuntimeError("the job did not reach step 10")
                time.sleep(0.02)
            procs["n1"].send_signal(signal.SIGKILL)
            procs["n1"].wait(timeout=10)
            killed = time.monotonic()
            time.sleep(restart_after_s)
            start("n1")
            for t in trainers:
                t.wait(timeout=300)
            runs = [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(3)]
        finally:
            for p in [*trainers, *procs.values()]:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            unlink_all(job.name)
            red.stop()
    for rank, run in enumerate(runs):
        want = [[s, m] for s in range(len(run["steps"]) // 2) for m in range(2)]
        if run["end"] != "stop" or run["steps"] != want:
            raise RuntimeError(f"rank {rank}: ended {run['end']!r}; batches not each once in order")
    one = runs[1]
    gaps = np.diff(one["arrivals"]) * 1000 - sleep_s * 1000  # the wait beyond the trainer's own step
    away = [i for i in range(1, len(one["nodes"])) if one["nodes"][i] != one["nodes"][i - 1]]
    # batches the trainer still read from its node's ring after the kill (built before it)
    drained = sum(1 for i, t in enumerate(one["arrivals"]) if t > killed and (not away or i < away[0]))
    out = {
        "switchover_ms": round(float(gaps[away[0] - 1]), 1) if away else None,
        "drained_after_kill": drained,
        "switchback_ms": round(float(gaps[away[-1] - 1]), 1) if len(away) >= 2 else None,
        "served_by": sorted(set(one["nodes"])),
        "median_wait_ms": round(float(np.median(gaps)), 1),
        "rank1_switches": one["switches"],
        "batches_per_rank": len(one["steps"]),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="batches per measurement")
    parser.add_argument("--ring-mib", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-switchover", action="store_true", help="skip the 3-node switch-over run")
    args = parser.parse_args()
    switch = None if args.no_switchover else switchover()
    results = {
        kind: {path: measure(kind, path, args.count, args.ring_mib << 20) for path in ("local", "flight", "flight_lz4")}
        for kind in ("text", "image")
    }
    line = {
        "local_gb_per_s": results["image"]["local"]["gb_per_s"],
        "remote_gb_per_s": results["image"]["flight"]["gb_per_s"],
        "remote_lz4_gb_per_s": results["image"]["flight_lz4"]["gb_per_s"],
        "switchover_ms": switch["switchover_ms"] if switch else None,
        "switchback_ms": switch["switchback_ms"] if switch else None,
        "switchover": switch,
        **results,
        "count": args.count,
    }
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
