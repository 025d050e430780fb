"""Memory benchmark: Overlord against the colocated DataLoader status quo.

Usage::

    python bench/memory.py --sources 300 --ranks 8 --workers 4 --json
    python bench/memory.py --sources 300 --ranks 4 --workers 4 --baseline-only --json

prints ONE JSON line: the loading processes (``overlord_pss_mb``: the sidecar and every
process under it; ``colocated_pss_mb``: the DataLoader workers; ``ratio`` = colocated /
overlord) and the whole tree with the trainers (``overlord_tree_pss_mb``,
``colocated_tree_pss_mb``, ``tree_ratio``), the trainers apart (``overlord_trainer_pss_mb``,
``trainer_pss_mb`` for the colocated ones, and each rank's mean), the Source Loader
processes (``overlord_loader_pss_mb``, ``overlord_loader_pss_mb_each``),
``overlord_samples_per_s``, ``colocated_samples_per_s``, ``sources``, ``ranks``,
``workers`` and details. Every figure is a peak over the window, each summed over one
look at /proc (PSS splits a shared page among the processes that map it, so a sum over
a tree counts a page shared inside it once).

The colocated baseline is what a torchrun job does today: one trainer process per rank
(spawned here with subprocess), each with one ``torch.utils.data.DataLoader`` of
``--workers`` forked workers over an ``IterableDataset`` in which EVERY worker opens
EVERY source (one ``pyarrow.parquet.ParquetFile`` per file, kept open), reads whole row
groups in a per-source shuffled order into a per-source shuffle buffer of
``--shuffle-window`` rows, picks sources by weight with its own RNG and applies the
same transforms as Overlord (``overlord.transforms``). Workers shard by (rank, worker):
by row group when a source has at least as many row groups as there are shards, else
by row (every worker reads each row group and keeps its rows; that is what streaming
loaders do when shards do not divide, and the read cost is part of the status quo).

Measurement: trainers consume until every worker has read every source at least once
(steady state; each batch says how many sources its worker has touched), then pause;
the harness samples PSS, starts a window of ``--samples`` samples per rank, samples PSS
each second and reports the peak. Worker PSS is the sum over each trainer's descendant
processes (`overlord.procmem.tree_pids` minus the trainer); trainer PSS is reported
apart. Throughput is all samples of the window over the window's wall time. Every wait
has a timeout and trainers (with their process groups) are killed on any error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a script in a checkout: import the checkout's package

from loadkit import (  # noqa: E402  (bench/loadkit.py: the trainer protocol, the colocated dataset)
    MIB,
    Trainer,
    await_event,
    colocated_dataset,
    command,
    emit,
    pad_collate,
    pss_snapshot,
)

from overlord.procmem import pss_of, tree_pids  # noqa: E402

OUT = REPO / "bench" / "out"


def corpus_for(sources: int, *, rows_per_source: int, row_group_size: int, seed: int, image_every: int = 30) -> Path:
    """Generates (or reuses) the benchmark corpus under ``bench/out``; returns its root."""
    root = OUT / f"corpus-s{sources}-r{rows_per_source}-g{row_group_size}-seed{seed}"
    if image_every != 30:
        root = root.with_name(f"{root.name}-i{image_every}")
    from overlord.demo.corpus import generate_many  # deferred: pyarrow and PIL stay out of the trainers

    generate_many(root, sources, rows_per_source, seed=seed, row_group_size=row_group_size, image_every=image_every)
    return root


def _corpus_sources(root: Path) -> list[tuple[str, list[str], str]]:
    """``[(source, files, transform spec)]`` in the corpus's source order."""
    from overlord.demo.corpus import read_manifest  # deferred: pyarrow and PIL stay out of the trainers

    manifest = read_manifest(root)
    if manifest is None:
        raise FileNotFoundError(f"{root} has no corpus manifest; generate it with corpus_for()")
    return [
        (name, [str(root / rel) for rel in entry["files"]], entry["transform"])
        for name, entry in manifest["sources"].items()
    ]


def _trainer_main(cfg: dict) -> None:
    import warnings

    import PIL.Image  # noqa: F401  (a training script imports its decoders up front)
    import pyarrow.parquet  # noqa: F401  (and its readers, before the workers fork)
    import torch.utils.data as tud

    import overlord.demo.corpus  # noqa: F401  (as the colocated trainers always did)

    # More workers than cores is the point of the benchmark, not a mistake to warn about.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    deadline = time.monotonic() + cfg["timeout_s"]
    sources = _corpus_sources(Path(cfg["corpus"]))
    from overlord.transforms import resolve

    dataset = colocated_dataset(
        [files for _, files, _ in sources],
        [resolve(spec) for _, _, spec in sources],  # imported before the fork
        rank=cfg["rank"],
        ranks=cfg["ranks"],
        window=cfg["shuffle_window"],
        seed=cfg["seed"],
    )
    loader = tud.DataLoader(
        dataset,
        batch_size=cfg["batch_size"],
        num_workers=cfg["workers"],
        collate_fn=pad_collate,
        multiprocessing_context="fork",
        timeout=cfg["timeout_s"],
    )
    batches = iter(loader)
    touched = dict.fromkeys(range(cfg["workers"]), 0)
    warm_samples = 0
    while min(touched.values()) < len(sources):
        batch = next(batches)
        warm_samples += len(batch["lengths"])
        touched[batch["_worker"]] = max(touched[batch["_worker"]], batch["_touched"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not touch every source in {cfg['timeout_s']} s")
    emit("warm", samples=warm_samples)
    if command(deadline - time.monotonic()) != "go":
        raise SystemExit("expected 'go'")
    n, t0 = 0, time.monotonic()
    while n < cfg["samples"]:
        n += len(next(batches)["lengths"])
    emit("done", samples=n, t0=t0, t1=time.monotonic())
    command(deadline - time.monotonic())  # "stop": stay alive until measured
    del batches  # shuts the workers down


def _measure(trainers, deadline: float, sample_pss, steady=None) -> tuple[dict, dict, float]:
    """Warm up, then time a window of every trainer's samples while sampling PSS.

    Returns:
        (warm events, done events, samples per second over the window).
    """
    warm = await_event(trainers, "warm", deadline)
    if steady:
        steady()
    sample_pss()
    for t in trainers:
        t.send("go")
    done = await_event(trainers, "done", deadline, tick=sample_pss)
    sample_pss()
    for t in trainers:
        t.send("stop")
    for t in trainers:
        t.proc.wait(timeout=max(deadline - time.monotonic(), 1))
    window = max(ev["t1"] for ev in done.values()) - min(ev["t0"] for ev in done.values())
    return warm, done, window


def run_colocated(
    corpus: Path,
    *,
    ranks: int,
    workers: int,
    samples: int,
    shuffle_window: int,
    batch_size: int = 32,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> dict:
    """Runs the colocated baseline and measures it.

    Args:
        corpus: Corpus root (from `corpus_for`).
        ranks: Trainer processes.
        workers: DataLoader workers per trainer.
        samples: Samples each rank consumes in the measured window.
        shuffle_window: Rows in each worker's per-source shuffle buffer.
        batch_size: Samples per batch.
        seed: RNG seed of source picks and shuffles.
        timeout_s: Limit on the whole run; trainers are killed past it.

    Returns:
        ``colocated_pss_mb`` (peak summed worker PSS), ``colocated_samples_per_s``,
        ``trainer_pss_mb`` (peak summed trainer PSS) and details.

    Raises:
        RuntimeError: A trainer exited early.
        TimeoutError: A phase ran past ``timeout_s``.
    """
    cfg = dict(
        corpus=str(corpus),
        ranks=ranks,
        workers=workers,
        samples=samples,
        shuffle_window=shuffle_window,
        batch_size=batch_size,
        seed=seed,
        timeout_s=timeout_s,
    )
    start = time.monotonic()
    deadline = start + timeout_s
    trainers: list[Trainer] = []
    peak = {"workers": 0, "trainer": 0, "count": 0, "tree": 0}

    def sample_pss() -> None:
        w, t, c = pss_snapshot(trainers)
        peak.update(
            workers=max(peak["workers"], w),
            trainer=max(peak["trainer"], t),
            count=max(peak["count"], c),
            tree=max(peak["tree"], w + t),
        )

    try:
        trainers = [Trainer(__file__, rank, cfg) for rank in range(ranks)]
        warm, done, window = _measure(trainers, deadline, sample_pss)
    finally:
        for t in trainers:
            t.kill()
    warm_s = (
        min(ev["t0"] for ev in done.values()) - start
    )  # CLOCK_MONOTONIC is system-wide: trainer times compare with ours
    total = sum(ev["samples"] for ev in done.values())
    return {
        "colocated_pss_mb": round(peak["workers"] / MIB, 1),
        "colocated_tree_pss_mb": round(peak["tree"] / MIB, 1),
        "colocated_samples_per_s": round(total / window, 1),
        "trainer_pss_mb": round(peak["trainer"] / MIB, 1),
        "trainer_pss_mb_each": round(peak["trainer"] / MIB / ranks, 1),
        "colocated_pss_mb_per_worker": round(peak["workers"] / MIB / max(peak["count"], 1), 1),
        "colocated_worker_processes": peak["count"],
        "colocated_warmup_samples": sum(ev["samples"] for ev in warm.values()),
        "colocated_warmup_s": round(warm_s, 1),
        "colocated_window_s": round(window, 2),
    }


def _overlord_trainer_main(cfg: dict) -> None:
    """A trainer rank of the Overlord half: the same protocol as `_trainer_main`."""
    from overlord.torch import DataLoader

    deadline = time.monotonic() + cfg["timeout_s"]
    loader = DataLoader(cfg["config"], rank=cfg["rank"], world_size=cfg["ranks"], spawn_sidecar=False)
    batches = iter(loader)
    warm_samples = 0
    for _ in range(cfg["warm_batches"]):
        next(batches)
        warm_samples += len(loader.last_meta["keys"])
    # what the trainer side imported, DataLoader created and batches read
    ours = [m for m in sys.modules if m == "overlord" or m.startswith("overlord.")]
    emit("warm", samples=warm_samples, modules=len(sys.modules), overlord_modules=len(ours))
    if command(deadline - time.monotonic()) != "go":
        raise SystemExit("expected 'go'")
    n, t0 = 0, time.monotonic()
    while n < cfg["samples"]:
        next(batches)
        n += len(loader.last_meta["keys"])
    emit("done", samples=n, t0=t0, t1=time.monotonic())
    command(deadline - time.monotonic())
    loader.close()


def run_overlord(
    corpus: Path,
    *,
    ranks: int,
    workers: int,
    samples: int,
    shuffle_window: int,
    batch_size: int = 32,
    seed: int = 0,
    timeout_s: float = 600.0,
    loader_processes: int = 2,
    buffer_samples: int | None = None,
    buffer_bytes: int = 64 << 20,
) -> dict:
    """The same sources, transforms, row-group reads and shuffle window through Overlord.

    One sidecar (embedded redis-server, Planner, `loader_processes` Source Loader
    processes, one Data Constructor host) serves `ranks` trainer processes, each taking
    one packed micro-batch of `batch_size` samples per step. Memory is the peak PSS of
    the sidecar and every process under it (redis-server and shared-memory rings
    included); trainers are reported apart. `workers` is the baseline's knob: Overlord
    sizes its loader processes by CPU, not by rank.

    Returns:
        ``overlord_pss_mb``, ``overlord_tree_pss_mb`` (with the trainers),
        ``overlord_samples_per_s``, ``overlord_trainer_pss_mb``, ``overlord_loader_pss_mb``
        and details.
    """
    from overlord.config import BatchSpec, Job, Mesh, Source
    from overlord.sidecar.sidecar import sidecar_running

    job = Job(
        name=f"bench-memory-{os.getpid()}",
        sources=tuple(
            Source(name=name, paths=tuple(files), transform=spec, shuffle_window=shuffle_window)
            for name, files, spec in _corpus_sources(corpus)
        ),
        mesh=Mesh(dp=ranks),
        batch=BatchSpec(global_batch=ranks * batch_size, micro_batches=1, context_length=2048, ring_bytes=2 << 20),
        seed=seed,
        run_dir=f"/tmp/overlord-bench-{os.getpid()}",
        loader_processes=loader_processes,
        buffer_samples=buffer_samples,
        buffer_bytes=buffer_bytes,
        sample_ring_bytes=1 << 20,
        timeout_s=120.0,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    config = OUT / f"{job.name}.json"
    config.write_text(job.to_json())
    start = time.monotonic()
    deadline = start + timeout_s
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
        stdout=open(OUT / f"{job.name}-sidecar.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    trainers: list[Trainer] = []
    peak = {"sidecar": 0, "trainer": 0, "procs": 0, "tree": 0, "loaders": 0}

    by_role: dict[str, float] = {}

    def sample_pss() -> None:
        pids = tree_pids(sidecar.pid)
        each = {pid: pss_of([pid]) for pid in pids}
        total = sum(each.values())
        trainer = pss_of(pid for t in trainers for pid in tree_pids(t.proc.pid))
        loaders = sum(n for pid, n in each.items() if _role_of(pid).startswith("loader"))
        if total > peak["sidecar"]:
            by_role.clear()
            for pid, n in each.items():
                by_role[_role_of(pid)] = round(by_role.get(_role_of(pid), 0) + n / MIB, 1)
        peak.update(
            sidecar=max(peak["sidecar"], total),
            procs=max(peak["procs"], len(pids)),
            trainer=max(peak["trainer"], trainer),
            tree=max(peak["tree"], total + trainer),
            loaders=max(peak["loaders"], loaders),
        )

    try:
        while not sidecar_running(job):
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar did not start; see {OUT / (job.name + '-sidecar.log')}")
            time.sleep(0.05)
        cfg = dict(
            mode="overlord",
            config=str(config),
            ranks=ranks,
            samples=samples,
            warm_batches=max(8, len(job.sources) // batch_size),
            timeout_s=timeout_s,
        )
        trainers = [Trainer(__file__, rank, cfg) for rank in range(ranks)]
        warm, done, window = _measure(
            trainers, deadline, sample_pss, steady=lambda: _await_every_source_read(job, deadline)
        )
        demanded = _demanded(job)
    finally:
        for t in trainers:
            t.kill()
        if sidecar.poll() is None:
            sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=60)
    warm_s = min(ev["t0"] for ev in done.values()) - start
    total = sum(ev["samples"] for ev in done.values())
    return {
        "overlord_pss_mb": round(peak["sidecar"] / MIB, 1),
        "overlord_tree_pss_mb": round(peak["tree"] / MIB, 1),
        "overlord_samples_per_s": round(total / window, 1),
        "overlord_trainer_pss_mb": round(peak["trainer"] / MIB, 1),
        "overlord_trainer_pss_mb_each": round(peak["trainer"] / MIB / ranks, 1),
        "overlord_loader_pss_mb": round(peak["loaders"] / MIB, 1),
        "overlord_loader_pss_mb_each": round(peak["loaders"] / MIB / loader_processes, 1),
        "overlord_trainer_modules": max(ev["modules"] for ev in warm.values()),
        "overlord_trainer_overlord_modules": max(ev["overlord_modules"] for ev in warm.values()),
        "overlord_buffer_bytes": buffer_bytes,
        "overlord_buffer_samples": buffer_samples,
        "overlord_processes": peak["procs"],
        "overlord_pss_mb_by_process": by_role,
        "overlord_loader_processes": loader_processes,
        "overlord_warmup_samples": sum(ev["samples"] for ev in warm.values()),
        "overlord_warmup_s": round(warm_s, 1),
        "overlord_window_s": round(window, 2),
        "overlord_demanded_streams": demanded,
    }


def _role_of(pid: int) -> str:
    """A short name for a sidecar-side process (roles name themselves ovl-<role><i>)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    return comm.removeprefix("ovl-") if comm.startswith(("ovl-", "redis")) else "sidecar"


def _demanded(job) -> int:
    """Streams the Planner ever found short for a step (its `demand` hash): each cost a wait."""
    from overlord.store import Keys, connect
    from overlord.store.server import redis_url_of

    return int(connect(redis_url_of(job)).hlen(Keys(job.name).demand))


def _await_every_source_read(job, deadline: float) -> None:
    """Steady state: every Source Loader has read its source (its metadata is in Redis)."""
    from overlord.store import Keys, connect
    from overlord.store.server import redis_url_of

    r, keys = connect(redis_url_of(job)), Keys(job.name)
    streams = [f"{s.name}.0" for s in job.sources]
    while True:
        pipe = r.pipeline(transaction=False)
        for name in streams:
            pipe.exists(keys.meta(name))
        if all(pipe.execute()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("not every Source Loader reported samples in time")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", type=int, default=300)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--samples", type=int, default=10000, help="per rank, in the measured window")
    p.add_argument("--shuffle-window", type=int, default=128, help="rows per source buffer")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rows-per-source", type=int, default=500)
    p.add_argument("--row-group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-every", type=int, default=30, help="one image-text source per this many")
    p.add_argument("--buffer-bytes", type=int, default=64 << 20, help="Job.buffer_bytes of the Overlord half")
    p.add_argument(
        "--buffer-samples", type=int, default=None, help="Job.buffer_samples (a sample cap; none by default)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per half")
    p.add_argument("--baseline-only", action="store_true", help="skip the Overlord half")
    p.add_argument("--json", action="store_true", help="print one JSON line (the default)")
    p.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: run as a trainer
    args = p.parse_args(argv)
    if args.trainer:
        cfg = json.loads(args.trainer)
        (_overlord_trainer_main if cfg.get("mode") == "overlord" else _trainer_main)(cfg)
        return 0
    start = time.monotonic()
    corpus = corpus_for(
        args.sources,
        rows_per_source=args.rows_per_source,
        row_group_size=args.row_group_size,
        seed=args.seed,
        image_every=args.image_every,
    )
    common = dict(
        ranks=args.ranks,
        workers=args.workers,
        samples=args.samples,
        shuffle_window=args.shuffle_window,
        batch_size=args.batch_size,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    result = {"sources": args.sources, "ranks": args.ranks, "workers": args.workers}
    if not args.baseline_only:
        result.update(
            run_overlord(corpus, **common, buffer_bytes=args.buffer_bytes, buffer_samples=args.buffer_samples)
        )
    result.update(run_colocated(corpus, **common))
    if not args.baseline_only:
        result["ratio"] = round(result["colocated_pss_mb"] / result["overlord_pss_mb"], 2)
        result["tree_ratio"] = round(result["colocated_tree_pss_mb"] / result["overlord_tree_pss_mb"], 2)
    result.update(
        samples=args.samples,
        shuffle_window=args.shuffle_window,
        batch_size=args.batch_size,
        rows_per_source=args.rows_per_source,
        row_group_size=args.row_group_size,
        image_every=args.image_every,
        wall_s=round(time.monotonic() - start, 1),
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
