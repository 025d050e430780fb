"""Feedback benchmark: what bounding the Planner by the trainers costs, and what it buys.

Usage::

    python bench/feedback.py [--steps 200] [--report-at 60] [--sleep-ms 5] [--rings-mib 1,16]

prints ONE JSON line. For each client ring size it runs the same real job twice in
this run (sidecar, embedded Redis, loaders, Planner, Data Constructors, two trainer
ranks of `overlord.torch.DataLoader`): once with `plan_ahead` 4, where the Planner
plans at most 4 steps past what the trainers consumed, and once with plan_ahead
100,000, where nothing but the rings bounds it (what issue 16 measured: the Planner
was bounded only by the constructors, which run a whole ring ahead). Each trainer
sleeps `--sleep-ms` per micro-batch (its training step) and, after step
`--report-at`, reports a loss through `DataLoader.report_metrics` that makes the
shipped dynamic schedule (`mixing: {kind: dynamic, every: 1}`, loss_proportional)
put every sample on books.

Per ring size and mode, over `--repeats` runs taken in turn (bounded, unbounded, ...):
``samples_per_s`` (median; both ranks, from step 10 to the end, wall time),
``lag_steps`` (the largest over runs and ranks of: the first step whose every sample
is a book, minus the step the loss was reported at; null if none came within the run,
then ``lag_more_than`` says how many steps were watched) and ``throughput_ratio``
(median bounded / median unbounded samples per second).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

LOSSES = {"loss/books": 30.0, "loss/web": 0.0, "loss/code": 0.0, "loss/images": 0.0}
WARMUP_STEPS = 10
UNBOUNDED = 100_000


def trainer(config: str, out: str, steps: int, report_at: int, sleep_s: float) -> None:
    """One rank (run as a child process): per step its arrival time and sample keys."""
    from overlord.torch import DataLoader

    loader = DataLoader(config)
    mb = loader.job.batch.micro_batches
    record: dict = {"steps": {}, "times": {}}
    for _ in loader:
        meta = loader.last_meta
        step = meta["step"]
        record["steps"].setdefault(step, []).extend(meta["keys"])
        record["times"].setdefault(step, time.monotonic())
        time.sleep(sleep_s)  # the training step
        if meta["microbatch"] == mb - 1:
            if step == report_at:
                loader.report_metrics(LOSSES, step=step)
            if step + 1 >= steps:
                break
    record["end"] = time.monotonic()
    loader.close()
    Path(out).write_text(json.dumps(record))


def run_job(corpus: dict, work: Path, ring_mib: int, plan_ahead: int, args) -> dict:
    from overlord.config import BatchSpec, Job, Mesh, Source
    from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM
    from overlord.shm import unlink_all
    from overlord.sidecar.sidecar import sidecar_running

    weights = {"web": 0.4, "code": 0.3, "books": 0.2, "images": 0.1}
    job = Job(
        name=f"fb{uuid.uuid4().hex[:8]}",
        run_dir=str(work / f"run-{uuid.uuid4().hex[:8]}"),
        seed=7,
        sources=tuple(
            Source(
                name=n,
                paths=tuple(f),
                weight=weights[n],
                shuffle_window=48,
                transform=IMAGE_TRANSFORM if n == "images" else TEXT_TRANSFORM,
            )
            for n, f in corpus.items()
        ),
        mesh=Mesh(dp=2),
        plan_ahead=plan_ahead,
        mixing={"kind": "dynamic", "every": 1},
        timeout_s=60.0,
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=ring_mib << 20),
    )
    config = work / f"{job.name}.json"
    config.write_text(job.to_json())
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=open(work / f"{job.name}-sidecar.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    trainers = []
    try:
        deadline = time.monotonic() + 60
        while not sidecar_running(job):
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start; see {work / (job.name + '-sidecar.log')}")
            time.sleep(0.05)
        outs = [work / f"{job.name}-rank{r}.json" for r in range(2)]
        for r, out in enumerate(outs):
            trainers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--trainer",
                        str(config),
                        str(out),
                        str(args.steps),
                        str(args.report_at),
                        str(args.sleep_ms / 1000),
                    ],
                    env=dict(os.environ, RANK=str(r), WORLD_SIZE="2"),
                )
            )
        for proc in trainers:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"a trainer failed; see {work}")
        records = [json.loads(out.read_text()) for out in outs]
    finally:
        for proc in [*trainers, sidecar]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        unlink_all(job.name)
    samples = sum(len(keys) for rec in records for s, keys in rec["steps"].items() if int(s) >= WARMUP_STEPS)
    seconds = max(rec["end"] for rec in records) - min(rec["times"][str(WARMUP_STEPS)] for rec in records)
    lags = []
    for rec in records:
        books = [
            int(s)
            for s, keys in rec["steps"].items()
            if int(s) > args.report_at and all(k.startswith("books:") for k in keys)
        ]
        lags.append(min(books) - args.report_at if books else None)
    return {"samples_per_s": round(samples / seconds, 1), "lag_steps": None if None in lags else max(lags)}


def summary(runs: list[dict], args) -> dict:
    lags = [run["lag_steps"] for run in runs]
    out = {
        "samples_per_s": round(statistics.median(run["samples_per_s"] for run in runs), 1),
        "samples_per_s_runs": [run["samples_per_s"] for run in runs],
        "lag_steps": None if None in lags else max(lags),
    }
    if out["lag_steps"] is None:
        out["lag_more_than"] = args.steps - 1 - args.report_at
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        config, out, steps, report_at, sleep_s = sys.argv[2:7]
        trainer(config, out, int(steps), int(report_at), float(sleep_s))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--report-at", type=int, default=60)
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--rings-mib", default="1,16")
    parser.add_argument("--plan-ahead", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from overlord.demo.corpus import generate_corpus

    out: dict = {
        "bench": "feedback",
        "plan_ahead": args.plan_ahead,
        "unbounded_plan_ahead": UNBOUNDED,
        "repeats": args.repeats,
        "steps": args.steps,
        "report_at": args.report_at,
        "sleep_ms_per_micro_batch": args.sleep_ms,
        "mesh": "dp=2",
        "global_batch": 16,
        "micro_batches": 2,
        "rings": {},
    }
    with tempfile.TemporaryDirectory(prefix="ovl-feedback-") as tmp:
        work = Path(tmp)
        corpus = generate_corpus(
            work / "corpus",
            seed=5,
            text_sources=3,
            image_sources=1,
            rows_per_source=480,
            files_per_source=2,
            row_group_size=32,
            max_image_side=96,
        )
        for mib in [int(x) for x in args.rings_mib.split(",")]:
            runs: dict[int, list[dict]] = {args.plan_ahead: [], UNBOUNDED: []}
            for _ in range(args.repeats):
                for plan_ahead in runs:  # in turn, so a change in the machine's load hits both
                    runs[plan_ahead].append(run_job(corpus, work, mib, plan_ahead, args))
            bounded, unbounded = summary(runs[args.plan_ahead], args), summary(runs[UNBOUNDED], args)
            out["rings"][f"{mib}MiB"] = {
                "bounded": bounded,
                "unbounded": unbounded,
                "throughput_ratio": round(bounded["samples_per_s"] / unbounded["samples_per_s"], 3),
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
