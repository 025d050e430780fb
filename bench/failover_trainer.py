"""A trainer rank for bench/failover.py: consumes batches at a steady pace and logs them.

    RANK=r WORLD_SIZE=w python bench/failover_trainer.py CONFIG OUT --sleep S [--spawn 1]
        [--save-every K] [--load-state FILE] [--batches N]

(also the trainer of bench/autoscale.py)

OUT (JSON, rewritten atomically every --save-every batches with the loader state, and
at the end) holds per batch: wall time, step, micro-batch, sample keys and a sha256 of
its bytes. After a kill -9 it holds what was consumed up to the last save: a trainer
checkpoint.
"""

import hashlib
import json
import os
import sys
import time

from overlord.torch import DataLoader


def _save(path, obj):
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    sleep, every = float(args.get("--sleep", 0)), int(args.get("--save-every", 0))
    limit = int(args.get("--batches", 0))
    record = {"time": [], "steps": [], "keys": [], "digests": [], "end": None}
    loader = DataLoader(config, spawn_sidecar=args.get("--spawn") == "1")
    if "--load-state" in args:
        with open(args["--load-state"]) as fh:
            loader.load_state_dict(json.load(fh))
    try:
        for batch in loader:
            digest = hashlib.sha256()
            for name in sorted(batch):
                digest.update(name.encode())
                digest.update(batch[name].numpy().tobytes())
            record["time"].append(time.time())
            record["steps"].append([loader.last_meta["step"], loader.last_meta["microbatch"]])
            record["keys"].append(loader.last_meta["keys"])
            record["digests"].append(digest.hexdigest())
            if every and len(record["digests"]) % every == 0:
                _save(out, {**record, "end": "checkpoint", "state": loader.state_dict()})
            time.sleep(sleep)  # the training step
            if limit and len(record["digests"]) >= limit:
                break
        record["end"] = "stop"
    except Exception as exc:  # noqa: BLE001 - the harness reports it
        record["end"] = f"{type(exc).__name__}: {exc}"
    record["state"] = loader.state_dict()
    _save(out, record)


if __name__ == "__main__":
    main()
