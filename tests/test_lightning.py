"""overlord.lightning.OverlordDataModule under a real Lightning Trainer (one CPU process),
over a stand-in loader that counts batches: the checkpoint holds the position of the
last batch Lightning handed to training_step, not of the one it had prefetched, and a
resume loads it before the first iter() and trains on the next batch.
(tests/examples/test_frameworks.py runs it with two ranks and a real sidecar.)"""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is a test extra: pip install -e '.[test]'")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from overlord.lightning import OverlordDataModule  # noqa: E402


class CountingLoader:
    """Yields {"i": tensor([i])} for i = start, start+1, ...; its state is how many it
    yielded. Records the calls Lightning's run made, in order."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.next_i = 0

    def __iter__(self):
        self.calls.append("iter")
        return self

    def __next__(self):
        self.calls.append(("next", self.next_i))
        self.next_i += 1
        return {"i": torch.tensor([float(self.next_i - 1)])}

    def state_dict(self) -> dict:
        return {"batches": self.next_i}

    def load_state_dict(self, state: dict) -> None:
        self.calls.append(("load", state["batches"]))
        self.next_i = state["batches"]

    def close(self) -> None:
        self.calls.append("close")


class Data(OverlordDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def make_loader(self):
        return CountingLoader(self.calls)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.trained: list[int] = []
        self.before_transfer = 0

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.before_transfer += 1  # the DataModule's hook wins in Lightning; ours still runs
        return batch

    def training_step(self, batch, batch_idx):
        self.trained.append(int(batch["i"]))
        return ((self.w - batch["i"]) ** 2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, max_steps: int, ckpt_path=None) -> tuple[Model, Data]:
    model, data = Model(), Data()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model, data


@pytest.mark.timeout(120)
def test_checkpoint_holds_the_trained_position_and_a_resume_continues_after_it(tmp_path):
    model, data = fit(tmp_path, max_steps=5)
    assert model.trained == [0, 1, 2, 3, 4]
    assert model.before_transfer == 5
    # Lightning prefetched: batch 5 was fetched while batch 4 trained, and batch 3 while 2 did
    assert ("next", 5) in data.calls
    ckpt = torch.load(tmp_path / "step=3.ckpt", weights_only=False)
    assert ckpt["Data"] == {"loader": {"batches": 3}}
    assert "combined_loader" not in ckpt["loops"]["fit_loop"]["state_dict"]  # the iterable has no state_dict

    model, data = fit(tmp_path, max_steps=8, ckpt_path=tmp_path / "step=3.ckpt")
    assert model.trained == [3, 4, 5, 6, 7]
    # the state is loaded before the loader is first iterated (Lightning's iterable check iterated nothing)
    assert data.calls[:2] == [("load", 3), "iter"] and data.calls[-1] == "close"
