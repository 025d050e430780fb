"""Handoff benchmark: streams handed between loader processes while a job runs.

Usage::

    python bench/handoff.py --json

prints ONE JSON line: ``handoffs`` (taken), ``lost``, ``duplicated``, ``bytes_identical``
(every rank's batches against a run of the same job without handoffs, run first),
``stall_ms`` (the longest wait of a rank for a batch of a handoff's step or the next
one, beyond its own pace, the median over handoffs), ``median_gap_ms`` (between two
batches of a rank), ``stall_over_median`` and details.

The job: the demo corpus (4 sources, --rows rows each, 4 partitions a source, 2 loader
processes), one epoch, 2 ranks consuming a micro-batch every --step-ms. Once the job
runs, --handoffs requests (`overlord handoff`'s call) hand a stream of each process to
the other in turn, one at a time (none once every step is planned: ``handoffs`` counts
those taken): each process gives and takes, and a stream taken over opens cold (its
files, its read buffer from the planner checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TRAINER = HERE / "failover_trainer.py"
RANKS = 2


def _job(corpus, run_dir: Path, name: str):
    from overlord import BatchSpec, Job, Mesh, Source
    from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM

    sources = tuple(
        Source(
            name=n,
            paths=tuple(files),
            shuffle_window=64,
            partitions=4,
            transform=IMAGE_TRANSFORM if n.startswith("images") else TEXT_TRANSFORM,
        )
        for n, files in corpus.items()
    )
    return Job(
        name=name,
        sources=sources,
        mesh=Mesh(dp=RANKS),
        seed=5,
        epochs=1,
        run_dir=str(run_dir),
        loader_processes=2,
        plan_ahead=2,
        timeout_s=60.0,
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )


def run(corpus, base: Path, tag: str, args) -> dict:
    from overlord.planner.request import request_handoff
    from overlord.runtime.layout import Layout
    from overlord.status import redis_url_of
    from overlord.store import Keys, connect
    from overlord.store.schema import PLANNER_DONE, PLANNER_STEP, log_entries

    workdir = base / tag
    workdir.mkdir(parents=True, exist_ok=True)
    job = _job(corpus, Path(tempfile.mkdtemp(prefix="ovl-ho-")), f"ho{tag}{os.getpid() % 10000}")
    config = workdir / "job.json"
    config.write_text(job.to_json())
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=open(workdir / "sidecar.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    trainers, taken = [], []
    try:
        deadline = time.monotonic() + 120
        while not (job.run_path / "redis.sock").exists():
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: the sidecar did not start; see {workdir / 'sidecar.log'}")
            time.sleep(0.05)
        for rank in range(RANKS):
            trainers.append(
                subprocess.Popen(
                    [sys.executable, str(TRAINER), str(config), str(workdir / f"rank{rank}.json")]
                    + ["--sleep", str(args.step_ms / 1000)],
                    env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS)),
                    stdout=open(workdir / f"rank{rank}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        if args.handoffs and tag == "handoffs":
            r, keys = connect(redis_url_of(job), timeout_s=5), Keys(job.name)
            # the job's first plans are out (a fresh job's keys are cleared first)
            while int(r.hget(keys.planner, PLANNER_STEP) or -1) < args.first:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tag}: no plan of step {args.first}; see {job.run_path}")
                time.sleep(0.05)
            layout = Layout.plan(job)
            streams = {k: [n for n, o in zip(layout.streams, layout.loader_of) if o == k] for k in (0, 1)}
            for i in range(args.handoffs):
                if r.hget(keys.planner, PLANNER_DONE):
                    break  # every step is planned: no step boundary left to hand a stream over at
                give = i % 2  # process 0 gives, then 1, ...
                stream = streams[give][(i // 2) % len(streams[give])]
                code, message = request_handoff(r, keys, stream, 1 - give, timeout_s=30)
                if code == 1 or (code == 2 and not r.hget(keys.planner, PLANNER_DONE)):
                    raise RuntimeError(message)
                time.sleep(args.every_s)
            taken = [e for e in log_entries(r.xrange(keys.handoffs)) if e["from"] != e["to"]]
        for t in trainers:
            t.wait(timeout=900)
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        if sidecar.poll() is None:
            sidecar.terminate()
        sidecar.wait(timeout=60)
    records = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {"records": records, "taken": taken}


def summarize(plain: dict, moved: dict, corpus_keys: set[str], args) -> dict:
    seen = Counter(k for rec in moved["records"] for batch in rec["keys"] for k in batch)
    step_s = args.step_ms / 1000
    gaps, stalls = [], []
    handoff_steps = [int(e["step"]) for e in moved["taken"]]
    for rec in moved["records"]:
        times, steps = np.asarray(rec["time"]), np.asarray([s for s, _ in rec["steps"]])
        gaps.append(np.diff(times))
    for step in handoff_steps:
        worst = 0.0
        for rec in moved["records"]:
            times, steps = np.asarray(rec["time"]), np.asarray([s for s, _ in rec["steps"]])
            at = np.flatnonzero((steps == step) | (steps == step + 1))
            at = at[at > 0]
            if len(at):
                worst = max(worst, float((times[at] - times[at - 1]).max()) - step_s)
        stalls.append(max(0.0, worst))
    median_gap = float(np.median(np.concatenate(gaps)))
    stall = float(np.median(stalls)) if stalls else 0.0
    return {
        "handoffs": len(moved["taken"]),
        "handoff_steps": handoff_steps,
        "lost": len(corpus_keys - set(seen)),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "bytes_identical": all(
            a["digests"] == b["digests"] for a, b in zip(plain["records"], moved["records"], strict=True)
        ),
        "ended": sorted({rec["end"] for rec in moved["records"]}),
        "median_gap_ms": round(median_gap * 1000, 2),
        "stall_ms": round(stall * 1000, 1),
        "stall_max_ms": round(max(stalls, default=0.0) * 1000, 1),
        "stall_over_median": round(stall / median_gap, 2) if median_gap > 0 else None,
        "samples_per_s_with": _rate(moved),
        "samples_per_s_without": _rate(plain),
    }


def _rate(result: dict) -> float:
    t0 = min(rec["time"][0] for rec in result["records"])
    t1 = max(rec["time"][-1] for rec in result["records"])
    return round(sum(len(k) for rec in result["records"] for k in rec["keys"]) / (t1 - t0), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000, help="rows per source (4 sources)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="each rank's training time per micro-batch")
    parser.add_argument("--handoffs", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=0.5, help="seconds between two requests")
    parser.add_argument("--first", type=int, default=4, help="the step whose plan comes before the first request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from overlord.demo.corpus import generate_corpus

    base = Path(tempfile.mkdtemp(prefix="ovl-bench-handoff-"))
    corpus = generate_corpus(base / "corpus", seed=3, rows_per_source=args.rows, files_per_source=2, row_group_size=64)
    keys = set()
    for name, files in corpus.items():
        for f, path in enumerate(sorted(files)):
            keys |= {f"{name}:{f}:{row}" for row in range(pq.ParquetFile(path).metadata.num_rows)}
    plain = run(corpus, base, "plain", args)
    moved = run(corpus, base, "handoffs", args)
    out = summarize(plain, moved, keys, args)
    out.update(rows=args.rows, step_ms=args.step_ms, load_avg=os.getloadavg()[0])
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
