"""Train the tiny GPT with PyTorch Lightning on Overlord: checkpoint mid-epoch with
`ModelCheckpoint`, stop, resume with `trainer.fit(..., ckpt_path=...)`, and read exactly
the batches of an uninterrupted run.

    # two ranks on CPU (gloo); Lightning's own launcher starts rank 1:
    python examples/lightning_train.py --steps 8
    # preempted after 5 steps (the last checkpoint is at step 3) ...
    python examples/lightning_train.py --steps 8 --out demo-data/lightning-b --stop-after 5 --ckpt-every 3
    # ... and resumed from it: steps 3..7 read the bytes of the uninterrupted run
    python examples/lightning_train.py --steps 8 --out demo-data/lightning-b --ckpt-every 3 --resume
    # or under torchrun (Lightning then starts no process itself)
    torchrun --standalone --nproc_per_node 2 examples/lightning_train.py --steps 8

The loader goes in through `overlord.lightning.OverlordDataModule`: it makes the
DataLoader once DDP is up, and saves in the checkpoint the position of the last batch
Lightning handed to `training_step`, not of the one it had already fetched. A Lightning
step is one micro-batch here (`--accumulate` sets accumulate_grad_batches), so a
checkpoint every 3 steps lands inside the loader's 2-micro-batch steps.

`--plain` hands Lightning the `overlord.torch.DataLoader` itself instead: Lightning then
saves its state (rank 0's) in `loops.fit_loop.state_dict.combined_loader`, calls `iter()`
on it before `load_state_dict()`, and prefetches a batch unless it has a `len()` (a
finite job, `--epochs 1`; `--steps 0` trains to its end).

`--record` writes one JSON line per batch and rank: a digest of the batch that
training_step got, its loss, and whether its bytes are still those it had when the
loader yielded it (Lightning fetches the next batch before it trains on this one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import deque
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import demo_job, start_sidecar, stop_sidecar
from lightning.pytorch.callbacks import ModelCheckpoint
from train_gpt import CONTEXT, GPT, WEIGHTS

from overlord.lightning import OverlordDataModule
from overlord.torch import DataLoader, batch_digest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=Path("demo-data/lightning"), help="checkpoints, job config, run directory"
    )
    p.add_argument("--data", type=Path, default=Path("demo-data/corpus"), help="demo corpus (made if missing)")
    p.add_argument(
        "--steps",
        type=int,
        default=8,
        help="train until this many Lightning steps are done (0: to the end of a finite job)",
    )
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint(every_n_train_steps=...); 0: none")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many steps, as if preempted")
    p.add_argument("--resume", action="store_true", help="fit from the latest checkpoint in <out>/checkpoints")
    p.add_argument("--record", type=Path, help="append one JSON line per batch to RECORD.rank<r>.jsonl")
    p.add_argument("--devices", type=int, default=2, help="ranks (under torchrun: --nproc_per_node)")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--ring-kib", type=int, default=256, help="each rank's ring; small keeps few batches leasable")
    p.add_argument("--epochs", type=int, help="Job.epochs: a finite job (default: forever)")
    p.add_argument("--sources", default=",".join(WEIGHTS), help="the demo's text sources to read, comma-separated")
    p.add_argument(
        "--plain",
        action="store_true",
        help="hand Lightning the overlord.torch.DataLoader itself, not through OverlordDataModule",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--job-name", help="Overlord job name (default: derived from --out)")
    return p.parse_args()


class Receipts:
    """Digests each batch as the loader yields it, for the training step to compare."""

    def __init__(self, batches) -> None:
        self.batches = batches
        self.digests: deque[str] = deque()

    def __iter__(self):
        for batch in self.batches:
            self.digests.append(batch_digest(batch))
            yield batch


class DemoData(OverlordDataModule):
    """The demo job; local rank 0 starts the node's sidecar (with --resume when resuming)
    and stops it after training."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(spawn_sidecar=False)
        self.args = args
        self.sidecar = None
        self.receipts: Receipts | None = None

    def setup(self, stage: str) -> None:
        # DDP is up: demo_job and start_sidecar synchronise the ranks with barriers
        weights = {name: WEIGHTS[name] for name in self.args.sources.split(",")}
        job = demo_job(
            self.args,
            "lightning",
            weights,
            self.trainer.world_size,
            global_batch=128 * self.trainer.world_size,
            micro_batches=2,
            context_length=CONTEXT,
        )
        self.job = dataclasses.replace(
            job, epochs=self.args.epochs, batch=dataclasses.replace(job.batch, ring_bytes=self.args.ring_kib << 10)
        )
        self.sidecar = start_sidecar(self.job, self.args.out, self.args.resume)

    def train_dataloader(self):
        if self.args.plain:
            # Lightning saves and loads this loader's state itself (loops.fit_loop.combined_loader),
            # calls iter() on it before load_state_dict(), and prefetches a batch unless len() works
            self.plain = DataLoader(self.job, spawn_sidecar=False)
            return self.plain
        self.receipts = Receipts(super().train_dataloader())
        return self.receipts

    def teardown(self, stage: str) -> None:
        super().teardown(stage)  # every rank detaches from its ring first
        if self.args.plain:
            self.plain.close()
        dist.barrier()
        stop_sidecar(self.sidecar, self.job)


class LitGPT(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        torch.manual_seed(0)
        self.model = GPT()
        self.record = None
        self.changed = 0

    def on_train_start(self) -> None:
        if self.args.record:
            self.record = open(f"{self.args.record}.rank{self.global_rank}.jsonl", "a")  # a resumed run appends

    def on_train_epoch_start(self) -> None:
        if self.global_rank == 0:
            print(f"batches in this epoch: {self.trainer.num_training_batches}", flush=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.got = batch_digest(batch)  # Lightning has fetched the next batch by now
        logits = self.model(batch["input_ids"], batch["position_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.loss = loss.item()
        return loss

    def on_train_batch_end(self, outputs, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # after the forward, backward and optimizer step: the batch still holds its bytes
        receipts = self.trainer.datamodule.receipts
        receipt = receipts.digests.popleft() if receipts else self.got  # --plain: no receipts
        intact = receipt == self.got == batch_digest(batch)
        self.changed += not intact
        if self.record:
            self.record.write(
                json.dumps(
                    {
                        "batch": batch_idx,
                        "digest": self.got,
                        "loss": self.loss,
                        "bytes": sum(t.nbytes for t in batch.values()),
                        "intact": intact,
                    }
                )
                + "\n"
            )
            self.record.flush()

    def on_train_end(self) -> None:
        data = self.trainer.datamodule
        loader = data.plain if self.args.plain else data.loader
        print(
            f"rank {self.global_rank}: {self.changed} batches changed after the loader yielded them, "
            f"{loader.copies} copied out of the ring (held beyond what it leases)",
            flush=True,
        )

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    return found[-1] if found else None


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # one per rank: the same count every run keeps CPU kernels deterministic
    ckpt_dir = args.out / "checkpoints"
    ckpt_path = latest_checkpoint(ckpt_dir) if args.resume else None
    args.resume = ckpt_path is not None
    callbacks = []
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        num_nodes=1,
        max_steps=args.stop_after or args.steps or -1,
        max_epochs=1,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    if trainer.global_rank == 0:
        print(
            f"ranks {trainer.world_size}, steps {args.steps}"
            + (f", resuming from {ckpt_path.name}" if ckpt_path else ""),
            flush=True,
        )
    trainer.fit(LitGPT(args), datamodule=DemoData(args), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        print(f"done: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
