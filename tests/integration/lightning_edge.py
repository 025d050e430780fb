"""overlord.torch.DataLoader passed straight to PyTorch Lightning (one CPU process): records
the digest of every batch training_step gets; checkpoints with ModelCheckpoint.

    python lightning_edge.py CONFIG OUT CKPT_DIR MAX_STEPS EVERY [RESUME_CKPT]
"""

import hashlib
import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from overlord.torch import DataLoader


class Tiny(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        h = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()
        with open(self.out, "a") as fh:
            fh.write(json.dumps({"digest": h, "batch_idx": batch_idx, "epoch": self.current_epoch}) + "\n")
        return (self.w - batch["input_ids"].float().mean() / 1000) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def __init__(self, config: str) -> None:
        super().__init__()
        self.config = config

    def train_dataloader(self):
        return DataLoader(self.config, rank=0, world_size=1, timeout_s=30)


def main() -> None:
    config, out, ckpt_dir, max_steps, every = sys.argv[1:6]
    resume = sys.argv[6] if len(sys.argv) > 6 else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=int(max_steps),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=int(every), save_top_k=-1, filename="{step}")],
    )
    trainer.fit(Tiny(out), datamodule=Data(config), ckpt_path=resume)


if __name__ == "__main__":
    main()
