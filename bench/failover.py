"""Failover benchmark: kill -9 each part of a running 4-rank job, repeatedly, and measure
what the trainers see.

Usage::

    python bench/failover.py --json                      # every fault, 3 injections each
    python bench/failover.py --faults planner,redis --repeats 2 --json

prints ONE JSON line::

    {"faults": {"<fault>": {"stall_ms", "median_gap_ms", "recovery_ms", "lost", "duplicated",
                            "bytes_identical", "injections", "recovery_ms_each"}, ...},
     "reference": {"stall_ms", "median_gap_ms"},
     "checkpoint_ms_10", "checkpoint_ms_1000", "checkpoint_bytes_10", "checkpoint_bytes_1000",
     "snapshot_bytes_10", "snapshot_bytes_1000", ...}

and writes ``bench/out/failover.png``: trainer throughput (batches/s over all ranks,
100 ms bins) around each injection, one panel per fault, like Figure 16 of the paper.

Faults (names as in the JSON): ``loader_with_shadow`` (the active Source Loader process
of a job whose sources have shadows), ``loader_no_shadow``, ``planner``, ``constructor``
(the Data Constructor host), ``sidecar`` (the whole sidecar; its Redis dies with it and
the trainers' DataLoaders start a new one that resumes), ``redis`` (the embedded
redis-server; the sidecar restarts it from its append-only file) and ``trainer`` (rank 2
is killed, torchrun-style the other ranks are killed too, and all restart from their
last ``state_dict``, saved every 5 batches).

Definitions. Each rank sleeps ``--sleep`` per batch (its training step). ``median_gap_ms``
is the median time between two batches of a rank, over all ranks; ``stall_ms`` the
longest (for ``trainer``, across the restart: what the restarted rank waited, process
start included). ``recovery_ms`` is, per injection, the time from the kill until the
replacement is back: a new heartbeat of the role in Redis (for the Planner, a new
generation reported), Redis answering again, the resumed sidecar's first finished step,
or the restarted trainers' first batch; the median is reported. ``lost`` and
``duplicated`` count sample keys against the corpus (one epoch: every row exactly once),
and ``bytes_identical`` compares every rank's batch digests with a run without faults.

``checkpoint_ms_<n>`` is the median cost per step of the Planner's checkpoint with n
sources (computing the delta, encoding it, and a Redis round trip that stores it, as in
the planner's MULTI), measured in-process against the embedded redis-server;
``checkpoint_bytes_<n>`` its median size, ``snapshot_bytes_<n>`` a full state's size.
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
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TRAINER = HERE / "failover_trainer.py"
FAULTS = ("loader_with_shadow", "loader_no_shadow", "planner", "constructor", "sidecar", "redis", "trainer")
WORLD = 4


def _job(corpus: dict, run_dir: Path, name: str, shadow: bool, costly: bool = False):
    from overlord import BatchSpec, Job, Mesh, Source
    from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM

    weights = {"web": 0.4, "code": 0.3, "books": 0.2, "images": 0.1}
    sources = tuple(
        Source(
            name=n,
            paths=tuple(files),
            weight=weights.get(n, 0.1),
            shuffle_window=64,
            shadow=shadow,
            transform=IMAGE_TRANSFORM
            if n.startswith("images")
            else ("bench_transforms:costly_text" if costly else TEXT_TRANSFORM),
        )
        for n, files in corpus.items()
    )
    # client rings of 256 KiB hold a few micro-batches (what a ring of real 4k-token or
    # image batches holds), so prefetch is about plan_ahead steps, not the whole job
    return Job(
        name=name,
        sources=sources,
        mesh=Mesh(dp=WORLD),
        seed=7,
        epochs=1,
        run_dir=str(run_dir),
        loader_processes=2,
        plan_ahead=2,
        timeout_s=60.0,
        buffer_samples=256,
        sample_ring_bytes=1 << 20,
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=256 << 10),
    )


class Run:
    """One job: a sidecar (unless the trainers spawn it) and WORLD trainer ranks."""

    def __init__(self, job, workdir: Path, sleep: float) -> None:
        self.job, self.workdir, self.sleep = job, workdir, sleep
        self.config = workdir / "job.json"
        self.config.write_text(job.to_json())
        self.sidecar: subprocess.Popen | None = None
        self.trainers: dict[int, subprocess.Popen] = {}
        self.segments: dict[int, list[dict]] = {r: [] for r in range(WORLD)}  # finished ledgers per rank
        self._redis = None

    def out(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.json"

    def start_sidecar(self) -> None:
        log = open(self.workdir / "sidecar.log", "ab")
        self.sidecar = subprocess.Popen(
            [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _until(lambda: (self.job.run_path / "redis.sock").exists(), 60, "the sidecar did not start")

    def start_trainers(self, spawn: bool, save_every: int = 0, states: dict | None = None) -> None:
        for rank in range(WORLD):
            extra = ["--sleep", str(self.sleep)]
            if spawn:
                extra += ["--spawn", "1"]
            if save_every:
                extra += ["--save-every", str(save_every)]
            if states:
                extra += ["--load-state", str(states[rank])]
            self.trainers[rank] = subprocess.Popen(
                [sys.executable, str(TRAINER), str(self.config), str(self.out(rank)), *extra],
                env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD)),
                stdout=open(self.workdir / f"rank{rank}.log", "ab"),
                stderr=subprocess.STDOUT,
            )

    def redis(self):
        """One client for the run (it reconnects by itself after a restart of Redis)."""
        if self._redis is None:
            from overlord.status import redis_url_of
            from overlord.store import connect

            _until(lambda: (self.job.run_path / "redis.sock").exists(), 60, "no Redis socket")
            self._redis = connect(redis_url_of(self.job), timeout_s=5, ride_through_s=5)
        return self._redis

    def progress(self) -> int:
        """The slowest Data Constructor's last written step (-1 if Redis is away)."""
        try:
            raw = self.redis().hgetall(_keys(self.job).progress)
        except Exception:  # noqa: BLE001 - mid-failover
            return -1
        return min((int(raw.get(f"c{d}".encode(), -1)) for d in range(WORLD)), default=-1)

    def finish(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.trainers.values():
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        for rank in range(WORLD):
            self.segments[rank].append(json.loads(self.out(rank).read_text()))
        if self.sidecar is not None:
            if self.sidecar.poll() is None:
                self.sidecar.send_signal(signal.SIGTERM)
            self.sidecar.wait(timeout=60)
        from overlord.sidecar.sidecar import sidecar_running

        _until(lambda: not sidecar_running(self.job), 60, "the sidecar did not exit")

    def kill_all(self) -> None:
        for proc in [*self.trainers.values(), self.sidecar]:
            if proc is not None and proc.poll() is None:
                proc.kill()
        from overlord.shm import unlink_all

        unlink_all(self.job.name)


def _keys(job):
    from overlord.store import Keys

    return Keys(job.name)


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _heartbeat_pid(run: Run, role: str, index: int = 0) -> int | None:
    try:
        raw = run.redis().get(_keys(run.job).heartbeat(role, str(index)))
    except Exception:  # noqa: BLE001
        return None
    return json.loads(raw)["pid"] if raw else None


def _inject(run: Run, fault: str) -> tuple[float, float]:
    """Kill the part `fault` names; returns (kill time, recovery seconds)."""
    keys = _keys(run.job)
    if fault in ("loader_with_shadow", "loader_no_shadow", "constructor"):
        role = "constructor" if fault == "constructor" else "loader"
        pid = _heartbeat_pid(run, role)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        _until(lambda: _heartbeat_pid(run, role) not in (None, pid), 60, f"no new {role}")
        return killed, time.time() - killed
    if fault == "planner":
        r = run.redis()
        generation = int(r.hget(keys.planner, "token"))
        killed = time.time()
        os.kill(_heartbeat_pid(run, "planner"), signal.SIGKILL)
        _until(lambda: int(run.redis().hget(keys.planner, "token") or 0) > generation, 60, "no new Planner")
        return killed, time.time() - killed
    if fault == "redis":
        pid = _redis_pid(run.job.run_path)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        _until(lambda: _redis_pid(run.job.run_path) not in (None, pid) and _pings(run), 60, "Redis did not come back")
        return killed, time.time() - killed
    if fault == "sidecar":
        pid = int((run.job.run_path / "sidecar.lock").read_text())
        before = run.progress()
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        from overlord.sidecar.sidecar import sidecar_running

        def resumed() -> bool:
            if not sidecar_running(run.job) or int((run.job.run_path / "sidecar.lock").read_text() or 0) == pid:
                return False
            return run.progress() >= before

        _until(resumed, 120, "the trainers did not bring a sidecar back")
        return killed, time.time() - killed
    if fault == "trainer":
        killed = time.time()
        run.trainers[2].kill()  # rank 2 dies; torchrun stops the rest of the group
        for proc in run.trainers.values():
            proc.kill()
        for proc in run.trainers.values():
            proc.wait(timeout=30)
        states = {}
        for rank in range(WORLD):
            record = json.loads(run.out(rank).read_text())
            run.segments[rank].append(record)  # consumed up to its last checkpoint
            states[rank] = run.workdir / f"state{rank}.json"
            states[rank].write_text(json.dumps(record["state"]))
        from overlord.sidecar.sidecar import sidecar_running

        _until(lambda: not sidecar_running(run.job), 60, "the spawned sidecar did not exit")
        run.start_trainers(spawn=True, save_every=5, states=states)
        _until(
            lambda: all(run.out(r).exists() and _fresh(run.out(r), killed) for r in range(WORLD)),
            120,
            "restarted trainers got no batch",
        )
        first = min(min(t for t in json.loads(run.out(r).read_text())["time"] if t > killed) for r in range(WORLD))
        return killed, first - killed
    raise ValueError(fault)


def _fresh(path: Path, since: float) -> bool:
    try:
        times = json.loads(path.read_text())["time"]
    except (OSError, ValueError, KeyError):
        return False
    return any(t > since for t in times)


def _pings(run: Run) -> bool:
    import redis

    try:
        return bool(redis.Redis(unix_socket_path=str(run.job.run_path / "redis.sock"), socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _redis_pid(run_dir: Path) -> int | None:
    from overlord.store.server import server_pids

    pids = server_pids(run_dir)
    return pids[0] if pids else None


def run_fault(
    corpus, base: Path, fault: str | None, repeats: int, sleep: float, total_steps: int, transform_ms: float = 0.0
) -> dict:
    tag = (fault or "reference") + (f"-costly{transform_ms:g}ms" if transform_ms else "")
    name = f"fo{tag.replace('_', '').replace('-', '').replace('.', '')[:14]}{os.getpid() % 10000}"
    workdir = base / tag
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob("rank*.json"):
        stale.unlink()
    job = _job(
        corpus,
        Path(tempfile.mkdtemp(prefix="ovl-fo-")),
        name,
        shadow=fault == "loader_with_shadow",
        costly=transform_ms > 0,
    )
    os.environ["OVERLORD_BENCH_TRANSFORM_MS"] = str(transform_ms)  # read by the sidecar's loaders
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    run = Run(job, workdir, sleep)
    spawned = fault in ("sidecar", "trainer")
    kills, recoveries = [], []
    try:
        if not spawned:
            run.start_sidecar()
        run.start_trainers(spawn=spawned, save_every=5 if fault == "trainer" else 0)
        for i in range(repeats if fault else 0):
            at = total_steps * (i + 1) // (repeats + 1)
            _until(lambda at=at: run.progress() >= at, 300, f"{fault}: the job did not reach step {at}")
            killed, recovery = _inject(run, fault)
            kills.append(killed)
            recoveries.append(recovery)
        run.finish()
    finally:
        run.kill_all()
    ledgers = {}
    for rank, segments in run.segments.items():
        merged = {"time": [], "keys": [], "digests": [], "steps": []}
        for seg in segments:
            for field in merged:
                merged[field] += seg[field]
        merged["end"] = segments[-1]["end"]
        ledgers[rank] = merged
    return {"ledgers": ledgers, "kills": kills, "recoveries": recoveries}


def summarize(result: dict, reference: dict | None, corpus_keys: set[str]) -> dict:
    gaps = np.concatenate([np.diff(led["time"]) for led in result["ledgers"].values() if len(led["time"]) > 1])
    seen = [k for led in result["ledgers"].values() for batch in led["keys"] for k in batch]
    counts: dict[str, int] = {}
    for k in seen:
        counts[k] = counts.get(k, 0) + 1
    out = {
        "stall_ms": round(float(gaps.max()) * 1000, 1),
        "median_gap_ms": round(float(np.median(gaps)) * 1000, 2),
        "lost": len(corpus_keys - set(counts)),
        "duplicated": sum(n - 1 for n in counts.values() if n > 1),
        "ended": sorted({led["end"] for led in result["ledgers"].values()}),
    }
    if result["recoveries"]:
        out["recovery_ms"] = round(statistics.median(result["recoveries"]) * 1000, 1)
        out["recovery_ms_each"] = [round(x * 1000, 1) for x in result["recoveries"]]
        out["injections"] = len(result["recoveries"])
    if reference is not None:
        out["bytes_identical"] = all(
            result["ledgers"][r]["digests"] == reference["ledgers"][r]["digests"] for r in range(WORLD)
        )
    return out


def checkpoint_cost(n_sources: int, steps: int = 300) -> dict:
    """Median per-step cost and size of the Planner's differential checkpoint."""
    from overlord.config import Mesh
    from overlord.plan.checkpoint import Checkpoints
    from overlord.plan.core import PlannerCore, resolve_strategy
    from overlord.plan.meta import MetaChunk
    from overlord.plan.tree import ClientPlaceTree
    from overlord.store import EmbeddedRedis, Keys, connect

    rng = np.random.default_rng(0)
    core = PlannerCore(
        streams=[f"s{i}.0" for i in range(n_sources)],
        stream_source=list(range(n_sources)),
        tree=ClientPlaceTree(Mesh(dp=8)),
        weights=[1.0] * n_sources,
        seed=0,
        global_batch=256,
        micro_batches=4,
        finite=False,
        strategy=resolve_strategy("overlord.plan.strategies:balanced"),
        context_length=4096,
    )
    fed = [0] * n_sources

    def feed() -> None:
        for i, stream in enumerate(core.streams):
            if stream.count < 64:
                seq = np.arange(fed[i], fed[i] + 128)
                tokens = rng.integers(16, 4096, len(seq))
                core.add(i, MetaChunk(0, seq, tokens, np.zeros(len(seq), np.int32), tokens * 4))
                fed[i] += 128

    with tempfile.TemporaryDirectory(prefix="ovl-ckpt-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "run").start()
        try:
            r = connect(server.url)
            ckpts = Checkpoints(Keys("bench"))
            pipe = r.pipeline(transaction=True)
            ckpts.write(pipe, 0, None, core.state)
            pipe.execute()
            times, sizes = [], []
            for _ in range(steps):
                feed()
                plan = core.plan_step()
                if plan is None:
                    raise RuntimeError("the synthetic buffer ran dry")
                t0 = time.perf_counter()
                delta = core.delta()
                pipe = r.pipeline(transaction=True)
                ckpts.write(pipe, core.step, delta, core.state)
                pipe.execute()
                times.append(time.perf_counter() - t0)
                sizes.append(len(json.dumps(delta, separators=(",", ":"))))
            snapshot = len(json.dumps(core.state(), separators=(",", ":")))
        finally:
            server.stop()
    return {
        "ms": round(statistics.median(times) * 1000, 3),
        "bytes": int(statistics.median(sizes)),
        "snapshot_bytes": snapshot,
        "ms_p90": round(float(np.percentile(times, 90)) * 1000, 3),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [f for f in results if results[f]["kills"]]
    fig, axes = plt.subplots(len(faults), 1, figsize=(9, 1.9 * len(faults) + 0.6), squeeze=False)
    for ax, fault in zip(axes[:, 0], faults):
        res = results[fault]
        times = np.sort(np.concatenate([np.asarray(led["time"]) for led in res["ledgers"].values()]))
        t0 = min(times[0], min(res["kills"]))
        bins = np.arange(0, times[-1] - t0 + 0.1, 0.1)
        hist, _ = np.histogram(times - t0, bins=bins)
        ax.plot(bins[:-1], hist / 0.1, lw=0.8, color="tab:blue")
        for k in res["kills"]:
            ax.axvline(k - t0, color="tab:red", lw=1, ls="--")
        ax.set_ylabel("batches/s", fontsize=8)
        ax.set_title(f"kill -9 {fault} (red: injections)", fontsize=9, loc="left")
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1200, help="rows per source (4 sources, one epoch)")
    parser.add_argument("--sleep", type=float, default=0.02, help="each rank's training step, seconds")
    parser.add_argument("--out", default=str(HERE / "out"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint-cost measurement")
    parser.add_argument(
        "--transform-ms",
        type=float,
        default=4.0,
        help="also run both loader faults with a text transform of this CPU cost per sample "
        "(reported under faults_costly_transform; 0 skips)",
    )
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown fault(s) {unknown}; choose from {list(FAULTS)}")

    import pyarrow.parquet as pq

    from overlord.demo.corpus import generate_corpus

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = generate_corpus(
        out / f"failover-corpus-{args.rows}",
        seed=5,
        text_sources=3,
        image_sources=1,
        rows_per_source=args.rows,
        files_per_source=2,
        row_group_size=64,
        max_image_side=96,
    )
    corpus_keys = {
        f"{n}:{f}:{row}"
        for n, files in corpus.items()
        for f, p in enumerate(sorted(files))
        for row in range(pq.ParquetFile(p).metadata.num_rows)
    }
    total_steps = len(corpus_keys) // 32
    base = out / "failover-runs"
    reference = run_fault(corpus, base, None, 0, args.sleep, total_steps)
    results = {f: run_fault(corpus, base, f, args.repeats, args.sleep, total_steps) for f in faults}
    costly = [f for f in faults if f.startswith("loader_")] if args.transform_ms else []
    if costly:  # same bytes: the costly transform returns what the plain one does
        costly_ref = run_fault(corpus, base, None, 0, args.sleep, total_steps, args.transform_ms)
        costly_res = {
            f: run_fault(corpus, base, f, args.repeats, args.sleep, total_steps, args.transform_ms) for f in costly
        }
    line = {
        "faults": {f: summarize(results[f], reference, corpus_keys) for f in faults},
        "reference": summarize(reference, None, corpus_keys),
        "repeats": args.repeats,
        "sleep_ms": args.sleep * 1000,
        "ranks": WORLD,
        "samples": len(corpus_keys),
    }
    if costly:
        line["faults_costly_transform"] = {f: summarize(costly_res[f], reference, corpus_keys) for f in costly}
        line["reference_costly_transform"] = summarize(costly_ref, reference, corpus_keys)
        line["transform_ms"] = args.transform_ms
        results.update({f"{f} ({args.transform_ms:g} ms/sample transform)": costly_res[f] for f in costly})
    if not args.no_checkpoint:
        for n in (10, 1000):
            cost = checkpoint_cost(n)
            line[f"checkpoint_ms_{n}"] = cost["ms"]
            line[f"checkpoint_ms_p90_{n}"] = cost["ms_p90"]
            line[f"checkpoint_bytes_{n}"] = cost["bytes"]
            line[f"snapshot_bytes_{n}"] = cost["snapshot_bytes"]
    try:
        plot(results, out / "failover.png")
        line["png"] = str(out / "failover.png")
    except ImportError:
        line["png"] = None  # matplotlib comes with the [bench] extra
    print(json.dumps(line) if args.json else json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
