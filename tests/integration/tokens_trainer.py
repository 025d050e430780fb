"""A trainer rank for integration tests of token sources: records every sample it gets.

    RANK=r WORLD_SIZE=w python tokens_trainer.py CONFIG OUT

Writes OUT (JSON): for each micro-batch, the key and the token ids (without padding) of
each of its rows, and how it ended ("stop", or the error). Needs BatchSpec.packing off, so
that row i of a micro-batch is its i-th sample.
"""

import json
import sys

from overlord.torch import DataLoader


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    record = {"samples": [], "end": None}
    try:
        loader = DataLoader(config, spawn_sidecar=False)
        for batch in loader:
            ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
            for key, row, m in zip(loader.last_meta["keys"], ids, mask):
                record["samples"].append([key, row[m.astype(bool)].tolist()])
        record["end"] = "stop"
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        record["end"] = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
