"""Train the tiny GPT with Hugging Face Accelerate on Overlord: checkpoint mid-epoch with
`accelerator.save_state()`, stop, resume with `accelerator.load_state()`, and read
exactly the batches of an uninterrupted run.

    # two ranks on CPU (gloo) or one GPU per rank:
    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py --steps 8
    # preempted after 5 steps (the last checkpoint is at step 3) ...
    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py --steps 8 \\
        --out demo-data/accelerate-b --stop-after 5 --ckpt-every 3
    # ... and resumed from it: steps 3..7 read the bytes of the uninterrupted run
    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py --steps 8 \\
        --out demo-data/accelerate-b --ckpt-every 3 --resume

`accelerate launch --multi_gpu --num_processes 2` starts the same processes through
torchrun. On a machine without GPUs the script asks for `Accelerator(cpu=True)`: without
it Accelerate runs every process as a single-process job.

What Accelerate does with the loader: `prepare()` re-creates only
`torch.utils.data.DataLoader`s (a sampler or dispatcher per rank); an Overlord DataLoader
is not one, so it comes back untouched and Accelerate neither shards nor moves its
batches (`.to(accelerator.device)` below). Overlord already sends each rank its own
micro-batches. `save_state()` saves no loader state of its own for it:
`register_for_checkpointing(loader)` does, from rank 0 only (`custom_checkpoint_0.pkl`),
and `load_state()` loads that file on every rank; it is called before the first batch.
A training step here is one micro-batch, so a checkpoint every 3 steps lands inside the
loader's 2-micro-batch steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import demo_job, start_sidecar, stop_sidecar
from train_gpt import CONTEXT, GPT, WEIGHTS

from overlord.torch import DataLoader, batch_digest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=Path("demo-data/accelerate"), help="checkpoint, job config, run directory"
    )
    p.add_argument("--data", type=Path, default=Path("demo-data/corpus"), help="demo corpus (made if missing)")
    p.add_argument("--steps", type=int, default=8, help="train until this many steps are done")
    p.add_argument("--ckpt-every", type=int, default=0, help="save_state every this many steps (0: never)")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many steps, as if preempted")
    p.add_argument("--resume", action="store_true", help="load_state from <out>/checkpoint if there is one")
    p.add_argument("--record", type=Path, help="append one JSON line per batch to RECORD.rank<r>.jsonl")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--job-name", help="Overlord job name (default: derived from --out)")
    return p.parse_args()


class Progress:
    """The steps done, saved and loaded with the rest (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.set_num_threads(1)  # one per rank: the same count every run keeps CPU kernels deterministic
    world, rank = accelerator.num_processes, accelerator.process_index
    ckpt_dir = args.out / "checkpoint"
    resume = args.resume and ckpt_dir.exists()

    job = demo_job(args, "accelerate", WEIGHTS, world, global_batch=32 * world, micro_batches=2, context_length=CONTEXT)
    sidecar = start_sidecar(job, args.out, resume)  # local rank 0 starts it, with --resume when resuming
    try:
        torch.manual_seed(0)
        model = GPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        loader = DataLoader(job, spawn_sidecar=False)
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
        if prepared is not loader:
            raise RuntimeError(f"accelerator.prepare() replaced the Overlord DataLoader with {type(prepared)}")
        progress = Progress()
        accelerator.register_for_checkpointing(loader, progress)
        if resume:
            accelerator.load_state(str(ckpt_dir))  # every rank loads rank 0's loader state
        if rank == 0:
            print(
                f"job {job.name}: {world} ranks, steps {progress.step}..{args.steps - 1}"
                + (" (resumed)" if resume else ""),
                flush=True,
            )
        record = open(f"{args.record}.rank{rank}.jsonl", "a") if args.record else None  # a resumed run appends
        batches = iter(loader)
        for step in range(progress.step, args.steps):
            batch = next(batches)
            got = batch_digest(batch)
            b = {k: v.to(accelerator.device) for k, v in batch.items()}
            logits = model(b["input_ids"], b["position_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if record:
                record.write(
                    json.dumps({"step": step, "digest": got, "loss": loss.item(), "intact": got == batch_digest(batch)})
                    + "\n"
                )
                record.flush()
            progress.step = done = step + 1
            if args.ckpt_every and done % args.ckpt_every == 0:
                accelerator.save_state(str(ckpt_dir))
            if done == args.stop_after:
                if rank == 0:
                    print(f"stopping after step {done}, as if preempted", flush=True)
                break
        loader.close()
        accelerator.wait_for_everyone()
    finally:
        stop_sidecar(sidecar, job)
        accelerator.end_training()


if __name__ == "__main__":
    main()
