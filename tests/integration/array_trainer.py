"""A trainer rank that saves the arrays of its first N micro-batches (for mesh tests).

    RANK=r WORLD_SIZE=w python array_trainer.py CONFIG OUTDIR N
Writes OUTDIR/rank<r>-<i>.npz (plain numeric arrays) and OUTDIR/rank<r>.json (metas).
"""

import json
import sys

import numpy as np

from overlord.torch import DataLoader


def main() -> None:
    config, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    loader = DataLoader(config, spawn_sidecar=False, timeout_s=60)
    metas = []
    for i, batch in enumerate(loader):
        np.savez(f"{out}/rank{loader.rank}-{i}.npz", **{k: v.numpy() for k, v in batch.items()})
        metas.append(loader.last_meta)
        if i + 1 >= n:
            break
    loader.close()
    with open(f"{out}/rank{loader.rank}.json", "w") as fh:
        json.dump(metas, fh)


if __name__ == "__main__":
    main()
