"""A trainer rank for integration tests: records every batch it receives.

    RANK=r WORLD_SIZE=w python ledger_trainer.py CONFIG OUT [--batches N] [--sleep S] [--timeout T]
        [--pause-at K --pause S] [--save-state FILE] [--load-state FILE]

Writes OUT (JSON): the sample keys of every batch in order, a sha256 of each batch's
bytes (tensor names, dtypes, shapes and data), and how it ended ("stop", "limit" or
the error class and message).
"""

import hashlib
import json
import sys
import time

from overlord.torch import DataLoader


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    limit = int(args.get("--batches", 0))
    sleep = float(args.get("--sleep", 0))
    timeout = float(args["--timeout"]) if "--timeout" in args else None
    pause_at, pause_s = int(args.get("--pause-at", -1)), float(args.get("--pause", 0))
    record = {"keys": [], "digests": [], "steps": [], "end": None}
    try:
        loader = DataLoader(config, spawn_sidecar=False, timeout_s=timeout)
        if "--load-state" in args:
            with open(args["--load-state"]) as fh:
                loader.load_state_dict(json.load(fh))
        for batch in loader:
            digest = hashlib.sha256()
            for name in sorted(batch):
                t = batch[name]
                digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                digest.update(t.numpy().tobytes())
            record["keys"].append(loader.last_meta["keys"])
            record["steps"].append([loader.last_meta["step"], loader.last_meta["microbatch"]])
            record["digests"].append(digest.hexdigest())
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
    with open(out, "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
