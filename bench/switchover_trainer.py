"""A trainer rank for bench/remote.py's switch-over run: records when each batch
arrived and which node served it.

    RANK=r WORLD_SIZE=w python switchover_trainer.py CONFIG OUT SLEEP_S
"""

import json
import sys
import time

from overlord.torch import DataLoader


def main() -> None:
    config, out, sleep = sys.argv[1], sys.argv[2], float(sys.argv[3])
    loader = DataLoader(config, spawn_sidecar=False)
    arrivals, nodes, steps = [], [], []
    end = "stop"
    try:
        for _ in loader:
            arrivals.append(time.monotonic())
            nodes.append(loader.serving_node)
            steps.append([loader.last_meta["step"], loader.last_meta["microbatch"]])
            time.sleep(sleep)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        end = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as fh:
        json.dump(
            {
                "arrivals": arrivals,
                "nodes": nodes,
                "steps": steps,
                "end": end,
                "switches": loader.switches,
                "dropped": loader.dropped,
            },
            fh,
        )


if __name__ == "__main__":
    main()
