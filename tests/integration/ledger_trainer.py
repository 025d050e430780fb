"""A trainer rank for integration tests: records every batch it receives.

    RANK=r WORLD_SIZE=w python ledger_trainer.py CONFIG OUT [--batches N] [--sleep S] [--timeout T]
        [--pause-at K --pause S] [--save-state FILE] [--load-state FILE] [--save-every K] [--spawn 1] [--remote grpc://HOST:PORT]

Writes OUT (JSON): the sample keys of every batch in order, a sha256 of each batch's
bytes (tensor names, dtypes, shapes and data), and how it ended ("stop", "limit" or
the error class and message), whether it loaded redis-py, and when each batch arrived ("times", seconds since the
epoch: one clock for every rank of a machine, so a test or bench sees a fault's stall
against the median gap between batches). With --save-every K it also saves the loader state to
OUT (with the loader state under "state") every K batches, atomically, as a trainer's
checkpoint: after a kill -9 it holds what was consumed up to the last checkpoint.
With --spawn 1 the loader starts (and after a kill -9, restarts) the sidecar itself.
"""

import json
import os
import sys
import time

from overlord.torch import DataLoader, batch_digest


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    limit = int(args.get("--batches", 0))
    sleep = float(args.get("--sleep", 0))
    timeout = float(args["--timeout"]) if "--timeout" in args else None
    pause_at, pause_s = int(args.get("--pause-at", -1)), float(args.get("--pause", 0))
    every = int(args.get("--save-every", 0))
    record = {"keys": [], "digests": [], "steps": [], "times": [], "end": None}
    try:
        loader = DataLoader(
            config, spawn_sidecar=args.get("--spawn") == "1", timeout_s=timeout, remote=args.get("--remote")
        )
        if "--load-state" in args:
            with open(args["--load-state"]) as fh:
                loader.load_state_dict(json.load(fh))
        for batch in loader:
            record["times"].append(time.time())
            record["keys"].append(loader.last_meta["keys"])
            record["steps"].append([loader.last_meta["step"], loader.last_meta["microbatch"]])
            record["digests"].append(batch_digest(batch))
            if every and len(record["digests"]) % every == 0:
                # one file, one rename: the ledger and the state it belongs to agree
                _save(out, {**record, "end": "checkpoint", "state": loader.state_dict()})
            if limit and len(record["digests"]) >= limit:
                record["end"] = "limit"
                break
            if sleep:
                time.sleep(sleep)
            if len(record["digests"]) == pause_at:
                time.sleep(pause_s)  # e.g. a long checkpoint save on this rank
        else:
            record["end"] = "stop"
        if "--save-state" in args:
            with open(args["--save-state"], "w") as fh:
                json.dump(loader.state_dict(), fh)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        record["end"] = f"{type(exc).__name__}: {exc}"
    record["dropped"] = getattr(locals().get("loader"), "dropped", 0)
    record["recoveries"] = getattr(locals().get("loader"), "recoveries", 0)
    record["switches"] = getattr(locals().get("loader"), "switches", 0)
    record["redis_loaded"] = "redis" in sys.modules  # a rank on one node leaves its totals in its ring
    _save(out, record)


def _save(path: str, obj) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
