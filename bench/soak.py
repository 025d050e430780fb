"""Soak benchmark: a real endless job for minutes, recording the memory of every role.

Usage::

    python bench/soak.py --minutes 10 --json
    python bench/soak.py --minutes 1 --ranks 4 --sources 20 --json    # a quick look

prints ONE JSON line::

    {"rss_growth_pct", "rss_growth_role", "rss_growth_mib", "rss_growth_mib_role",
     "batches", "errors", "error_detail": {...}, "samples", "batches_per_s",
     "roles": {"<role>": {"start_mib", "end_mib", "growth_pct", "slope_mib_per_h",
                          "samples", "pid_changes"}, ...},
     "redis_store": {"used_memory_mib", "used_memory_growth_pct", "keys",
                     "key_families_at_end"}, ...}

writes ``bench/out/soak.png`` (RSS over time of the sidecar's roles, of the trainer
ranks, and every role's growth after the warm-up; the warm-up shaded), and keeps the
run's logs, trainer results and every sample (``series.json``) under
``bench/out/soak-runs/<job>/``. The exit status is 0 when ``errors`` is 0.

The job: ``--sources`` Parquet sources of ``--rows-per-source`` rows (one in 30
image-text; `bench/memory.py`'s corpus, generated once under ``bench/out``) with
weights falling as 1/sqrt(i+1), read forever (``epochs: None``) by a real sidecar
(``overlord sidecar --config``: embedded redis-server, Planner, 2 Source Loader
processes, the Data Constructor host, and the Prometheus endpoint, scraped every sample
as Prometheus would) and ``--ranks`` trainer
processes (mesh dp x ``--tp``) that read with `overlord.torch.DataLoader`, sum each
micro-batch's loss mask (touching its bytes) and sleep ``--step-ms`` (the training step).
At the end the trainers close their loaders and must exit 0; then the sidecar gets
SIGTERM and must exit 0, leaving no shared-memory segment of the job.

Measures. Every ``--sample-s`` the harness reads the RSS (`overlord.procmem.rss_bytes`)
of every process of the sidecar's tree and of every trainer. A process is named by its
role: from the job's heartbeats (pid -> ``<role><index>``), else from
``/proc/<pid>/comm`` (roles call themselves ``ovl-<role><index>``; ``redis-server``),
else from its command line (``metrics``, ``flight``), the sidecar itself ``sidecar``,
trainers ``rank<r>``. The first ``--warmup-min`` minutes (default 20% of the run, at
least 1 minute but never more than half of it) are not measured. A role's growth is
from the median of the first third of its samples after the warm-up to the median of
the last third, in percent of the first: a Source Loader's RSS swings by 10-20% with
the samples it holds, and three samples at each end read that swing as growth or
shrinkage. ``rss_growth_pct`` is the largest over roles. A role whose pid changed
(restarted) counts as an error, and its series starts again.

``errors`` sums: trainers that raised or exited non-zero (or did not exit), the
length of the job's error list (``overlord:{job}:errors``), role restarts (the larger
of the ``overlord:{job}:restarts`` total and the pid changes seen, so one restart
counts once), failed scrapes of ``/metrics`` (after its first answer), a sidecar exit
status other than 0, shared-memory segments left behind, and a run stopped early.
``redis_store`` says what the embedded Redis holds (``used_memory`` and keys after the
warm-up and at the end, the largest key families with their TTL) and
``used_memory_growth_pct``, its ``used_memory`` growth measured as a role's RSS growth
is: the redis role's RSS follows it. Where both grow, the job's data grew; where only
the RSS does, the allocator around it did.
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
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = HERE / "out"
MIB = 1 << 20
SAMPLES_PER_END = 3  # the fewest samples whose median starts or ends a role's measured series


def _end(measured: list) -> int:
    """How many samples at each end of a measured series make its start and end: a third."""
    return max(SAMPLES_PER_END, len(measured) // 3)


sys.path.insert(0, str(HERE))  # bench/memory.py's corpus helpers (imported where used: not in trainers)


# Trainer side: runs in the spawned trainer processes.


def _trainer_main(cfg: dict) -> int:
    """One rank: read until ``cfg["end"]`` (wall clock), then close and report."""
    from overlord.torch import DataLoader

    loader = DataLoader(cfg["config"], rank=cfg["rank"], world_size=cfg["ranks"], spawn_sidecar=False)
    result = {"rank": cfg["rank"], "tp": loader.coords["tp"], "batches": 0, "samples": 0, "tokens": 0, "error": None}
    try:
        batches = iter(loader)
        while time.time() < cfg["end"]:
            try:
                batch = next(batches)
            except StopIteration:
                raise RuntimeError("the endless job ended") from None
            result["tokens"] += int(batch["loss_mask"].sum())  # reads the micro-batch's bytes
            result["samples"] += len(loader.last_meta["keys"])
            result["batches"] += 1
            time.sleep(cfg["step_s"])  # the training step
    except Exception as exc:  # noqa: BLE001 - the harness reports it
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        loader.close()
    tmp = Path(cfg["out"] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, cfg["out"])
    return 0 if result["error"] is None else 1


# Harness side.


def _job(corpus: Path, args, run_dir: Path, metrics_port: int):
    """The soak's job over the corpus: endless, dp x tp ranks, a 4k-token packed batch."""
    from memory import _corpus_sources

    from overlord.config import BatchSpec, Job, Mesh, Source

    if args.ranks % args.tp:
        raise SystemExit(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}")
    dp = args.ranks // args.tp
    sources = tuple(
        Source(name=name, paths=tuple(files), transform=spec, weight=round(1 / (i + 1) ** 0.5, 4), shuffle_window=64)
        for i, (name, files, spec) in enumerate(_corpus_sources(corpus))
    )
    return Job(
        name=f"soak{os.getpid()}",
        sources=sources,
        mesh=Mesh(dp=dp, tp=args.tp),
        seed=args.seed,
        epochs=None,
        batch=BatchSpec(global_batch=dp * 32, micro_batches=2, context_length=4096, ring_bytes=4 << 20),
        run_dir=str(run_dir),
        loader_processes=2,
        buffer_samples=128,
        sample_ring_bytes=1 << 20,
        timeout_s=120.0,
        metrics_port=metrics_port,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _role_name(pid: int, sidecar_pid: int, by_heartbeat: dict[int, str]) -> str:
    """What a process of the sidecar's tree is (see the module docstring)."""
    if pid == sidecar_pid:
        return "sidecar"
    if pid in by_heartbeat:
        return by_heartbeat[pid]
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if comm.startswith("ovl-"):
        role = comm.removeprefix("ovl-")
        # comm holds 15 characters: "ovl-constructor0" loses its index (one host per node)
        return role if role[-1].isdigit() else f"{role}0"
    if comm.startswith("redis"):
        return "redis"
    for module, role in (("overlord.metrics", "metrics"), ("overlord.remote", "flight")):
        if module in cmdline:
            return role
    return f"{comm}-{pid}"


class Series:
    """One role's RSS samples; a new pid (a restart) starts it again."""

    def __init__(self, pid: int) -> None:
        self.pid, self.pid_changes = pid, 0
        self.times: list[float] = []
        self.rss: list[int] = []
        self.history: list[tuple[list[float], list[int]]] = []  # earlier lives, for the plot

    def add(self, pid: int, t: float, rss: int) -> None:
        if pid != self.pid:
            self.history.append((self.times, self.rss))
            self.pid, self.pid_changes, self.times, self.rss = pid, self.pid_changes + 1, [], []
        self.times.append(t)
        self.rss.append(rss)

    def summary(self, warmup_s: float) -> dict:
        """Growth over the measured part (after the warm-up) of the current life."""
        measured = [(t, b) for t, b in zip(self.times, self.rss) if t >= warmup_s]
        out: dict = {"samples": len(measured), "pid_changes": self.pid_changes}
        if len(measured) < 2 * SAMPLES_PER_END:
            return {**out, "start_mib": None, "end_mib": None, "growth_pct": None, "slope_mib_per_h": None}
        start = statistics.median(b for _, b in measured[: _end(measured)])
        end = statistics.median(b for _, b in measured[-_end(measured) :])
        ts = [t for t, _ in measured]
        mean_t, mean_b = statistics.fmean(ts), statistics.fmean(b for _, b in measured)
        slope = sum((t - mean_t) * (b - mean_b) for t, b in measured) / sum((t - mean_t) ** 2 for t in ts)
        return {
            **out,
            "start_mib": round(start / MIB, 2),
            "end_mib": round(end / MIB, 2),
            "growth_pct": round((end - start) / start * 100, 2) if start else None,
            "slope_mib_per_h": round(slope * 3600 / MIB, 2),
        }


class Soak:
    """The sidecar, the trainers and the sampler of one soak run."""

    def __init__(self, job, workdir: Path, args) -> None:
        from overlord.status import redis_url_of
        from overlord.store import Keys

        self.job, self.workdir, self.args = job, workdir, args
        self.keys = Keys(job.name)
        self.url = redis_url_of(job)
        self.config = workdir / "job.json"
        self.config.write_text(job.to_json())
        self.sidecar: subprocess.Popen | None = None
        self.trainers: dict[int, subprocess.Popen] = {}
        self.series: dict[str, Series] = {}
        self.scrape_errors = 0  # failed scrapes of /metrics after the first one that answered
        self.scraped = False
        self.redis_info: list[tuple[float, int, int]] = []  # (t, used_memory bytes, keys)
        # PSS beside RSS: a forked role's RSS also counts the sidecar's pages it shares
        # copy-on-write and merely touches; PSS charges it its share of them
        self.pss: dict[str, Series] = {}
        self.held: dict[str, list[tuple[float, int, int]]] = {}  # loader -> (t, sample bytes held, Arrow pool bytes)
        self.redis_errors = 0  # the harness's own failed reads of the job's Redis
        self.t0 = 0.0
        self._r = None

    def redis(self):
        if self._r is None:
            from overlord.store import connect

            self._r = connect(self.url, timeout_s=5)
        return self._r

    def start_sidecar(self) -> None:
        """Starts the sidecar and waits until it runs (its Redis answers on the socket)."""
        from overlord.sidecar.sidecar import sidecar_running

        log = open(self.workdir / "sidecar.log", "wb")
        self.sidecar = subprocess.Popen(
            [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        deadline = time.monotonic() + 120
        while not (sidecar_running(self.job) and (self.job.run_path / "redis.sock").exists()):
            if self.sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start; see {self.workdir / 'sidecar.log'}")
            time.sleep(0.1)

    def start_trainers(self, end: float, step_s: float) -> None:
        """Starts every trainer rank; each reads until `end` (wall clock)."""
        world = self.job.mesh.world_size
        for rank in range(world):
            cfg = dict(
                config=str(self.config),
                rank=rank,
                ranks=world,
                end=end,
                step_s=step_s,
                out=str(self.workdir / f"rank{rank}.json"),
            )
            self.trainers[rank] = subprocess.Popen(
                [sys.executable, __file__, "--trainer", json.dumps(cfg)],
                stdout=open(self.workdir / f"rank{rank}.log", "wb"),
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def _heartbeat_pids(self) -> dict[int, str]:
        try:
            r = self.redis()
            names = list(r.scan_iter(match=self.keys.heartbeat_pattern, count=100))
            raws = r.mget(names) if names else []
        except Exception:  # noqa: BLE001 - Redis busy or away: fall back to /proc names
            self.redis_errors += 1
            return {}
        out = {}
        for name, raw in zip(names, raws):
            if raw:
                role, ident = name.decode().rsplit(":", 2)[-2:]
                out[json.loads(raw)["pid"]] = f"{role}{ident}"
        return out

    def sample(self) -> None:
        """Records the RSS of every role and scrapes /metrics once."""
        from overlord.procmem import pss_bytes, rss_bytes, tree_pids

        t = time.monotonic() - self.t0
        procs = {f"rank{r}": p.pid for r, p in self.trainers.items() if p.poll() is None}
        if self.sidecar.poll() is None:
            by_heartbeat = self._heartbeat_pids()
            try:
                tree = tree_pids(self.sidecar.pid)
            except ProcessLookupError:
                tree = []  # it exited just now; the main loop sees it
            for pid in tree:
                procs.setdefault(_role_name(pid, self.sidecar.pid, by_heartbeat), pid)
        for role, pid in procs.items():
            try:
                rss, pss = rss_bytes(pid), pss_bytes(pid)
            except ProcessLookupError:
                continue  # exited between listing and reading
            if role not in self.series:
                self.series[role], self.pss[role] = Series(pid), Series(pid)
            self.series[role].add(pid, t, rss)
            self.pss[role].add(pid, t, pss)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.job.metrics_port}/metrics", timeout=10) as resp:
                resp.read()
            self.scraped = True
        except OSError:
            self.scrape_errors += self.scraped  # before its first answer it is still starting
        try:
            r = self.redis()
            self.redis_info.append((t, int(r.info("memory")["used_memory"]), int(r.dbsize())))
            for name, raw in r.hgetall(self.keys.stats).items():
                if name.startswith(b"loader"):  # what a loader holds: its read buffers and sent-but-kept samples
                    rec = json.loads(raw)
                    held = rec.get("kept_bytes", 0) + sum(x.get("buffered_bytes", 0) for x in rec["streams"].values())
                    self.held.setdefault(name.decode(), []).append((t, held, rec.get("arrow_bytes", 0)))
        except Exception:  # noqa: BLE001 - diagnostics only
            self.redis_errors += 1

    def progress(self) -> int:
        """Batches read so far over all ranks (the trainers' published totals)."""
        try:
            stats = self.redis().hgetall(self.keys.stats)
        except Exception:  # noqa: BLE001
            return -1
        return sum(json.loads(v).get("batches", 0) for k, v in stats.items() if k.startswith(b"rank"))

    def job_errors(self) -> tuple[int, int, list[str]]:
        """(error list length, restarts total, the first error messages) from the job's Redis."""
        r = self.redis()
        errors = r.llen(self.keys.errors)
        restarts = sum(int(v) for v in r.hgetall(self.keys.restarts).values())
        first = [json.loads(raw).get("message", "")[:300] for raw in r.lrange(self.keys.errors, 0, 2)]
        return errors, restarts, first

    def key_families(self) -> dict[str, dict]:
        """The job's Redis keys by family (the key with its job prefix and step or id
        dropped): how many, their summed `MEMORY USAGE` in KiB and the largest TTL
        left (s; -1: none), the 8 largest families first."""
        r = self.redis()
        names = list(r.scan_iter(match=self.keys.pattern, count=1000))
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.memory_usage(name)
            pipe.ttl(name)
        replies = pipe.execute()
        families: dict[str, dict] = {}
        for name, size, ttl in zip(names, replies[0::2], replies[1::2]):
            rest = name.decode().removeprefix(self.keys.base + ":")
            family = ":".join("<n>" if part.isdigit() else part for part in rest.split(":"))
            family = "meta:<stream>" if family.startswith("meta:") else family
            fam = families.setdefault(family, {"keys": 0, "kib": 0.0, "ttl_s": -1})
            fam["keys"] += 1
            fam["kib"] += (size or 0) / 1024
            fam["ttl_s"] = max(fam["ttl_s"], ttl)
        ranked = sorted(families.items(), key=lambda kv: -kv[1]["kib"])
        return {f: {**v, "kib": round(v["kib"], 1)} for f, v in ranked[:8]}

    def save_series(self, path: Path) -> None:
        """Every sample of every role (and of Redis's own accounting), for a closer look."""
        path.write_text(
            json.dumps(
                {
                    "roles": {
                        role: {"pid": s.pid, "earlier": s.history, "t": s.times, "rss": s.rss}
                        for role, s in self.series.items()
                    },
                    "redis": {
                        "t": [x[0] for x in self.redis_info],
                        "used_memory": [x[1] for x in self.redis_info],
                        "keys": [x[2] for x in self.redis_info],
                    },
                    "loader_held_bytes": self.held,
                }
            )
        )

    def finish_trainers(self, timeout: float) -> tuple[list[dict], list[str]]:
        """Waits for every trainer; returns their results and what went wrong."""
        deadline = time.monotonic() + timeout
        results, problems = [], []
        for rank, proc in self.trainers.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                problems.append(f"rank {rank} did not exit within {timeout:.0f} s of the end")
                continue
            path = self.workdir / f"rank{rank}.json"
            result = json.loads(path.read_text()) if path.exists() else {"rank": rank, "batches": 0, "samples": 0}
            results.append(result)
            if result.get("error"):
                problems.append(f"rank {rank}: {result['error']}")
            elif rc != 0:
                problems.append(f"rank {rank} exited with status {rc}; see {self.workdir / f'rank{rank}.log'}")
        return results, problems

    def stop_sidecar(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status (SIGKILL and -9 past the timeout)."""
        if self.sidecar.poll() is None:
            self.sidecar.send_signal(signal.SIGTERM)
        try:
            return self.sidecar.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.sidecar.kill()
            self.sidecar.wait(timeout=10)
            return -9

    def kill_all(self) -> None:
        """On any failure of the harness: nothing of the run may outlive it."""
        from overlord.shm import unlink_all

        for proc in [*self.trainers.values(), self.sidecar]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        unlink_all(self.job.name)


def _redis_growth(info: list[tuple[float, int, int]], warmup_s: float, families: dict) -> dict:
    """What the job's Redis holds after the warm-up and at the end (diagnostics for the
    redis role's RSS): `used_memory`, key count, and the key families at the end.
    `used_memory_growth_pct` is measured as a role's RSS growth is (median of the first
    third after the warm-up to the median of the last): the part of the redis role's RSS
    growth that is the job's data (and client buffers), not the allocator around it."""
    measured = [x for x in info if x[0] >= warmup_s] or info
    if not measured:
        return {"key_families_at_end": families}
    first, last = measured[0], measured[-1]
    used = Series(0)
    for t, used_memory, _ in info:
        used.add(0, t, used_memory)
    return {
        "used_memory_mib": [round(first[1] / MIB, 2), round(last[1] / MIB, 2)],
        "used_memory_growth_pct": used.summary(warmup_s)["growth_pct"],
        "keys": [first[2], last[2]],
        "key_families_at_end": families,
    }


def _largest(values: dict[str, float | None]) -> tuple[str | None, float | None]:
    """The role with the largest value (None where a role has none), and that value."""
    have = {role: v for role, v in values.items() if v is not None}
    role = max(have, key=have.get) if have else None
    return role, have.get(role)


def plot(series: dict[str, Series], warmup_s: float, path: Path) -> None:
    """RSS over time per role: sidecar side above, trainers below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("sidecar and its roles", sorted(r for r in series if not r.startswith("rank"))),
        ("trainer ranks", sorted((r for r in series if r.startswith("rank")), key=lambda r: int(r[4:]))),
    ]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    axes[2].set_prop_cycle(color=plt.get_cmap("tab20").colors)  # one colour per role
    for ax, (title, roles) in zip(axes, groups):
        for role in roles:
            s = series[role]
            color = None
            for times, rss in [*s.history, (s.times, s.rss)]:
                (line,) = ax.plot(
                    [t / 60 for t in times],
                    [b / MIB for b in rss],
                    lw=1,
                    color=color,
                    label=role if color is None else None,
                )
                color = line.get_color()
        ax.axvspan(0, warmup_s / 60, color="0.9", zorder=0)
        ax.set_title(f"{title} (grey: warm-up, not measured)", fontsize=9, loc="left")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=6, ncol=4, loc="upper left")
        ax.tick_params(labelsize=7)
    ax = axes[2]
    for role in groups[0][1] + groups[1][1]:
        s = series[role]
        measured = [(t, b) for t, b in zip(s.times, s.rss) if t >= warmup_s]
        if len(measured) >= SAMPLES_PER_END:
            base = statistics.median(b for _, b in measured[: _end(measured)])
            ax.plot([t / 60 for t, _ in measured], [(b - base) / base * 100 for _, b in measured], lw=1, label=role)
    ax.axhline(2, color="tab:red", lw=0.8, ls="--")
    ax.axvspan(0, warmup_s / 60, color="0.9", zorder=0)
    ax.set_title(
        "RSS after the warm-up, % of the median of its first third (red: the 2% target)", fontsize=9, loc="left"
    )
    ax.set_ylabel("growth (%)")
    ax.legend(fontsize=6, ncol=6, loc="upper left")
    ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> dict:
    """One soak; returns the JSON line's fields."""
    from memory import corpus_for

    from overlord.shm import list_segments

    warmup_min = args.warmup_min if args.warmup_min is not None else min(max(1.0, 0.2 * args.minutes), args.minutes / 2)
    warmup_s, duration_s = warmup_min * 60, args.minutes * 60
    corpus = corpus_for(args.sources, rows_per_source=args.rows_per_source, row_group_size=128, seed=args.seed)
    run_dir = Path(f"/tmp/overlord-soak-{os.getpid()}")  # short: it holds Redis's unix socket
    job = _job(corpus, args, run_dir, _free_port())
    workdir = OUT / "soak-runs" / job.name
    workdir.mkdir(parents=True, exist_ok=True)
    soak = Soak(job, workdir, args)
    detail: dict = {}
    try:
        start_wall = time.time()
        soak.start_sidecar()
        soak.t0 = time.monotonic()  # trainer start-up (torch imports) is part of the warm-up
        # trainers stop a little after the last sample, so every sample is of a running job
        soak.start_trainers(end=time.time() + duration_s + 2 * args.sample_s, step_s=args.step_ms / 1000)
        next_sample, next_note = 0.0, 60.0
        while (now := time.monotonic() - soak.t0) < duration_s:
            if now >= next_sample:
                soak.sample()
                next_sample += args.sample_s
            if now >= next_note:
                print(f"soak: {now / 60:.0f}/{args.minutes:g} min, {soak.progress()} batches", file=sys.stderr)
                next_note += 60
            dead = [r for r, p in soak.trainers.items() if p.poll() is not None]
            if dead or soak.sidecar.poll() is not None:
                detail["stopped_early"] = f"at {now:.0f} s: " + (
                    f"ranks {dead} exited" if dead else f"the sidecar exited with {soak.sidecar.returncode}"
                )
                break
            time.sleep(min(0.5, max(0.0, next_sample - (time.monotonic() - soak.t0))))
        if "stopped_early" in detail:
            for proc in soak.trainers.values():
                if proc.poll() is None:
                    proc.terminate()
        else:
            soak.sample()  # the last one, at the end of the run
        results, problems = soak.finish_trainers(timeout=max(60.0, 4 * args.sample_s + job.timeout_s))
        try:
            redis_errors, restarts, first_errors = soak.job_errors()
            families = soak.key_families()
        except Exception as exc:  # noqa: BLE001 - the sidecar (and its Redis) died: report, still stop it
            redis_errors, restarts, first_errors, families = 1, 0, [f"the job's Redis is unreadable: {exc}"], {}
        sidecar_rc = soak.stop_sidecar()
        left = list_segments(job.name)
    except BaseException:
        soak.kill_all()
        raise
    if left:
        from overlord.shm import unlink_all

        unlink_all(job.name)
    shutil.rmtree(run_dir, ignore_errors=True)
    soak.save_series(workdir / "series.json")

    roles = {role: s.summary(warmup_s) for role, s in sorted(soak.series.items())}
    pss = {role: s.summary(warmup_s) for role, s in sorted(soak.pss.items())}
    worst, worst_pct = _largest({r: v["growth_pct"] for r, v in roles.items()})
    pss_worst, pss_worst_pct = _largest({r: v["growth_pct"] for r, v in pss.items()})
    most, most_mib = _largest({r: v["end_mib"] - v["start_mib"] for r, v in roles.items() if v["end_mib"] is not None})
    pid_changes = sum(s.pid_changes for s in soak.series.values())
    soak.scrape_errors += not soak.scraped  # /metrics never answered
    detail.update(
        trainer_failures=len(problems),
        redis_errors=redis_errors,
        role_restarts=max(restarts, pid_changes),
        metrics_scrape_errors=soak.scrape_errors,
        sidecar_rc=sidecar_rc,
        segments_left=len(left),
    )
    errors = (
        detail["trainer_failures"]
        + redis_errors
        + detail["role_restarts"]
        + soak.scrape_errors
        + (sidecar_rc != 0)
        + len(left)
        + ("stopped_early" in detail)
    )
    if problems or first_errors:
        detail["messages"] = (problems + first_errors)[:5]
    batches = sum(r["batches"] for r in results)
    line = {
        "rss_growth_pct": worst_pct,
        "rss_growth_role": worst,
        "rss_growth_mib": None if most_mib is None else round(most_mib, 2),
        "rss_growth_mib_role": most,
        "pss_growth_pct": pss_worst_pct,
        "pss_growth_role": pss_worst,
        "pss": {r: {k: v[k] for k in ("start_mib", "end_mib", "growth_pct")} for r, v in pss.items()},
        "batches": batches,
        "errors": errors,
        "error_detail": detail,
        "batches_per_s": round(batches / duration_s, 1),
        "samples": sum(r["samples"] for r in results if r.get("tp") == 0),  # TP ranks share their samples
        "minutes": args.minutes,
        "warmup_min": round(warmup_min, 2),
        "sample_s": args.sample_s,
        "ranks": job.mesh.world_size,
        "mesh": f"dp{job.mesh.dp}xtp{job.mesh.tp}",
        "sources": len(job.sources),
        "step_ms": args.step_ms,
        "loader_processes": job.loader_processes,
        "roles": roles,
        "redis_store": _redis_growth(soak.redis_info, warmup_s, families),
        "harness_redis_read_errors": soak.redis_errors,
        "wall_s": round(time.time() - start_wall, 1),
        "logs": str(workdir),
    }
    try:
        plot(soak.series, warmup_s, OUT / "soak.png")
        line["png"] = str(OUT / "soak.png")
    except ImportError:
        line["png"] = None  # matplotlib comes with the [bench] extra: pip install -e '.[bench]'
    return line


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size; dp = ranks / tp")
    p.add_argument("--sources", type=int, default=100)
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument(
        "--warmup-min",
        type=float,
        default=None,
        help="minutes not measured (default: 20%% of the run, at least 1, at most half)",
    )
    p.add_argument("--step-ms", type=float, default=50.0, help="each rank's simulated training step")
    # With 5,000 rows the job's state in Redis stays closer to one size through a
    # 10-minute run (`used_memory` +0.7%, +2.7%, -1.1% in three runs). With 500, the 762k
    # samples of a run read the corpus 15 times over (its heaviest source was at epoch
    # 10 by step 743), so the plans and checkpoint deltas name ever larger epoch numbers:
    # `used_memory` grew up to 5.4% after the warm-up (longer JSON, not a leak) and the
    # redis role's RSS with it.
    p.add_argument("--rows-per-source", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line (the default)")
    p.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: run as a trainer rank
    args = p.parse_args(argv)
    if args.trainer:
        return _trainer_main(json.loads(args.trainer))
    if args.sources < 1 or args.ranks < 1 or args.minutes <= 0 or args.sample_s <= 0:
        raise SystemExit("--sources, --ranks, --minutes and --sample-s must be positive")
    OUT.mkdir(parents=True, exist_ok=True)
    line = run(args)
    print(json.dumps(line), flush=True)
    return 0 if line["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
