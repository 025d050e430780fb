"""Control-plane cost of a running job: Redis operations per step and the Planner's CPU.

Usage::

    python bench/control.py [--steps 300] [--ranks 4] [--step-ms 0]

prints ONE JSON line. It runs the demo job (`overlord demo`: three text sources and one
image-text source, `--ranks` trainer ranks of `overlord.torch.DataLoader` as separate
processes, a real sidecar with its embedded Valkey, Source Loaders, the Planner and the
Data Constructors) for `--steps` steps. Each trainer sleeps `--step-ms` per step (its
training step; 0, the default, is the demo itself: the step rate is what loading
delivers). Over a steady window, from the step a quarter of the way in to three
quarters of the way (the trainers' consumed step, the least `t<dp>` in `progress`):

- ``redis_ops_per_step``: Redis's own count (`INFO commandstats`, every command of
  every client: roles, trainers, heartbeats) over the window, divided by its steps;
  ``redis_ops_by_command`` the same per command (the few INFO/HGETALL calls this bench
  makes are subtracted); ``redis_ops_by_role`` the same split by the role whose
  connections ran them (`CLIENT LIST` tot-cmds by client name: ``planner``,
  ``loader``, ``shadow``, ``constructor``, ``sidecar``, ``trainer``; ``other`` for
  unnamed clients; the commands a script runs count, as in commandstats; a connection
  closed during the window is missed);
- ``planner_cpu_pct``: the Planner process's CPU time (user + system, /proc) over the
  window's wall time, in % of one core; ``planner_cpu_ms_per_step`` the same per step;
- ``steps_per_s``: the window's step rate;
- ``constructor_cpu_s_per_1k`` and ``loader_cpu_s_per_1k``: CPU seconds of the Data
  Constructor processes (``ovl-constructor*``) and of the Source Loader processes
  (``ovl-loader*``) per 1,000 samples delivered over the window, the cost of moving a
  sample from a loader's transform into a trainer's ring (per process: one started in
  the window counts from 0, one that exited in it is missed).

A figure from a real job on a shared machine: run it with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from overlord.demo.run import demo_job  # noqa: E402
from overlord.store import Keys, connect  # noqa: E402
from overlord.store.schema import consumed_field  # noqa: E402
from overlord.store.server import SOCKET_NAME  # noqa: E402

TIMEOUT_S = 600.0
POLL_S = 0.05  # how often this bench reads the trainers' step (its own commands are subtracted)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def role_cpu_s(prefix: str) -> dict[int, float]:
    """CPU seconds of every process whose name (/proc/PID/comm) starts with `prefix`, by pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith(prefix):
                    out[int(entry.name)] = cpu_s(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited meanwhile
    return out


def cpu_grown(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes of `after` spent since `before` (one started meanwhile
    from 0). One that exited meanwhile is missed, never subtracted: a total over the
    names alone went negative when a process of the role was gone at the end."""
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


def commandstats(r) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in r.info("commandstats").items()}


def client_cmds(r) -> dict[int, tuple[str, int]]:
    """id -> (role, commands sent) of every client connection but this bench's own."""
    me = r.client_id()
    out = {}
    for c in r.client_list():
        if int(c["id"]) != me:
            role = re.match(r"[a-z]*", c.get("name") or "").group(0) or "other"
            out[int(c["id"])] = (role, int(c.get("tot-cmds", 0)))
    return out


def consumed(r, keys, dp: int) -> int:
    """The trainers' consumed step: the least `t<dp>` - 1 (-1 before every group consumed one)."""
    progress = r.hgetall(keys.progress)
    marks = [progress.get(consumed_field(d).encode()) for d in range(dp)]
    return min((int(m) - 1 if m is not None else -1) for m in marks)


def measure(*, steps: int = 300, ranks: int = 4, step_ms: float = 0.0, out_dir: str | None = None) -> dict:
    """Run the demo job and measure its control plane (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="ovl-ctl-", dir=out_dir) as tmp:
        out = Path(tmp)
        job = demo_job(out, ranks)
        config = out / "job.json"
        config.write_text(job.to_json())
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config)],
            stdout=open(out / "sidecar.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        trainers = [
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
                    str(out / f"rank{rank}.json"),
                    "--step-ms",
                    str(step_ms),
                ],
                env=dict(env, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank)),
                stdout=subprocess.DEVNULL,
            )
            for rank in range(ranks)
        ]
        try:
            keys = Keys(job.name)
            socket = Path(job.run_dir) / SOCKET_NAME
            deadline = time.monotonic() + TIMEOUT_S
            while not socket.exists():
                if time.monotonic() > deadline or sidecar.poll() is not None:
                    raise RuntimeError(f"the sidecar's Redis never came up; see {out / 'sidecar.log'}")
                time.sleep(0.1)
            r = connect(f"unix://{socket}")
            first, last = steps // 4, (3 * steps) // 4
            snaps: list = []
            own = {"hgetall": 0, "info": 0, "get": 0, "client|list": 0, "client|id": 0}  # this bench's commands
            for target in (first, last):
                while True:
                    step = consumed(r, keys, ranks)
                    own["hgetall"] += 1
                    if step >= target:
                        break
                    if time.monotonic() > deadline or any(t.poll() not in (None, 0) for t in trainers):
                        raise RuntimeError(f"the job stopped before step {target}; see {out / 'sidecar.log'}")
                    time.sleep(POLL_S)
                pid = int(json.loads(r.get(keys.leader) or b"{}")["pid"])
                own["get"] += 1
                roles = (role_cpu_s("ovl-construct"), role_cpu_s("ovl-loader"))
                snaps.append((time.monotonic(), step, commandstats(r), cpu_s(pid), pid, roles, client_cmds(r)))
                if len(snaps) == 1:
                    # the first INFO is counted after it answers, CLIENT ID and LIST after it
                    own = {"hgetall": 0, "info": 1, "get": 0, "client|list": 1, "client|id": 1}
            for t in trainers:
                t.wait(timeout=TIMEOUT_S)
        finally:
            for t in trainers:
                if t.poll() is None:
                    t.kill()
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(timeout=60)
    (t0, s0, c0, cpu0, pid0, roles0, cl0), (t1, s1, c1, cpu1, pid1, roles1, cl1) = snaps
    if pid0 != pid1:
        raise RuntimeError("the Planner changed during the window (it restarted); run again")
    n, wall = s1 - s0, t1 - t0
    ops = {name: c1.get(name, 0) - c0.get(name, 0) - own.get(name, 0) for name in c1}
    total = sum(v for v in ops.values() if v > 0)
    by_role: dict[str, int] = {}
    for cid, (role, cmds) in cl1.items():  # a connection opened in the window counts whole
        by_role[role] = by_role.get(role, 0) + cmds - cl0.get(cid, (role, 0))[1]
    return {
        "redis_ops_per_step": round(total / n, 1),
        "redis_ops_by_command": {k: round(v / n, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v > 0},
        "redis_ops_by_role": {k: round(v / n, 2) for k, v in sorted(by_role.items(), key=lambda kv: -kv[1])},
        "planner_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1),
        "planner_cpu_ms_per_step": round(1e3 * (cpu1 - cpu0) / n, 3),
        "steps_per_s": round(n / wall, 1),
        "constructor_cpu_s_per_1k": round(1e3 * cpu_grown(roles0[0], roles1[0]) / (n * job.batch.global_batch), 3),
        "loader_cpu_s_per_1k": round(1e3 * cpu_grown(roles0[1], roles1[1]) / (n * job.batch.global_batch), 3),
        "window_steps": n,
        "ranks": ranks,
        "step_ms": step_ms,
        "sources": len(job.sources),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=0.0, help="each trainer's training step (sleep), ms")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry; the output is always one JSON line")
    args = ap.parse_args()
    print(json.dumps(measure(steps=args.steps, ranks=args.ranks, step_ms=args.step_ms)))


if __name__ == "__main__":
    main()
