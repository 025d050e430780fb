"""Trainer processes of bench/peers.py: one rank of one loader, spawned by the harness.

``python bench/peers_trainers.py --trainer <json>`` builds the loader the JSON names and
runs the harness protocol (bench/loadkit.py): it prints ``first`` at its first batch,
``warm`` after ``warm`` samples, waits for ``go``, consumes ``samples`` samples and prints
``done`` with the window's monotonic start and end, then waits for ``stop``.

Every rank joins a gloo process group first, as a torchrun job does (LitData reads its
rank and world size from torch.distributed; MosaicML Streaming from RANK/WORLD_SIZE).

The loaders, each as its documentation sets it up, all with `peers_data.Sample`:
- ``colocated``: ``torch.utils.data.DataLoader`` over bench/loadkit.py's one dataset of
  every source per rank (each worker opens every Parquet file, per-source shuffle buffer).
- ``mosaic``: ``streaming.StreamingDataset`` with one ``Stream`` per source (local MDS
  directories), ``shuffle=True``, ``batch_size`` given; a ``torch.utils.data.DataLoader``.
- ``litdata``: one ``litdata.StreamingDataset(shuffle=True, transform=...)`` per source
  in a ``CombinedStreamingDataset``; a ``litdata.StreamingDataLoader``.
- ``overlord``: ``overlord.torch.DataLoader`` reading the node's sidecar.

Shuffling is the one setting changed from a default (MosaicML's and LitData's is off):
training shuffles, and so do the colocated dataset and Overlord.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a script in a checkout: import the checkout's package

from loadkit import colocated_dataset, command, emit, pad_collate  # noqa: E402

if TYPE_CHECKING:
    import peers_data

# bench/peers_data.py (the corpus, its tokenizer and the transform, with pyarrow, PIL and
# tokenizers behind them) is imported by the loaders that run the transform in the
# trainer's process tree, not by Overlord's trainer: its Source Loaders run the transform
# in the sidecar, and a training script that uses overlord.torch does not import it
# either. Imported at the top, it cost each Overlord trainer about 7 MiB of private
# memory and its share of those libraries' pages: memory the job did not need.


def _data():
    import peers_data

    return peers_data


class _ByKind:
    """The source's `peers_data.Sample`, told by the row's columns (for datasets that mix sources)."""

    def __init__(self, text, image):
        self.text, self.image = text, image

    def __call__(self, row: dict) -> dict:
        return (self.image if "image" in row else self.text)(row)


def _samples(cfg: dict) -> dict[str, peers_data.Sample]:
    """``{"text": Sample, "image_text": Sample}`` over the corpus's tokenizer."""
    peers_data = _data()
    tok = Path(cfg["corpus"]) / "tokenizer" / "tokenizer.json"
    return {
        kind: peers_data.Sample(
            **peers_data.sample_args(
                {"kind": kind}, tok, context_length=cfg["context_length"], image_side=cfg["image_side"]
            )
        )
        for kind in ("text", "image_text")
    }


def _torch_loader_kwargs(cfg: dict) -> dict:
    return dict(batch_size=cfg["batch_size"], num_workers=cfg["workers"], collate_fn=pad_collate)


def _colocated(cfg: dict):
    # deferred: a trainer imports torch only for the loader it runs
    import torch.utils.data as tud

    samples = _samples(cfg)
    sources = _data().sources_of(Path(cfg["corpus"]))
    dataset = colocated_dataset(
        [s["files"] for s in sources],
        [samples[s["kind"]] for s in sources],
        rank=cfg["rank"],
        ranks=cfg["ranks"],
        window=cfg["shuffle_window"],
        seed=cfg["seed"],
    )
    loader = tud.DataLoader(dataset, **_torch_loader_kwargs(cfg), timeout=cfg["timeout_s"])
    return _forever(loader), lambda batch: len(batch["lengths"]), None


def _mosaic(cfg: dict):
    peers_data = _data()
    peers_data.torchvision_without_ops()
    # deferred: mosaicml-streaming is a bench extra
    import torch.utils.data as tud
    from streaming import Stream, StreamingDataset

    samples = _samples(cfg)
    transform = _ByKind(samples["text"], samples["image_text"])

    class Dataset(StreamingDataset):  # MosaicML's documented way to transform samples
        def __getitem__(self, idx):
            return transform(super().__getitem__(idx))

    root = Path(cfg["corpus"]) / "mds"
    streams = [Stream(local=str(root / s["name"])) for s in peers_data.sources_of(Path(cfg["corpus"]))]
    dataset = Dataset(streams=streams, shuffle=True, batch_size=cfg["batch_size"], shuffle_seed=cfg["seed"])
    loader = tud.DataLoader(dataset, **_torch_loader_kwargs(cfg), timeout=cfg["timeout_s"])
    return _forever(loader), lambda batch: len(batch["lengths"]), None


def _litdata(cfg: dict):
    # deferred: litdata is a bench extra
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

    samples = _samples(cfg)
    root = Path(cfg["corpus"]) / "litdata"
    datasets = [
        StreamingDataset(input_dir=str(root / s["name"]), shuffle=True, seed=cfg["seed"], transform=samples[s["kind"]])
        for s in _data().sources_of(Path(cfg["corpus"]))
    ]
    loader = StreamingDataLoader(
        CombinedStreamingDataset(datasets, seed=cfg["seed"]), **_torch_loader_kwargs(cfg), timeout=cfg["timeout_s"]
    )
    return _forever(loader), lambda batch: len(batch["lengths"]), None


def _overlord(cfg: dict):
    # deferred: a trainer imports torch only for the loader it runs
    from overlord.torch import DataLoader

    loader = DataLoader(cfg["config"], rank=cfg["rank"], world_size=cfg["ranks"], spawn_sidecar=False)
    return iter(loader), lambda batch: len(loader.last_meta["keys"]), loader.close


def _forever(loader):
    """Epoch after epoch, as a training loop iterates (a peer's iterator ends each epoch)."""
    while True:
        yield from loader


LOADERS = {"colocated": _colocated, "mosaic": _mosaic, "litdata": _litdata, "overlord": _overlord}


def _join_process_group(cfg: dict) -> None:
    """A gloo process group over the ranks, from the torchrun variables the harness set."""
    # deferred: the trainer's first torch import, timed as part of its start
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))


def main(cfg: dict) -> None:
    """Runs one rank of ``cfg["loader"]`` through the harness protocol."""
    import warnings

    # More workers than cores is the point of the benchmark, not a mistake to warn about.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    deadline = time.monotonic() + cfg["timeout_s"]
    _join_process_group(cfg)
    batches, count, close = LOADERS[cfg["loader"]](cfg)
    n = count(next(batches))
    emit("first", t=time.monotonic())
    while n < cfg["warm"]:
        n += count(next(batches))
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {cfg['rank']} did not warm up in {cfg['timeout_s']} s")
    emit("warm", samples=n)
    if command(deadline - time.monotonic()) != "go":
        raise SystemExit("expected 'go'")
    n, images, t0 = 0, 0, time.monotonic()
    while n < cfg["samples"]:
        batch = next(batches)
        n += count(batch)
        images += len(batch["image_grid"]) if "image_grid" in batch else 0  # one row per image, every loader
    emit("done", samples=n, images=images, t0=t0, t1=time.monotonic())
    command(deadline - time.monotonic())  # "stop": stay alive (workers too) until measured
    if close:
        close()
    os._exit(0)  # the peers' workers and threads are torn down with the process group


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--trainer":
        raise SystemExit("usage: peers_trainers.py --trainer <json> (spawned by bench/peers.py)")
    main(json.loads(sys.argv[2]))
