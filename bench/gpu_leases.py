"""GPU check: leased batches moved to a CUDA device arrive intact, and what pinning costs.

A real job (the demo corpus, a sidecar with its embedded Redis) feeds one rank, read by
`overlord.torch.DataLoader` in three ways, each in the same run:

- leased: the yielded tensors (zero-copy views of the shared-memory ring) are moved
  with `.to("cuda", non_blocking=True)`, the CPU batch is dropped at once (its lease
  ends) and the GPU copies are held for `--hold` steps, as a training loop with a
  prefetching device transfer does;
- pinned: `DataLoader(pin_memory=True)` (a pinned copy per batch), then the same;
- copy: `DataLoader(copy=True)`, then the same.

For each: every GPU batch is compared, after the run, with a digest of its bytes taken
on receipt (`changed` must be 0), and the time per batch of next() + the transfer
(torch.cuda.synchronize() at the end of each step) is reported as p50 and mean. One
JSON line. Needs a CUDA machine; the sidecar runs on its CPUs.

Usage: python bench/gpu_leases.py [--steps 400] [--hold 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from overlord.demo.run import demo_job
from overlord.sidecar.sidecar import sidecar_running
from overlord.torch import DataLoader, batch_digest


def run(job, mode: str, steps: int, hold: int) -> dict:
    config = Path(job.run_dir).parent / f"{job.name}.json"
    config.write_text(job.to_json())
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not sidecar_running(job):
        if sidecar.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sidecar of {mode} run did not start")
        time.sleep(0.05)
    try:
        loader = DataLoader(
            job, rank=0, world_size=1, spawn_sidecar=False, pin_memory=mode == "pinned", copy=mode == "copy"
        )
        held, seen, times, changed = [], [], [], 0
        it = iter(loader)
        for i in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            seen.append(batch_digest(batch))
            on_gpu = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
            del batch  # the CPU batch dies now: a leased one's ring space goes back to the producer
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            held.append((i, on_gpu))
            if len(held) > hold:
                j, old = held.pop(0)
                changed += batch_digest(old) != seen[j]
        changed += sum(batch_digest(b) != seen[j] for j, b in held)
        copies = loader.copies
        loader.close()
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=60)
    skip = min(20, steps // 4)  # warm-up: first batches wait for the pipeline to fill
    return {
        "seen": seen,
        "changed": changed,
        "copies": copies,
        "batches": steps,
        "p50_ms": round(statistics.median(times[skip:]) * 1e3, 3),
        "mean_ms": round(statistics.mean(times[skip:]) * 1e3, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hold", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_leases.py needs a CUDA device")
    out = Path(tempfile.mkdtemp(prefix="ovl-gpu-"))
    try:
        base = demo_job(out, ranks=1)
        result = {"device": torch.cuda.get_device_name(), "hold": args.hold}
        for mode in ("leased", "pinned", "copy"):
            job = replace(base, name=f"gpu-{mode}", run_dir=str(out / f"run-{mode}"))
            result[mode] = run(job, mode, args.steps, args.hold)
        seen = [result[m].pop("seen") for m in ("leased", "pinned", "copy")]
        result["same_bytes_in_every_mode"] = seen[0] == seen[1] == seen[2]
        result["leased_vs_copy_p50"] = round(result["copy"]["p50_ms"] / result["leased"]["p50_ms"], 3)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
