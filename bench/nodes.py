"""Node benchmark: a job on namespaced nodes, with and without node faults.

Usage::

    python bench/nodes.py --json                                  # every fault
    python bench/nodes.py --faults node_kill,partition_10s --json

prints ONE JSON line::

    {"nodes", "ranks_per_node", "sources", "samples", "shadow",
     "samples_per_s", "pss_mb_per_node": {node: MiB}, "cross_node_bytes_per_step",
     "redis_ops_per_step", "steps",
     "faults": {"<fault>": {"lost", "duplicated", "stall_ms", "median_gap_ms",
                            "stall_over_gap", "bytes_identical", "seconds", ...}, ...}}

and writes ``bench/out/nodes.png``: the trainers' throughput over time (batches/s over
every rank, 0.5 s bins) in each run, the fault marked.

Every node is a host of its own (tests/integration/hosts.py): its own network, IPC,
mount (a private /dev/shm) and PID namespaces, joined to the others by a veth pair
onto a private bridge; Redis (or a primary, a replica and three Sentinels) runs on
hosts of its own, reached over TCP; data between nodes goes over Arrow Flight on the
nodes' own addresses. Only those addresses are dialled. It needs root (CI runs as
root); without namespaces it prints ``{"skipped": why}``.

Each run is one epoch of `--sources` sources (every row exactly once) on `--nodes`
nodes x `--ranks-per-node` trainer ranks, each rank sleeping `--sleep` per batch (its
training step). The first run has no fault: samples/s, the PSS of each node's
processes (sampled every second, the mean), the bytes that crossed between nodes per
step (the bridge ports' counters, less what went to and from Redis), and Redis
commands per step (INFO). Then one run per fault, each on a fresh fabric, on node n1
after `--warm` steps:

- ``node_kill``: every process of n1 but its trainers dies (sidecar and roles); its
  sidecar is started again after `--down-s` (as systemd would).
- ``loader_kill``: only n1's Source Loader processes die (SIGKILL); their shadows on
  the other nodes take them over (with shadows on): the shadow takeover's own stall.
- ``node_loss``: n1 vanishes with its trainers (the init of its PID namespace); as
  torchrun would, every other rank is killed too, and once n1 is back every rank
  restarts from its last `state_dict` (saved every `--save-every` batches).
- ``partition_10s`` / ``partition_60s``: n1's link down for 10 s / 60 s
  (`Job.redis_outage_s` is raised past it, as a user who rides out such cuts sets it).
- ``redis_primary_kill``: the host of the Redis primary vanishes; the Sentinels
  promote the replica. ``acknowledged_lost`` is 1 if the planner checkpoint of the
  last step acknowledged as durable before the loss is gone after it.
- ``second_failure``: n1's roles die (trainers live); once its Data Constructor host
  runs on another node, that node's roles die too; both sidecars come back after
  `--down-s`.

``lost`` and ``duplicated`` count sample keys against the corpus over every rank of
every node (for node_loss: what each rank received up to its saved state, then after
the restart). ``median_gap_ms`` is the median time between two batches of a rank in
the run; ``stall_ms`` the longest gap of any rank that ends after the fault began
(across a restart: from the last batch of the saved state to the first after it);
``bytes_identical`` compares every rank's batch digests with the run without a fault.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "tests" / "integration"), str(REPO)]

from hosted import FLIGHT_PORT, HostedJob, stall  # noqa: E402
from hosts import Fabric, _run, unavailable  # noqa: E402

from overlord import BatchSpec, Job, Mesh, Source  # noqa: E402
from overlord.demo.corpus import generate_many, read_manifest  # noqa: E402
from overlord.errors import ConfigError  # noqa: E402
from overlord.procmem import pss_of  # noqa: E402
from overlord.store import Keys, connect  # noqa: E402
from overlord.store.schema import PLANNER_DURABLE, built_field, decode_active  # noqa: E402

OUT = HERE / "out"
FAULTS = (
    "node_kill",
    "loader_kill",
    "node_loss",
    "partition_10s",
    "partition_60s",
    "redis_primary_kill",
    "second_failure",
)
VICTIM = "n1"
MIB = 1 << 20


# -- the corpus and the job -----------------------------------------------------------


def corpus_for(sources: int, rows: int) -> tuple[list[tuple[str, list[str], str]], set[str]]:
    """The sources ([(name, files, transform)]) and the key of every row."""
    import pyarrow.parquet as pq

    root = OUT / f"corpus-nodes-s{sources}-r{rows}"
    generate_many(root, sources, rows, seed=19, files_per_source=1, row_group_size=16, max_image_side=64)
    manifest = read_manifest(root)
    assert manifest is not None
    found, keys = [], set()
    for name, entry in manifest["sources"].items():
        files = sorted(str(root / rel) for rel in entry["files"])
        found.append((name, files, entry["transform"]))
        for f, path in enumerate(files):
            keys |= {f"{name}:{f}:{row}" for row in range(pq.ParquetFile(path).metadata.num_rows)}
    return found, keys


def make_job(args, sources, run_dir: Path, *, shadow: bool, **overrides) -> Job:
    nodes = tuple(f"n{i}" for i in range(args.nodes))
    world = args.nodes * args.ranks_per_node
    fields = dict(
        name=f"b{os.urandom(4).hex()}",
        sources=tuple(
            Source(name=n, paths=tuple(files), transform=spec, shuffle_window=16, shadow=shadow)
            for n, files, spec in sources
        ),
        mesh=Mesh(dp=world),
        nodes=nodes,
        flight_port=FLIGHT_PORT,
        redis_url="redis://unset",  # HostedJob points it at the Redis it starts
        seed=23,
        epochs=1,
        run_dir=str(run_dir),
        loader_processes=args.nodes,
        plan_ahead=2,
        timeout_s=30.0,
        buffer_samples=16,
        sample_ring_bytes=1 << 20,
        batch=BatchSpec(global_batch=world * args.per_rank, micro_batches=2, context_length=256, ring_bytes=256 << 10),
    )
    fields.update(overrides)
    return Job(**fields)


def shadow_supported(args, sources, tmp: Path) -> bool:
    """Whether this build places shadow loaders on several nodes (Source.shadow)."""
    try:
        make_job(args, sources, tmp, shadow=True)
        return True
    except ConfigError:
        return False


# -- one run ----------------------------------------------------------------------------


class Run:
    """One job on a fresh fabric: its sidecars, its trainers, the fault's marks."""

    def __init__(self, args, job: Job, workdir: Path, *, sentinel: bool = False, save_every: int = 0) -> None:
        self.args, self.workdir, self.save_every = args, workdir, save_every
        workdir.mkdir(parents=True)
        self.fabric = Fabric(shm_bytes=512 << 20)
        try:
            self.h = HostedJob(self.fabric, job, workdir, sentinel=sentinel)
        except BaseException:
            self.fabric.close()
            raise
        self.job, self.keys = self.h.job, Keys(self.h.job.name)
        self.r = connect(self.job.redis_url, timeout_s=2, ride_through_s=90)
        self.first: dict[int, dict] = {}  # rank -> its ledger up to its saved state (node_loss)
        self.marks: list[tuple[float, str]] = []  # (time, what) of the fault's steps
        self.started = 0.0

    def start(self) -> None:
        for node in self.job.node_ids:
            self.h.start_sidecar(node)
        self.started = time.time()
        self._trainers(range(self.job.mesh.world_size))

    def _trainers(self, ranks, states: dict[int, Path] | None = None) -> None:
        extra: dict[str, str] = {"sleep": str(self.args.sleep)}
        if self.save_every:
            extra["save-every"] = str(self.save_every)
        for rank in ranks:
            more = {"load-state": str(states[rank])} if states else {}
            self.h.start_trainers(ranks=[rank], **extra, **more)

    def built(self) -> int:
        try:
            progress = self.r.hgetall(self.keys.progress)
        except Exception:  # noqa: BLE001 - mid-failover
            return -1
        return min(int(progress.get(built_field(d).encode(), -1)) for d in range(self.job.mesh.dp))

    def until(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (after {timeout:g}s)")
            time.sleep(0.05)

    def mark(self, what: str) -> None:
        self.marks.append((time.time(), what))

    def ranks_on(self, node: str) -> list[int]:
        return [rank for rank in self.h.trainers if self.job.node_of_rank(rank) == node]

    def kill_roles(self, node: str) -> None:
        """Every process of `node` but its init and its trainers dies at once."""
        self.h.kill_roles(node)

    def placed(self, unit: str) -> str | None:
        try:
            raw = self.r.hget(self.keys.placement, unit)
        except Exception:  # noqa: BLE001 - mid-failover
            return None
        return raw.decode() if raw is not None else None

    def results(self, timeout: float) -> dict[int, dict]:
        out = self.h.results(timeout=timeout)
        if not self.first:
            return out
        merged = {}
        for rank, rec in out.items():
            first = self.first.get(rank, {"keys": [], "digests": [], "times": []})
            merged[rank] = {
                **rec,
                "keys": first["keys"] + rec["keys"],
                "digests": first["digests"] + rec["digests"],
                "times": first["times"] + rec["times"],
            }
        return merged

    def close(self) -> None:
        try:
            self.h.stop()
        except Exception:  # noqa: BLE001 - closing the fabric kills what is left
            pass
        self.h.kill_all()
        self.fabric.close()


# -- the faults -------------------------------------------------------------------------


def node_kill(run: Run) -> None:
    run.mark("n1's sidecar and roles killed")
    run.kill_roles(VICTIM)
    time.sleep(run.args.down_s)
    run.h.start_sidecar(VICTIM)
    run.mark("n1's sidecar back")


def loader_kill(run: Run) -> dict:
    """Only n1's Source Loader processes die: their shadows on the other nodes take them
    over (n1's sidecar, Data Constructors and trainers live), so the stall is the
    shadow takeover's own."""
    active = [decode_active(raw) for raw in run.r.hgetall(run.keys.active).values()]
    pids = [pid for pid, node in filter(None, active) if node == VICTIM]
    run.mark("n1's Source Loaders killed")
    host, killed = run.h.hosts[VICTIM], []
    for pid in pids:
        machine = host.machine_pid(pid)
        if machine is not None:
            os.kill(machine, signal.SIGKILL)
            killed.append(pid)
    if not killed:
        raise RuntimeError(f"no Source Loader process runs on {VICTIM} (active: {active})")
    return {"loaders_killed": len(killed)}


def node_loss(run: Run) -> None:
    host = run.h.hosts[VICTIM]
    run.mark("n1 lost with its trainers")
    host.kill()
    for proc in run.h.trainers.values():  # torchrun stops every other rank
        proc.kill()
    for proc in run.h.trainers.values():
        proc.wait(timeout=30)
    states = {}
    for rank in run.h.trainers:
        saved = json.loads(run.h.out(rank).read_text()) if run.h.out(rank).exists() else {}
        if "state" not in saved:
            raise RuntimeError(f"rank {rank} saved no state before the loss; raise --warm or lower --save-every")
        run.first[rank] = saved
        states[rank] = run.workdir / f"state{rank}.json"
        states[rank].write_text(json.dumps(saved["state"]))
    run.h.sidecars.pop(VICTIM, None)
    time.sleep(run.args.down_s)
    host.boot()  # the machine is back (its /dev/shm kept what the dead node left)
    run.h.start_sidecar(VICTIM)
    run.mark("n1 back; every rank restarts from its state")
    run.h.trainers.clear()
    run._trainers(range(run.job.mesh.world_size), states)


def partition(seconds: float):
    def cut(run: Run) -> None:
        run.mark(f"n1 cut off for {seconds:g}s")
        run.h.hosts[VICTIM].cut()
        time.sleep(seconds)
        run.h.hosts[VICTIM].mend()
        run.mark("n1's link back")

    return cut


def redis_primary_kill(run: Run) -> dict:
    sentinels = run.h.sentinels
    assert sentinels is not None
    acknowledged = int(run.r.hget(run.keys.planner, PLANNER_DURABLE) or -1)
    run.mark("the Redis primary's host lost")
    lost = sentinels.kill_primary()
    run.until(lambda: _primary_or_none(sentinels) not in (None, lost), "the Sentinels to promote the replica", 60)
    run.mark("replica promoted")
    from overlord.plan.checkpoint import Checkpoints  # deferred: only this fault reads checkpoints

    try:
        Checkpoints(run.keys).load(run.r, acknowledged + 1)
        acknowledged_lost = 0
    except Exception:  # noqa: BLE001 - PlanError: the acknowledged checkpoint is gone
        acknowledged_lost = 1
    return {"acknowledged_step": acknowledged, "acknowledged_lost": acknowledged_lost}


def _primary_or_none(sentinels) -> str | None:
    try:
        return sentinels.primary()
    except Exception:  # noqa: BLE001 - no Sentinel answers yet
        return None


def second_failure(run: Run) -> dict:
    unit = f"constructor{run.job.node_ids.index(VICTIM)}"
    run.mark("n1's sidecar and roles killed")
    run.kill_roles(VICTIM)
    run.until(lambda: run.placed(unit) not in (None, VICTIM), f"{unit} to run on another node", 60)
    other = run.placed(unit)
    assert other is not None
    time.sleep(1.0)  # its trainers read from there now
    run.mark(f"{other}'s sidecar and roles killed (it served n1's ranks)")
    run.kill_roles(other)
    time.sleep(run.args.down_s)
    run.h.start_sidecar(VICTIM)
    run.h.start_sidecar(other)
    run.mark("both sidecars back")
    return {"second_node": other}


INJECT = {
    "node_kill": node_kill,
    "loader_kill": loader_kill,
    "node_loss": node_loss,
    "partition_10s": partition(10),
    "partition_60s": partition(60),
    "redis_primary_kill": redis_primary_kill,
    "second_failure": second_failure,
}


# -- what a run measures -------------------------------------------------------------------


def ledger(out: dict[int, dict], keys: set[str]) -> tuple[int, int]:
    seen = Counter(k for rec in out.values() for batch in rec["keys"] for k in batch)
    lost = len(keys - set(seen))
    duplicated = sum(n - 1 for k, n in seen.items() if n > 1) + sum(n for k, n in seen.items() if k not in keys)
    return lost, duplicated


def gaps(out: dict[int, dict], after: float | None = None) -> tuple[float, float]:
    """(median gap, longest gap ending after `after`) between two batches of a rank, ms."""
    measured = stall(out, since=after if after is not None else 0.0)
    return measured["median_gap_s"] * 1000, measured["longest_gap_s"] * 1000


class NodeSampler:
    """Every second: the PSS of each node's processes."""

    def __init__(self, run: Run) -> None:
        self.run, self.stop = run, threading.Event()
        self.samples: dict[str, list[int]] = {n: [] for n in run.job.node_ids}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            for node in self.samples:
                pids = [p for p in self.run.h.hosts[node].pids()[1:] if not _is_trainer(p)]
                self.samples[node].append(pss_of(pids))

    def pss_mb(self) -> dict[str, float]:
        return {n: round(statistics.mean(s) / MIB, 1) if s else float("nan") for n, s in self.samples.items()}


def _is_trainer(pid: int) -> bool:
    try:
        return "ledger_trainer" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def link_bytes(run: Run) -> tuple[dict[str, int], dict[str, int]]:
    """(sent, received): the bytes each host sent onto the bridge and received from it
    (its port's counters on the switch), "door" for this process's own port."""
    fabric = run.fabric
    ports = {link["ifname"]: link for link in json.loads(_run("ip", "-j", "-s", "link", "show", ns=fabric.switch.pid))}
    sent, received = {}, {}
    names = {name: f"{host.link}e" for name, host in fabric.hosts.items()}
    names["door"] = f"{fabric._door_link}e"
    for name, port in names.items():
        stats = ports[port]["stats64"] if port in ports else {"rx": {"bytes": 0}, "tx": {"bytes": 0}}
        sent[name], received[name] = int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])
    return sent, received


def redis_commands(run: Run) -> int:
    return int(run.r.info("stats")["total_commands_processed"])


def run_one(args, fault: str | None, sources, keys, shadow: bool, tmp: Path, reference: dict | None) -> dict:
    overrides = {}
    if fault == "partition_60s":
        overrides["redis_outage_s"] = 150.0
    elif fault == "partition_10s":
        overrides["redis_outage_s"] = 60.0
    name = fault or "none"
    job = make_job(args, sources, tmp / f"run-{name}", shadow=shadow, **overrides)
    run = Run(
        args,
        job,
        tmp / f"work-{name}",
        sentinel=fault == "redis_primary_kill",
        save_every=args.save_every if fault == "node_loss" else 0,
    )
    result: dict = {}
    sampler = NodeSampler(run) if fault is None else None
    try:
        run.start()
        if sampler is not None:
            sampler.thread.start()
            links0, commands0 = link_bytes(run), redis_commands(run)
        fault_at = None
        if fault is not None:
            run.until(lambda: run.built() >= args.warm, f"step {args.warm}", 180)
            fault_at = time.time()
            result.update(INJECT[fault](run) or {})
        out = run.results(timeout=args.run_timeout)
        ended = {rank: rec["end"] for rank, rec in out.items() if rec["end"] != "stop"}
        if ended:
            result["error"] = f"ranks ended other than by the job's end: {ended}"
        lost, duplicated = ledger(out, keys)
        median, stall = gaps(out, fault_at)
        steps = 1 + max((s for rec in out.values() for s, _ in rec["steps"]), default=-1)
        result.update(lost=lost, duplicated=duplicated, median_gap_ms=round(median, 1), steps=steps)
        if fault is not None:
            result["stall_ms"] = round(stall, 1)
            result["stall_over_gap"] = round(stall / median, 2) if median > 0 else None
        first = min(t for rec in out.values() for t in rec["times"][:1])
        last = max(t for rec in out.values() for t in rec["times"][-1:])
        samples = sum(len(batch) for rec in out.values() for batch in rec["keys"])
        result["seconds"] = round(last - first, 2)
        if sampler is not None:
            sampler.stop.set()
            links1, commands1 = link_bytes(run), redis_commands(run)
            sent = {n: links1[0][n] - links0[0][n] for n in links1[0]}
            received = {n: links1[1][n] - links0[1][n] for n in links1[1]}
            nodes = set(run.job.node_ids)
            # what the nodes sent to each other: all they sent, less what the Redis hosts
            # received from them (all they received, less what this process sent them);
            # a byte between two nodes is counted once, at its sender's port
            to_redis = sum(v for n, v in received.items() if n not in nodes and n != "door") - sent["door"]
            node_sent = sum(v for n, v in sent.items() if n in nodes)
            result.update(
                samples_per_s=round(samples / (last - first), 1),
                pss_mb_per_node=sampler.pss_mb(),
                cross_node_bytes_per_step=round(max(0, node_sent - to_redis) / max(1, steps)),
                redis_ops_per_step=round((commands1 - commands0) / max(1, steps), 1),
            )
        if reference is not None:
            result["bytes_identical"] = all(
                out[rank]["digests"] == reference[rank]["digests"] for rank in out if rank in reference
            )
        result["timeline"] = timeline(out, run.marks, run.started)
        result["_out"] = out
    except Exception as exc:  # noqa: BLE001 - a fault that breaks the run is reported, not hidden
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        (tmp / f"{name}.log").write_text(run.h.log())
        result["log"] = str(tmp / f"{name}.log")
    finally:
        if sampler is not None:
            sampler.stop.set()
        run.close()
    return result


def timeline(out: dict[int, dict], marks, started: float) -> dict:
    times = sorted(t - started for rec in out.values() for t in rec["times"])
    return {"batch_times": times, "marks": [(t - started, what) for t, what in marks]}


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (make bench installs it): no PNG", file=sys.stderr)
        return
    runs = [(name, r) for name, r in results.items() if "timeline" in r]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.2 * len(runs)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs):
        times = r["timeline"]["batch_times"]
        if times:
            bins = [i * 0.5 for i in range(int(max(times) / 0.5) + 2)]
            counts = [0] * len(bins)
            for t in times:
                counts[int(t / 0.5)] += 2  # per second
            ax.plot(bins, counts, lw=1)
        for t, what in r["timeline"]["marks"]:
            ax.axvline(t, color="red", lw=0.8, ls="--")
            ax.annotate(what, (t, ax.get_ylim()[1] * 0.9), fontsize=6, rotation=0, color="red")
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("batches/s", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the trainers started", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sources", type=int, default=100)
    p.add_argument("--rows", type=int, default=48, help="rows per source")
    p.add_argument("--per-rank", type=int, default=6, help="samples per rank per step")
    p.add_argument("--sleep", type=float, default=0.05, help="each rank's training step, seconds")
    p.add_argument("--warm", type=int, default=8, help="steps built before the fault")
    p.add_argument("--down-s", type=float, default=5.0, help="how long a killed sidecar stays down")
    p.add_argument("--save-every", type=int, default=4, help="batches between two saved states (node_loss)")
    p.add_argument("--run-timeout", type=float, default=420.0)
    p.add_argument("--png", default=str(OUT / "nodes.png"))
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown fault(s) {sorted(unknown)}; choose from {','.join(FAULTS)}")
    why = unavailable()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    sources, keys = corpus_for(args.sources, args.rows)
    with tempfile.TemporaryDirectory(prefix="overlord-nodes-") as tmp:
        shadow = shadow_supported(args, sources, Path(tmp))
        results: dict = {"none": run_one(args, None, sources, keys, shadow, Path(tmp), None)}
        reference = results["none"].get("_out")
        for fault in faults:
            results[fault] = run_one(args, fault, sources, keys, shadow, Path(tmp), reference)
            print(f"{fault}: {_brief(results[fault])}", file=sys.stderr, flush=True)
        plot(results, Path(args.png))
        base = results.pop("none")
        summary = {
            "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node,
            "sources": args.sources,
            "samples": len(keys),
            "shadow": shadow,
            **{k: v for k, v in base.items() if not k.startswith("_") and k != "timeline"},
            "faults": {
                f: {k: v for k, v in r.items() if not k.startswith("_") and k != "timeline"} for f, r in results.items()
            },
            "png": args.png,
        }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


def _brief(r: dict) -> str:
    keep = ("lost", "duplicated", "stall_ms", "median_gap_ms", "bytes_identical", "error")
    return json.dumps({k: r[k] for k in keep if k in r})


if __name__ == "__main__":
    sys.exit(main())
