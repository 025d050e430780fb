"""A trainer rank for the trainer-edge tests: runs phases, each a new DataLoader in this
same process (the sidecar a first phase spawned keeps running), as a framework would.

    python edge_trainer.py CONFIG OUT PHASES_JSON          (RANK/LOCAL_RANK/... from the env)

Each phase: {"load": [FILE, ...] (states loaded in order: the last wins), "iter_first":
bool (iter() before loading, as Lightning does), "batches": N (0: to the end),
"save_at": {"K": FILE} (the state after K batches), "spawn": bool, "hold_s": S (sleep
after the first batch)}. OUT (JSON) has per phase: the rank, len() and `remaining`
before the first batch (or len()'s TypeError), the keys, steps and a sha256 of every
batch, the seconds to the first next(), and how it ended ("stop", "limit" or the error
class and message).
"""

import json
import os
import sys
import time

from overlord.torch import DataLoader, batch_digest


def run_phase(config: str, phase: dict) -> dict:
    rec = {"keys": [], "digests": [], "steps": [], "end": None, "len": None, "first_s": None}
    try:
        loader = DataLoader(config, spawn_sidecar=phase.get("spawn", True), timeout_s=phase.get("timeout", 30))
        rec["rank"] = loader.rank
        it = iter(loader) if phase.get("iter_first") else None
        for path in phase.get("load", []):
            with open(path) as fh:
                loader.load_state_dict(json.load(fh))
        try:
            rec["len"], rec["remaining"] = len(loader), loader.remaining
        except TypeError as exc:
            rec["len"] = f"TypeError: {exc}"
        it = iter(loader) if it is None else it
        saves = {int(k): v for k, v in phase.get("save_at", {}).items()}
        started = time.monotonic()
        for batch in it:
            if rec["first_s"] is None:
                rec["first_s"] = time.monotonic() - started
            rec["keys"].append(loader.last_meta["keys"])
            rec["steps"].append([loader.last_meta["step"], loader.last_meta["microbatch"]])
            rec["digests"].append(batch_digest(batch))
            n = len(rec["digests"])
            if n in saves:
                with open(saves[n], "w") as fh:
                    json.dump(loader.state_dict(), fh)
            if n == 1 and phase.get("hold_s"):
                time.sleep(phase["hold_s"])
            if phase.get("batches") and n >= phase["batches"]:
                rec["end"] = "limit"
                break
        else:
            rec["end"] = "stop"
            rec["stop_s"] = time.monotonic() - started
        rec["state"] = loader.state_dict()
        loader.close()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        rec["end"] = f"{type(exc).__name__}: {exc}"
    return rec


def main() -> None:
    config, out, phases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    record = {"pid": os.getpid(), "phases": []}
    for phase in phases:
        record["phases"].append(run_phase(config, phase))
        with open(out + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
