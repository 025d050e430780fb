"""`overlord.lightning`: `overlord.torch.DataLoader` under PyTorch Lightning, resuming exactly.

    from overlord.lightning import OverlordDataModule

    trainer = pl.Trainer(strategy="ddp", max_steps=10_000,
                         callbacks=[ModelCheckpoint(every_n_train_steps=500, save_top_k=-1)])
    trainer.fit(model, datamodule=OverlordDataModule("job.yaml"), ckpt_path=ckpt)

What Lightning (2.x) does with a train loader, and why this module exists:

- It fetches batch i+1 before it runs the training step of batch i whenever the loader
  has no `len()` (`_PrefetchDataFetcher`, to know which batch is the last). A checkpoint
  taken then (ModelCheckpoint saves in `on_train_batch_end`) would hold a loader position
  one batch ahead of the model, and the resumed run would skip that batch. This module
  saves the position after the last batch Lightning handed to training, not the last one
  it fetched.
- It keeps the loader state of global rank 0 only (in the checkpoint file rank 0 writes)
  and loads that one state on every rank: the loader's job-wide state is what makes this
  right on rank 1, 2, ...
- It calls `iter()` on a loader that is not a `torch.utils.data.DataLoader` once to check
  that it is iterable, before it loads any state, then `iter()` again to train. The
  iterable it gets here is lazy: the DataLoader is made, given its state and iterated
  only when the first batch is asked for.
- It injects a `DistributedSampler` only into `torch.utils.data.DataLoader`s; Overlord
  already sends each rank its own micro-batches and is passed through untouched
  (`use_distributed_sampler` does not matter).

The iterable Lightning trains on has no `state_dict()` (Lightning would also save the
prefetching position, in `checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`,
and load it over ours) and no `len()` (Lightning would count the batches done before a
resume against it). The state lives in the DataModule's entry of the checkpoint
(`checkpoint["OverlordDataModule"]`, or a subclass's name).

Each batch's loader state is taken as it is yielded and kept until the training step has
it (one or two small dicts): `DataLoader.state_dict()` must stay cheap.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from overlord.config import Job
from overlord.errors import ConfigError, OverlordError
from overlord.torch import DataLoader

__all__ = ["OverlordDataModule"]

_MAX_AHEAD = 16  # batches yielded but never handed to training: not a loop this module knows


class _Batches:
    """What Lightning iterates: each `iter()` is a generator that runs nothing until the
    first batch is asked for (Lightning's check that the loader is iterable costs nothing)."""

    def __init__(self, data: OverlordDataModule) -> None:
        self._data = data

    def __iter__(self) -> Iterator[dict]:
        return self._data._yield_batches()


class OverlordDataModule(pl.LightningDataModule):
    """The train loader of a Lightning run, with its checkpoint state.

    Args:
        job: the job, or a path to its YAML/JSON config; may be set later (`self.job`),
            e.g. in `setup()`, before Lightning asks for `train_dataloader()`.
        **loader_kwargs: passed to `overlord.torch.DataLoader` (e.g. `spawn_sidecar`,
            `timeout_s`). The DataLoader is made in `train_dataloader()`, once DDP has set
            up the process group, so the rank comes from `torch.distributed`.

    `self.loader` is the DataLoader once made. A LightningModule's own
    `on_before_batch_transfer` still runs (this module calls it).
    """

    def __init__(self, job: Job | str | os.PathLike | None = None, **loader_kwargs: Any) -> None:
        super().__init__()
        self.job = job
        self.loader_kwargs = loader_kwargs
        self.loader: DataLoader | None = None
        self._pending: dict[str, Any] | None = None  # loaded before the DataLoader was made
        # the loader's state after the last batch handed to training, then after each
        # batch yielded since (Lightning's prefetched ones)
        self._states: deque[dict[str, Any]] = deque()
        self._yielded = 0

    # -- the loader ------------------------------------------------------------------

    def train_dataloader(self) -> _Batches:
        if self.loader is None:
            self.loader = self.make_loader()
            if self._pending is not None:
                self.loader.load_state_dict(self._pending)
            self._states = deque([self.loader.state_dict()])
        return _Batches(self)

    def make_loader(self) -> DataLoader:
        """The DataLoader of this run (override to build it another way)."""
        if self.job is None:
            raise ConfigError("OverlordDataModule has no job: pass one, or set `self.job` in setup()")
        return DataLoader(self.job, **self.loader_kwargs)

    def _yield_batches(self) -> Iterator[dict]:
        if self.loader is None:
            raise OverlordError("OverlordDataModule: iterated before train_dataloader() made the DataLoader")
        for batch in self.loader:
            self._yielded += 1
            self._states.append(self.loader.state_dict())
            if len(self._states) > _MAX_AHEAD:
                raise OverlordError(
                    f"OverlordDataModule: {len(self._states) - 1} batches were fetched and none reached "
                    "on_before_batch_transfer, so a checkpoint cannot tell which ones the model saw; "
                    "a training_step(dataloader_iter) fetches batches itself and is not supported"
                )
            yield batch

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The training step is about to take this batch: it counts as consumed."""
        trainer = self.trainer
        if trainer is not None and trainer.training and len(self._states) > 1:
            self._states.popleft()
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def teardown(self, stage: str) -> None:
        """Detach from the ring; a later `fit()` makes a new DataLoader that continues here."""
        if self.loader is not None:
            self._pending = self.state_dict().get("loader")
            self.loader.close()
            self.loader, self._states, self._yielded = None, deque(), 0

    # -- checkpoint ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's position after the last batch Lightning handed to training.

        Called on every rank; Lightning keeps rank 0's, which every rank can load."""
        if self._states:
            return {"loader": self._states[0]}
        return {"loader": self._pending} if self._pending is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the batch after the saved one (Lightning calls this before it asks
        for `train_dataloader()`; a loader that exists and has not yielded yet takes it
        at once)."""
        state = state_dict.get("loader")
        if state is None:
            return
        if self.loader is not None:
            if self._yielded:
                raise OverlordError("OverlordDataModule.load_state_dict() after training began: restart the run")
            self.loader.load_state_dict(state)
            self._states = deque([self.loader.state_dict()])
        self._pending = state
