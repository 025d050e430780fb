"""`overlord demo`: a multi-source job end to end on one machine.

Generates the demo corpus (text sources with a coyo-like length distribution and an
image-text source with real JPEGs), starts a sidecar with its embedded redis-server,
runs trainer ranks as separate processes (as torchrun would), shows a progress bar,
and prints what was delivered: samples/s, tokens/s, the achieved mix against the
requested one, memory of the loading processes, and time to first batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM, generate_corpus
from overlord.procmem import pss_of, tree_pids
from overlord.shm import list_segments

WEIGHTS = {"web": 0.4, "code": 0.25, "books": 0.15, "images": 0.2}


def demo_job(out: Path, ranks: int) -> Job:
    corpus = generate_corpus(out / "corpus", seed=0, text_sources=3, image_sources=1)
    sources = tuple(
        Source(
            name=name,
            paths=tuple(files),
            transform=IMAGE_TRANSFORM if name.startswith("images") else TEXT_TRANSFORM,
            weight=WEIGHTS.get(name, 0.1),
        )
        for name, files in corpus.items()
    )
    return Job(
        name="demo",
        sources=sources,
        mesh=Mesh(dp=ranks),
        batch=BatchSpec(global_batch=16 * ranks, micro_batches=2, context_length=2048),
        seed=1234,
        run_dir=str(out / "run"),
    )


def run_demo(*, out_dir: str = "demo-data", ranks: int = 4, steps: int = 100, progress: bool = True) -> int:
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"overlord demo: corpus in {out / 'corpus'}, {ranks} trainer ranks, {steps} steps")
    job = demo_job(out, ranks)
    config = out / "job.json"
    config.write_text(job.to_json())
    results = out / "results"
    results.mkdir(exist_ok=True)
    for stale in results.glob("*"):
        stale.unlink()

    launched = time.time()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=open(out / "sidecar.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    trainers = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
        trainers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "overlord.demo.trainer",
                    "--config",
                    str(config),
                    "--steps",
                    str(steps),
                    "--out",
                    str(results / f"rank{rank}.json"),
                ],
                env=env,
            )
        )
    total = ranks * steps * job.batch.micro_batches
    peak_pss = 0
    bar = tqdm(total=total, unit="batch", disable=not progress, desc="batches")
    deadline = time.monotonic() + 600
    try:
        while any(t.poll() is None for t in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError("demo did not finish within 600 s")
            if sidecar.poll() is not None:
                break
            peak_pss = max(peak_pss, pss_of(tree_pids(sidecar.pid)))
            done = sum(int(p.read_text() or 0) for p in results.glob("*.progress"))
            bar.update(done - bar.n)
            time.sleep(0.25)
        bar.close()
        codes = [t.wait(timeout=60) for t in trainers]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=60)
    if any(codes):
        print(f"overlord demo: trainer exit codes {codes}; sidecar log: {out / 'sidecar.log'}", file=sys.stderr)
        return 1
    leftovers = list_segments(job.name)
    print(
        summary(
            [json.loads((results / f"rank{r}.json").read_text()) for r in range(ranks)],
            peak_pss,
            launched,
            job.strategy.rsplit(":", 1)[-1],
        )
    )
    if leftovers:
        print(f"overlord demo: shared-memory segments left behind: {leftovers}", file=sys.stderr)
        return 1
    print("no shared-memory segment left behind; sidecar and embedded redis-server stopped")
    return 0


def summary(ranks: list[dict], peak_pss: int, launched: float, strategy: str) -> str:
    samples = sum(r["samples"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    wall = max(r["steady_s"] for r in ranks)
    counts: dict[str, int] = {}
    for r in ranks:
        for name, n in r["sources"].items():
            counts[name] = counts.get(name, 0) + n
    total_w = sum(WEIGHTS.values())
    lines = [
        "",
        f"delivered      {samples} samples, {tokens} tokens in {len(ranks)} ranks",
        f"throughput     {samples / wall:,.0f} samples/s, {tokens / wall:,.0f} tokens/s (after the first batch)",
        f"first batch    {max(r['first_batch_at'] for r in ranks) - launched:.2f}s after launching sidecar and "
        f"trainers (slowest rank; {max(r['time_to_first_batch_s'] for r in ranks):.2f}s after its DataLoader was created)",
        f"loader memory  {peak_pss / 2**20:,.0f} MiB peak PSS of the sidecar and its roles, redis-server and rings included",
        f"rank balance   {_imbalance(ranks):.3f} max/mean attention cost per step over ranks (median step; "
        f"strategy: {strategy})",
        "mix            source     requested  achieved",
    ]
    for name in sorted(counts, key=lambda n: -WEIGHTS.get(n, 0)):
        lines.append(
            f"               {name:<10} {WEIGHTS.get(name, 0) / total_w:>8.1%}  {counts[name] / samples:>8.1%}"
        )
    return "\n".join(lines)


def _imbalance(ranks: list[dict]) -> float:
    """Median over steps of the slowest rank's cost over the mean (1.0 = perfectly balanced)."""
    steps = set.intersection(*(set(r["step_cost"]) for r in ranks))
    ratios = sorted(
        max(r["step_cost"][s] for r in ranks) / (sum(r["step_cost"][s] for r in ranks) / len(ranks)) for s in steps
    )
    return ratios[len(ratios) // 2] if ratios else float("nan")
