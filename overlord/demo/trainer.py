"""A demo trainer rank: consumes batches through `overlord.torch.DataLoader`.

    RANK=0 WORLD_SIZE=4 python -m overlord.demo.trainer --config job.json --steps 50 --out r0.json [--step-ms 0]

It does no model work (the demo measures the loader), counts samples, tokens and
sources from each batch, and writes a JSON summary. Every 8 batches it rewrites
`<out>.progress` with its batch count, which the demo's progress bar reads.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from overlord.plan.cost import transformer_cost
from overlord.torch import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step-ms", type=float, default=0.0, help="sleep per step, as a training step would take")
    args = parser.parse_args()
    started = time.monotonic()
    loader = DataLoader(args.config, spawn_sidecar=False)
    want = args.steps * loader.job.batch.micro_batches
    progress = Path(args.out + ".progress")
    sources: collections.Counter[str] = collections.Counter()
    step_cost: collections.defaultdict[int, float] = collections.defaultdict(float)  # attention-model cost per step
    samples = tokens = batches = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.monotonic() - started
            first_at = time.time()
        keys = loader.last_meta["keys"]
        samples += len(keys)
        tokens += int(batch["doc_lengths"].sum())
        step_cost[loader.last_meta["step"]] += float(transformer_cost(batch["doc_lengths"].numpy()).sum())
        sources.update(k.split(":", 1)[0] for k in keys)
        batches += 1
        if args.step_ms and loader.last_meta["microbatch"] == loader.job.batch.micro_batches - 1:
            time.sleep(args.step_ms / 1e3)  # the training step
        if batches % 8 == 0:
            progress.write_text(str(batches))
        if batches >= want:
            break
    elapsed = time.monotonic() - started
    loader.close()
    progress.write_text(str(batches))
    Path(args.out).write_text(
        json.dumps(
            {
                "rank": loader.rank,
                "batches": batches,
                "samples": samples,
                "tokens": tokens,
                "sources": dict(sources),
                "step_cost": {str(k): v for k, v in step_cost.items()},
                "time_to_first_batch_s": first,
                "first_batch_at": first_at,
                "elapsed_s": elapsed,
                "steady_s": elapsed - (first or 0.0),
            }
        )
    )


if __name__ == "__main__":
    main()
