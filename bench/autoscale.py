"""Autoscaling benchmark: a mixture that shifts from text-heavy to image-heavy, sources
whose costs span over 100x, and three ways to size the Source Loaders.

Usage::

    python bench/autoscale.py --json

prints ONE JSON line with objects ``autoscale``, ``uniform`` and ``worst_case``, each
with ``samples_per_s``, ``stall_s`` (after warm-up), ``pss_mb``, plus details, and writes
``bench/out/autoscale.png`` (transform workers per source, and trainer stall, over time).

The job: 3 text sources (~0.03 ms a sample) and 1 image source whose transform adds
``--heavy-ms`` of latency that does not hold the GIL (bench/bench_transforms.py);
2 ranks that each take ``--step-ms`` per micro-batch; weights move at the middle step
from text-heavy (images 2%) to image-heavy (images 80%).

- ``uniform``: every source one loader partition with one transform worker, every loader
  process alike (what a loader sized per source without knowing costs does).
- ``worst_case``: every source sized for the worst source: ``--worst-partitions``
  partitions each, one process per partition, each with ``--max-threads`` workers.
- ``autoscale``: ``Job.autoscale``: partitions from profiled costs at start, and the
  Planner scaling transform workers with the mixture while the job runs.

``stall_s``: per rank, the time it waited for batches beyond its step (gaps longer than
the step plus 5 ms), after the first ``--warmup`` of the run, averaged over ranks;
``samples_per_s``: samples delivered over the wall time of the whole run; ``pss_mb``:
the peak PSS of the sidecar and everything it started (roles, redis-server), sampled
every 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TRAINER = HERE / "failover_trainer.py"
RANKS = 2


def _job(corpus, run_dir: Path, name: str, how: str, args):
    from overlord import BatchSpec, Job, Mesh, Source
    from overlord.demo.corpus import TEXT_TRANSFORM

    sources = []
    for n, files in corpus.items():
        heavy = n.startswith("images")
        sources.append(
            Source(
                name=n,
                paths=tuple(files),
                shuffle_window=64,
                transform="bench_transforms:heavy_image" if heavy else TEXT_TRANSFORM,
                partitions=args.worst_partitions if how == "worst_case" else 1,
            )
        )
    half = args.steps // 2
    text_heavy = {"web": 0.4, "code": 0.3, "books": 0.28, "images": 0.02}
    image_heavy = {"web": 0.1, "code": 0.05, "books": 0.05, "images": 0.8}
    extra = {}
    if how == "autoscale":
        extra["autoscale"] = {
            "cpus": args.cpus,
            "memory_mb": 8000,
            "max_threads": args.max_threads,
            "scale_interval": 4,
            "profile_samples": 16,
        }
    elif how == "worst_case":
        extra["loader_processes"] = args.worst_partitions * len(sources)
    else:
        extra["loader_processes"] = len(sources)
    return Job(
        name=name,
        sources=tuple(sources),
        mesh=Mesh(dp=RANKS),
        seed=3,
        run_dir=str(run_dir),
        mixing={"kind": "piecewise", "points": [[0, text_heavy], [half, image_heavy]]},
        buffer_samples=128,
        plan_ahead=2,
        timeout_s=60.0,
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=512 << 10),
        **extra,
    )


def _pss_sampler(job, stop: threading.Event, peak: list[float]) -> None:
    from overlord.procmem import pss_of, tree_pids

    while not stop.wait(0.5):
        try:
            pid = int((job.run_path / "sidecar.lock").read_text())
            peak[0] = max(peak[0], pss_of(tree_pids(pid)) / 2**20)
        except (OSError, ValueError):
            continue


def _set_worst_case_workers(job, threads: int) -> None:
    """Fix every stream's transform workers (the `workers` hash loaders follow)."""
    from overlord.runtime.layout import Layout
    from overlord.status import redis_url_of
    from overlord.store import Keys, connect

    r, keys = connect(redis_url_of(job), timeout_s=5), Keys(job.name)
    deadline = time.monotonic() + 60
    while not r.exists(keys.layout):  # after the sidecar published (and cleared) the job's keys
        if time.monotonic() > deadline:
            raise RuntimeError("the sidecar did not publish the job")
        time.sleep(0.05)
    r.hset(keys.workers, mapping={s: threads for s in Layout.plan(job).streams})


def run(corpus, base: Path, how: str, args) -> dict:
    name = f"as{how.replace('_', '')[:8]}{os.getpid() % 10000}"
    workdir = base / how
    workdir.mkdir(parents=True, exist_ok=True)
    job = _job(corpus, Path(tempfile.mkdtemp(prefix="ovl-as-")), name, how, args)
    config = workdir / "job.json"
    config.write_text(job.to_json())
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        OVERLORD_BENCH_HEAVY_MS=str(args.heavy_ms),
    )
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=open(workdir / "sidecar.log", "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    stop, peak = threading.Event(), [0.0]
    trainers = []
    try:
        deadline = time.monotonic() + 120
        while not (job.run_path / "redis.sock").exists():
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{how}: the sidecar did not start; see {workdir / 'sidecar.log'}")
            time.sleep(0.05)
        if how == "worst_case":
            _set_worst_case_workers(job, args.max_threads)
        threading.Thread(target=_pss_sampler, args=(job, stop, peak), daemon=True).start()
        batches = args.steps * 2  # micro-batches per rank
        for rank in range(RANKS):
            trainers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(TRAINER),
                        str(config),
                        str(workdir / f"rank{rank}.json"),
                        "--sleep",
                        str(args.step_ms / 1000),
                        "--batches",
                        str(batches),
                    ],
                    env=dict(env, RANK=str(rank), WORLD_SIZE=str(RANKS)),
                    stdout=open(workdir / f"rank{rank}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        for t in trainers:
            t.wait(timeout=900)
        events = _scaling_events(job) if how == "autoscale" else []
    finally:
        stop.set()
        for t in trainers:
            if t.poll() is None:
                t.kill()
        if sidecar.poll() is None:
            sidecar.terminate()
        sidecar.wait(timeout=60)
    records = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {"records": records, "pss_mb": peak[0], "events": events}


def _scaling_events(job) -> list[dict]:
    from overlord.status import redis_url_of
    from overlord.store import Keys, connect

    r = connect(redis_url_of(job), timeout_s=5)
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(Keys(job.name).scaling)]


def summarize(result: dict, args) -> dict:
    step_s = args.step_ms / 1000
    t0 = min(rec["time"][0] for rec in result["records"])
    t1 = max(rec["time"][-1] for rec in result["records"])
    warm = t0 + args.warmup * (t1 - t0)
    stalls = []
    for rec in result["records"]:
        times = np.asarray(rec["time"])
        gaps = np.diff(times)
        late = np.maximum(0.0, gaps - step_s - 0.005)
        stalls.append(float(late[times[1:] > warm].sum()))
    samples = sum(len(k) for rec in result["records"] for k in rec["keys"])
    ended = sorted({rec["end"] for rec in result["records"]})
    return {
        "samples_per_s": round(samples / (t1 - t0), 1),
        "stall_s": round(float(np.mean(stalls)), 3),
        "pss_mb": round(result["pss_mb"], 1),
        "wall_s": round(t1 - t0, 2),
        "ended": ended,
    }


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_w, ax_s) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    auto = results["autoscale"]
    t0 = min(rec["time"][0] for rec in auto["records"])
    for source in ("web", "code", "books", "images"):
        pts = [(float(e["time"]) - t0, int(e["workers"])) for e in auto["events"] if e["source"] == source]
        xs, ys = [0.0], [1]
        for x, y in pts:
            xs += [x, x]
            ys += [ys[-1], y]
        last = max(rec["time"][-1] for rec in auto["records"]) - t0
        ax_w.plot(xs + [last], ys + [ys[-1]], label=source, lw=1.2)
    ax_w.set_ylabel("workers / partition")
    ax_w.set_title("autoscale: transform workers per source (mixture shifts to images mid-run)", fontsize=9, loc="left")
    ax_w.legend(fontsize=7)
    step_s = args.step_ms / 1000
    for how, res in results.items():
        starts = min(rec["time"][0] for rec in res["records"])
        at = np.concatenate([np.asarray(rec["time"][1:]) - starts for rec in res["records"]])
        late = np.concatenate([np.maximum(0, np.diff(rec["time"]) - step_s - 0.005) for rec in res["records"]])
        bins = np.arange(0, at.max() + 0.5, 0.5)
        hist, _ = np.histogram(at, bins=bins, weights=late)
        ax_s.plot(bins[:-1], hist / RANKS, label=how, lw=1)
    ax_s.set_ylabel("stall s per rank / 0.5 s")
    ax_s.set_xlabel("seconds since the first batch")
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--step-ms", type=float, default=20.0, help="each rank's training time per micro-batch")
    parser.add_argument("--heavy-ms", type=float, default=5.0, help="the image transform's added latency")
    parser.add_argument("--cpus", type=float, default=4.0, help="autoscale's CPU budget for the sidecar")
    parser.add_argument(
        "--max-threads",
        type=int,
        default=8,
        help="transform workers per partition at most (autoscale cap; worst case uses all)",
    )
    parser.add_argument("--worst-partitions", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the run not counted for stalls")
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--out", default=str(HERE / "out"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from overlord.demo.corpus import generate_corpus

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = generate_corpus(
        out / f"autoscale-corpus-{args.rows}",
        seed=6,
        text_sources=3,
        image_sources=1,
        rows_per_source=args.rows,
        files_per_source=2,
        row_group_size=64,
        max_image_side=96,
    )
    base = out / "autoscale-runs"
    results = {how: run(corpus, base, how, args) for how in ("uniform", "worst_case", "autoscale")}
    line = {how: summarize(res, args) for how, res in results.items()}
    line["autoscale"]["scaling_events"] = len(results["autoscale"]["events"])
    line["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "json")}
    try:
        plot(results, args, out / "autoscale.png")
        line["png"] = str(out / "autoscale.png")
    except ImportError:
        line["png"] = None
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
