"""A trainer rank for the end-of-job and feedback tests: records each batch's meta.

    RANK=r WORLD_SIZE=w python meta_trainer.py CONFIG OUT [--batches N] [--sleep S]
        [--load-state FILE] [--save-state FILE] [--report-at STEP --report JSON] [--remote grpc://HOST:PORT]

Writes OUT (JSON): per batch its step, micro-batch, sample keys and `last` flag, and how
iteration ended ("stop", "limit", or the error). With --report-at it reports the
metrics JSON through DataLoader.report_metrics after the last micro-batch of that step
(the real dynamic-mixing feedback path), and records the step it reported at.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from overlord.torch import DataLoader


def start(cluster, rank: int, out: Path, **args) -> subprocess.Popen:
    """Start this script as rank `rank` of `cluster`'s job (a harness.Cluster); the test
    waits on it with a timeout and reads `out`. Keyword arguments become --flags."""
    extra = [str(x) for k, v in args.items() for x in (f"--{k.replace('_', '-')}", v)]
    proc = subprocess.Popen(
        [sys.executable, __file__, str(cluster.config), str(out), *extra],
        env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cluster.job.mesh.world_size)),
    )
    cluster.trainers[rank] = proc  # the cluster fixture kills it if the test fails
    return proc


def results(procs: dict, outs: dict, timeout: float = 150) -> dict:
    deadline = time.monotonic() + timeout
    for proc in procs.values():
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    return {rank: json.loads(Path(outs[rank]).read_text()) for rank in procs}


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    limit, sleep = int(args.get("--batches", 0)), float(args.get("--sleep", 0))
    report_at = int(args.get("--report-at", -1))
    record = {"batches": [], "end": None, "reported": None}
    try:
        loader = DataLoader(config, remote=args.get("--remote"))
        if "--load-state" in args:
            with open(args["--load-state"]) as fh:
                loader.load_state_dict(json.load(fh))
        micro_batches = loader.job.batch.micro_batches
        for _ in loader:
            meta = loader.last_meta
            record["batches"].append(
                {"step": meta["step"], "mb": meta["microbatch"], "keys": meta["keys"], "last": bool(meta.get("last"))}
            )
            if meta["step"] == report_at and meta["microbatch"] == micro_batches - 1:
                loader.report_metrics(json.loads(args["--report"]), step=report_at)
                record["reported"] = report_at
            if limit and len(record["batches"]) >= limit:
                record["end"] = "limit"
                break
            if sleep:
                time.sleep(sleep)
        else:
            record["end"] = "stop"
        if "--save-state" in args:
            with open(args["--save-state"], "w") as fh:
                json.dump(loader.state_dict(), fh)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        record["end"] = f"{type(exc).__name__}: {exc}"
    with open(out + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
