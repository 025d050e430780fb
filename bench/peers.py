"""Overlord beside its peers: one corpus, one transform, the same ranks and workers.

Usage (``make bench-peers`` installs the peers in .venv-peers and runs the default)::

    .venv-peers/bin/python bench/peers.py --json                     # 300 sources, 8 ranks x 4 workers
    .venv-peers/bin/python bench/peers.py --sources 20 --rows 500 --ranks 2 --workers 2 --samples 1000 --json

prints ONE JSON line ``{"loaders": {"overlord", "colocated", "mosaic", "litdata"}, "ratios",
"targets", "config", ...}`` and writes bench/out/peers.png.

The corpus (bench/peers_data.py): ``--sources`` Parquet sources of ``--rows`` rows in 256-row
groups, 20% image-text with real JPEGs, long-tailed text; a BPE tokenizer trained on it
with Hugging Face ``tokenizers``; MDS shards and LitData chunks converted from it. All
cached under ``--corpus``. Every loader applies `peers_data.Sample` (the HF tokenizer to
at most ``--context-length`` ids; each image decoded and resized to ``--image-side``
square patches) and its ranks (``--ranks`` trainer processes, ``--workers`` DataLoader
workers each; Overlord: one sidecar per node) consume the same samples: ``--warm`` each,
then a timed window of ``--samples`` each. The loaders: bench/peers_trainers.py.

Measured per loader, one loader at a time, page cache warmed for every format first:
- ``pss_mb``: peak PSS of the loading processes: every process but the trainers (the
  DataLoader workers; Overlord's sidecar, redis-server, Planner, Source Loaders, Data
  Constructor host, with its shared-memory rings). ``tree_pss_mb``: peak of the same
  with the trainers, summed at one instant (``trainer_pss_mb``: the trainers' part then;
  ``pss_mb_by_process``: the loading processes' PSS at its peak, by process name). Sampled once a second while the ranks warm up and for
  ``--hold`` seconds after the window (ranks paused, their prefetch full), never during
  the timed window, so sampling costs no loader throughput however many processes it has.
- ``samples_per_s``: samples of every rank over the window (first rank's start to the
  last rank's end).
- ``ttfb_s``: trainer spawn to its first batch, median over ranks (Overlord: from the
  sidecar's spawn, so its start is included; ``ttfb_trainer_s`` from the trainer's).
- ``cpu_s_per_1k``: user + system CPU of the whole tree (``/proc/<pid>/stat``) over the
  window, per 1,000 samples; ``cpu_s_per_1k_by_process`` the same split by process name
  (``/proc/<pid>/comm``; the trainer processes as ``trainer``).
- ``image_share``: image-text samples among the window's (about 0.2 for every loader: the
  same mix through the same transform).
- ``idle_before`` and ``settled_s``: each loader starts once the machine was ``--idle``
  idle over 5 s (at most ``--settle-max`` s of waiting): the idle share it started at
  and how long it waited; ``probe_ms``: how long a fixed piece of Python took on one core
  just before it (the VM's speed then). ``--only`` sets the loaders and their order.

Every wait has a timeout; trainers' process groups and the sidecar are killed on error
(and a loader's run is stopped, its entry ``{"error": ...}``, when the machine's available
memory falls under ``--memory-floor``: the machine is shared);
MosaicML's shared memory is cleaned before and after its run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))  # a script in a checkout: import the checkout's package

import peers_data  # noqa: E402  (bench/: the corpus, tokenizer and transform)
from loadkit import MIB, Trainer, await_event, cpu_seconds  # noqa: E402

from overlord.procmem import pss_of, tree_pids  # noqa: E402

OUT = BENCH / "out"
TRAINER = str(BENCH / "peers_trainers.py")
LOADERS = ("overlord", "colocated", "mosaic", "litdata")
PEERS = ("colocated", "mosaic", "litdata")
TARGETS = {  # the targets for Overlord, as (ratio, at least)
    "pss_vs_colocated": 20.0,
    "pss_vs_best_peer": 4.0,
    "tree_pss_vs_colocated": 5.0,
    "samples_per_s_vs_best_peer": 1.7,
}


def _env(ranks: int) -> dict[str, str]:
    """The trainers' environment: bench/ importable by the sidecar's loaders, torchrun's variables."""
    with socket.socket() as s:  # a free port for the gloo store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join(p for p in (str(BENCH), str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "TOKENIZERS_PARALLELISM": "false",
    }


def _spawn(cfg: dict, env: dict[str, str]) -> list[Trainer]:
    trainers = []
    for rank in range(cfg["ranks"]):
        trainers.append(Trainer(TRAINER, rank, cfg, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    return trainers


class _Probe:
    """PSS and CPU of one run's processes: the loading side and the trainers."""

    def __init__(self, trainers: list[Trainer], sidecar: subprocess.Popen | None):
        self.trainers, self.sidecar, self.t0 = trainers, sidecar, time.monotonic()
        self.series: list[tuple[float, float, float]] = []  # (s since start, loading MiB, tree MiB)
        self.peak = {"loading": 0, "tree": 0, "trainers": 0, "processes": 0}
        self.by_process: dict[str, int] = {}  # process name -> PSS bytes, at the loading peak

    def pids(self) -> tuple[list[int], list[int]]:
        """(loading processes, trainers) now."""
        trainers = [t.proc.pid for t in self.trainers if t.proc.poll() is None]
        loading = [pid for t in trainers for pid in tree_pids(t)[1:]]
        if self.sidecar is not None:
            loading += tree_pids(self.sidecar.pid)
        return loading, trainers

    def sample(self) -> None:
        loading, trainers = self.pids()
        each = {pid: pss_of([pid]) for pid in loading}
        pss_loading, pss_trainers = sum(each.values()), pss_of(trainers)
        tree = pss_loading + pss_trainers
        self.series.append((time.monotonic() - self.t0, pss_loading / MIB, tree / MIB))
        if tree > self.peak["tree"]:  # the trainers' share at the tree's peak (alone, before their workers
            self.peak.update(tree=tree, trainers=pss_trainers)  # fork, they hold every page they map)
        if pss_loading > self.peak["loading"]:
            self.by_process = {}
            for pid, pss in each.items():
                name = _name_of(pid)
                self.by_process[name] = self.by_process.get(name, 0) + pss
        self.peak.update(
            loading=max(self.peak["loading"], pss_loading), processes=max(self.peak["processes"], len(loading))
        )

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by process name (trainers as ``trainer``), the run's processes."""
        loading, trainers = self.pids()
        by_name = {"trainer": cpu_seconds(trainers)}
        for pid in loading:
            name = _name_of(pid)
            by_name[name] = by_name.get(name, 0.0) + cpu_seconds([pid])
        return by_name


def _name_of(pid: int) -> str:
    """A process's name (``/proc/<pid>/comm``: Overlord's roles name themselves ``ovl-<role><i>``)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def _memory_guard(floor_mb: float) -> None:
    """Stops a run before it takes the machine's last memory (others' processes share it).

    Raises:
        MemoryError: ``MemAvailable`` is under ``floor_mb``.
    """
    with open("/proc/meminfo", encoding="ascii") as f:
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024
    if available < floor_mb:
        raise MemoryError(f"{available:.0f} MiB available, under --memory-floor {floor_mb:.0f} MiB: run stopped")


def _idle_share(seconds: float) -> float:
    """The machine's idle share of CPU time over the next `seconds` (/proc/stat)."""

    def read() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    idle0, all0 = read()
    time.sleep(seconds)
    idle1, all1 = read()
    return (idle1 - idle0) / max(1, all1 - all0)


def settle(idle: float, most_s: float) -> dict:
    """Wait (at most `most_s`) until the machine was at least `idle` idle over 5 s: a
    loader started straight after another (or after any heavy run) runs on a machine
    still busy with its tail, and this VM's speed swings for minutes after. Returns how
    long it waited and the idle share it started at."""
    t0, share = time.monotonic(), 0.0
    while True:
        share = _idle_share(5.0)
        if share >= idle or time.monotonic() - t0 >= most_s:
            return {"settled_s": round(time.monotonic() - t0, 1), "idle_before": round(share, 3), **speed_probe()}


def speed_probe() -> dict:
    """How fast one core runs a fixed piece of Python now (ms; best of three): this VM's
    speed swings within minutes, so each loader's figures come with the speed it started at."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        acc = 0
        for i in range(300_000):
            acc = (acc * 31 + i) & 0xFFFFFFFF
        best = min(best, time.perf_counter() - t)
    return {"probe_ms": round(best * 1000, 1)}


def _clean_mosaic_shm() -> None:
    """Removes shared memory a killed MosaicML run left (its own helper, in a child: no torch here)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import peers_data; peers_data.torchvision_without_ops(); "
        "from streaming.base.util import clean_stale_shared_memory; clean_stale_shared_memory()"
    )
    subprocess.run([sys.executable, "-c", code, str(BENCH)], check=True, timeout=120, capture_output=True)


def _overlord_job(corpus: Path, tokenizer: Path, args: argparse.Namespace):
    """The Overlord job over the corpus: bench/memory.py's settings (``--loader-processes``
    Source Loader processes, 64-sample buffers, 1 MiB sample rings), with 4 MiB trainer rings
    for the image patches (memory.py's 2 MiB hold its smaller toy samples)."""
    # deferred: the harness imports Overlord's config only when it runs Overlord
    from overlord.config import BatchSpec, Job, Mesh, Source

    return Job(
        name=f"bench-peers-{os.getpid()}",
        sources=tuple(
            Source(
                name=src["name"],
                paths=tuple(src["files"]),
                transform="peers_data:Sample",
                transform_args=peers_data.sample_args(
                    src, tokenizer, context_length=args.context_length, image_side=args.image_side
                ),
                shuffle_window=args.shuffle_window,
            )
            for src in peers_data.sources_of(corpus)
        ),
        mesh=Mesh(dp=args.ranks),
        batch=BatchSpec(
            global_batch=args.ranks * args.batch_size,
            micro_batches=1,
            context_length=args.context_length,
            ring_bytes=args.trainer_ring_mib << 20,
        ),
        seed=args.seed,
        run_dir=f"/tmp/overlord-bench-peers-{os.getpid()}",
        loader_processes=args.loader_processes,
        buffer_samples=64,
        sample_ring_bytes=args.sample_ring_mib << 20,
        **({"plan_ahead": args.plan_ahead} if args.plan_ahead else {}),
        timeout_s=120.0,
    )


def run_loader(loader: str, corpus: Path, tokenizer: Path, args: argparse.Namespace) -> dict:
    """Runs `loader`'s ranks through warm-up, the timed window and the hold; returns its figures.

    Raises:
        RuntimeError: A trainer or the sidecar exited early.
        TimeoutError: A phase ran past ``--timeout``.
    """
    cfg = dict(
        loader=loader,
        corpus=str(corpus),
        ranks=args.ranks,
        workers=args.workers,
        batch_size=args.batch_size,
        warm=args.warm,
        samples=args.samples,
        shuffle_window=args.shuffle_window,
        context_length=args.context_length,
        image_side=args.image_side,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    env = _env(args.ranks)
    start = time.monotonic()
    deadline = start + args.timeout
    sidecar, trainers, extra, job = None, [], {}, None
    log = args.out / f"peers-{loader}.log"
    try:
        if loader == "mosaic":
            _clean_mosaic_shm()
        if loader == "overlord":
            # deferred: the harness imports Overlord's sidecar only when it runs Overlord
            from overlord.sidecar.sidecar import sidecar_running

            job = _overlord_job(corpus, tokenizer, args)
            config = args.out / f"{job.name}.json"
            config.write_text(job.to_json())
            cfg["config"] = str(config)
            with open(log, "wb") as out:
                sidecar = subprocess.Popen(
                    [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            while not sidecar_running(job):
                if sidecar.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sidecar did not start; see {log}")
                time.sleep(0.05)
            extra["sidecar_start_s"] = round(time.monotonic() - start, 2)
        trainers = _spawn(cfg, env)
        probe = _Probe(trainers, sidecar)
        probe.sample()

        def warm_tick() -> None:
            _memory_guard(args.memory_floor)
            probe.sample()

        await_event(trainers, "warm", deadline, tick=warm_tick)
        probe.sample()
        cpu0 = probe.cpu()
        for t in trainers:
            t.send("go")
        done = await_event(trainers, "done", deadline, tick=lambda: _memory_guard(args.memory_floor))
        cpu1 = probe.cpu()
        for _ in range(max(1, int(args.hold))):
            time.sleep(1.0)
            _memory_guard(args.memory_floor)
            probe.sample()
        for t in trainers:
            t.send("stop")
        for t in trainers:
            t.proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for t in trainers:
            t.kill()
        if sidecar is not None:
            if sidecar.poll() is None:
                sidecar.send_signal(signal.SIGTERM)
            try:
                sidecar.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(sidecar.pid, signal.SIGKILL)
                sidecar.wait(timeout=10)
        if job is not None and job.run_dir:
            shutil.rmtree(job.run_dir, ignore_errors=True)
        if loader == "mosaic":
            _clean_mosaic_shm()
    first = [t.seen["first"]["t"] for t in trainers]
    window = max(ev["t1"] for ev in done.values()) - min(ev["t0"] for ev in done.values())
    total = sum(ev["samples"] for ev in done.values())
    result = {
        "pss_mb": round(probe.peak["loading"] / MIB, 1),
        "tree_pss_mb": round(probe.peak["tree"] / MIB, 1),
        "trainer_pss_mb": round(probe.peak["trainers"] / MIB, 1),
        "samples_per_s": round(total / window, 1),
        "ttfb_s": round(statistics.median(f - (start if sidecar else t.spawned) for f, t in zip(first, trainers)), 2),
        "cpu_s_per_1k": round((sum(cpu1.values()) - sum(cpu0.values())) / total * 1000, 3),
        "cpu_s_per_1k_by_process": {
            name: round((spent - cpu0.get(name, 0.0)) / total * 1000, 3) for name, spent in sorted(cpu1.items())
        },
        "loading_processes": probe.peak["processes"],
        "window_s": round(window, 2),
        "samples": total,
        "image_share": round(sum(ev["images"] for ev in done.values()) / total, 3),
        "pss_mb_by_process": {k: round(v / MIB, 1) for k, v in sorted(probe.by_process.items())},
        "pss_series": [[round(v, 1) for v in row] for row in probe.series],
    }
    if sidecar is not None:
        result["ttfb_trainer_s"] = round(statistics.median(f - t.spawned for f, t in zip(first, trainers)), 2)
    return {**result, **extra}


def _ratios(loaders: dict[str, dict]) -> dict[str, float]:
    """Overlord's ratios to the peers that finished (a stopped run has only ``error``)."""
    ovl = loaders["overlord"]
    if "error" in ovl:
        return {}
    peers = {k: v for k, v in loaders.items() if k in PEERS and "error" not in v}
    ratios = {}
    if "colocated" in peers:
        ratios["pss_vs_colocated"] = peers["colocated"]["pss_mb"] / ovl["pss_mb"]
        ratios["tree_pss_vs_colocated"] = peers["colocated"]["tree_pss_mb"] / ovl["tree_pss_mb"]
    if peers:
        ratios["pss_vs_best_peer"] = min(p["pss_mb"] for p in peers.values()) / ovl["pss_mb"]
        ratios["samples_per_s_vs_best_peer"] = ovl["samples_per_s"] / max(p["samples_per_s"] for p in peers.values())
    return {k: round(v, 2) for k, v in ratios.items()}


def _plot(result: dict, path: Path) -> None:
    # deferred: matplotlib is a bench extra, imported only to draw
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaders = result["loaders"]
    names = [n for n in LOADERS if n in loaders and "error" not in loaders[n]]
    colors = {"overlord": "#1f77b4", "colocated": "#d62728", "mosaic": "#ff7f0e", "litdata": "#2ca02c"}
    panels = [
        ("pss_mb", "PSS of the loading processes (MiB)"),
        ("tree_pss_mb", "PSS of the whole tree (MiB)"),
        ("samples_per_s", "samples/s (higher is better)"),
        ("cpu_s_per_1k", "CPU-seconds per 1,000 samples"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, (key, title) in zip(axes, panels):
        values = [loaders[n][key] for n in names]
        bars = ax.bar(names, values, color=[colors[n] for n in names])
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 10 else f"{v:.2f}" for v in values], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    c = result["config"]
    fig.suptitle(
        f"{c['sources']} sources x {c['rows']} rows, {c['ranks']} ranks x {c['workers']} workers, "
        f"{c['samples']} samples a rank timed (2 cores; 1-min load average {result['load_avg'][0]:.1f} at start, "
        f"{result['load_avg_end'][0]:.1f} at end)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _warm_page_cache(corpus: Path) -> None:
    """Reads every file of every format once, so no loader pays the first read from disk."""
    for path in sorted(corpus.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 22):
                    pass


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=OUT / "peers-corpus", help="where corpora are cached")
    p.add_argument("--sources", type=int, default=300)
    p.add_argument("--rows", type=int, default=2000, help="rows per source")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank (peers)")
    p.add_argument("--loader-processes", type=int, default=2, help="Overlord's Source Loader processes")
    p.add_argument("--samples", type=int, default=4000, help="per rank, in the timed window")
    p.add_argument("--warm", type=int, default=128, help="per rank, before the window")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--image-side", type=int, default=128)
    p.add_argument("--shuffle-window", type=int, default=128, help="rows per source buffer (colocated, Overlord)")
    p.add_argument("--hold", type=float, default=3, help="seconds of PSS samples after the window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per loader")
    p.add_argument("--memory-floor", type=float, default=2048, help="MiB of MemAvailable that stops a loader's run")
    p.add_argument("--plan-ahead", type=int, default=0, help="Overlord's Job.plan_ahead (0: its default)")
    p.add_argument("--sample-ring-mib", type=int, default=1, help="Overlord's Job.sample_ring_bytes, MiB")
    p.add_argument("--trainer-ring-mib", type=int, default=4, help="Overlord's BatchSpec.ring_bytes, MiB")
    p.add_argument("--only", default=",".join(LOADERS), help="comma-separated loaders to run, in this order")
    p.add_argument(
        "--idle", type=float, default=0.9, help="before each loader, wait for the machine this idle over 5 s"
    )
    p.add_argument("--settle-max", type=float, default=180.0, help="... at most this many seconds (0: no wait)")
    p.add_argument("--out", type=Path, default=OUT, help="where logs, the PSS series and the PNG go")
    p.add_argument("--png", type=Path, help="the PNG (default: OUT/peers.png)")
    p.add_argument("--json", action="store_true", help="print one JSON line (the default)")
    args = p.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    if unknown := set(only) - set(LOADERS):
        p.error(f"--only: unknown loaders {sorted(unknown)}; choose from {list(LOADERS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.png = args.png or args.out / "peers.png"
    t_start = time.monotonic()
    load_avg = [round(v, 2) for v in os.getloadavg()]
    corpus = peers_data.corpus(args.corpus, args.sources, args.rows, seed=args.seed)
    tokenizer = peers_data.tokenizer(corpus)
    if "mosaic" in only:
        peers_data.mds_shards(corpus)
    if "litdata" in only:
        peers_data.litdata_chunks(corpus)
    prepared_s = time.monotonic() - t_start
    _warm_page_cache(corpus)
    loaders = {}
    for loader in only:
        settled = settle(args.idle, args.settle_max) if args.settle_max > 0 else speed_probe()
        try:
            loaders[loader] = {**run_loader(loader, corpus, tokenizer, args), **settled}
        except MemoryError as exc:  # the others still run: their figures stand alone
            loaders[loader] = {"error": str(exc), "pss_series": []}
        print(
            f"{loader}: {json.dumps({k: v for k, v in loaders[loader].items() if k != 'pss_series'})}",
            file=sys.stderr,
            flush=True,
        )
    result = {
        "loaders": {k: {kk: vv for kk, vv in v.items() if kk != "pss_series"} for k, v in loaders.items()},
        "ratios": _ratios(loaders) if "overlord" in loaders else {},
        "config": {
            k: getattr(args, k)
            for k in (
                "sources",
                "rows",
                "ranks",
                "workers",
                "loader_processes",
                "samples",
                "warm",
                "batch_size",
                "context_length",
                "image_side",
                "shuffle_window",
                "seed",
                "plan_ahead",
                "sample_ring_mib",
                "trainer_ring_mib",
            )
        },
        "load_avg": load_avg,
        "load_avg_end": [round(v, 2) for v in os.getloadavg()],
        "prepare_s": round(prepared_s, 1),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    result["targets"] = {k: result["ratios"][k] >= v for k, v in TARGETS.items() if k in result["ratios"]}
    (args.out / "peers-series.json").write_text(json.dumps({k: v["pss_series"] for k, v in loaders.items()}))
    try:
        _plot(result, args.png)
        result["png"] = str(args.png)
    except ImportError:
        result["png"] = None  # matplotlib missing: make bench-peers installs it
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
