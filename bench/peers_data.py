"""The corpus, tokenizer and sample transform that bench/peers.py gives every loader.

- `corpus`: N Parquet sources (one file each, 256-row groups) written by
  `overlord.demo.corpus.generate_corpus`: 20% image-text sources with real JPEGs (Pillow,
  sides 32..256 px), the rest text with long-tailed lengths (lognormal body, Pareto tail
  up to 4,096 words). Cached by its parameters: ``<root>/s{N}-r{rows}-g{group}-seed{seed}``.
- `tokenizer`: a byte-level BPE trained with Hugging Face ``tokenizers`` on the corpus's
  texts and captions (no Hub here), saved beside the corpus with a
  ``tokenizer_config.json`` naming ``<s>``/``</s>``; every loader loads this one file.
- `Sample`: the one transform all four loaders apply: the text (or caption) through
  `overlord.transforms_hf.Tokenize` (BOS, ids, EOS, at most ``context_length``), and for
  image-text rows the JPEG decoded, resized to a fixed ``image_side`` square and cut into
  16x16 patches (``pixel_values`` uint8 [patches, 768], ``image_grid`` [[h, w]]).
- `mds_shards` and `litdata_chunks`: the same sources converted for MosaicML Streaming
  (``MDSWriter``) and LitData (``litdata.optimize``), one dataset directory per source,
  cached beside the corpus.

Every cached artifact is written under a temporary name and renamed (or marked done)
last, so an interrupted run never leaves a half artifact that a later run trusts.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from overlord.demo.corpus import generate_corpus, read_manifest
from overlord.transforms_hf import Tokenize

PATCH = 16
ROW_GROUP = 256
IMAGE_SHARE = 0.2
VOCAB = 8192
TOKENIZER_SOURCES = 40  # sources whose texts train the tokenizer (enough for its merges)


def corpus(root: Path, sources: int, rows: int, *, seed: int = 0, max_image_side: int = 256) -> Path:
    """Generates (or reuses) the bench corpus; returns its directory.

    Args:
        root: Directory holding corpora (``--corpus``).
        sources: Sources in all; ``round(0.2 * sources)`` (at least 1 of 2+) are image-text.
        rows: Rows per source.
        seed: Corpus seed.
        max_image_side: Largest image side in pixels.
    """
    images = max(1, round(IMAGE_SHARE * sources)) if sources > 1 else 0
    out = root / f"s{sources}-r{rows}-g{ROW_GROUP}-seed{seed}"
    generate_corpus(
        out,
        seed=seed,
        text_sources=sources - images,
        image_sources=images,
        rows_per_source=rows,
        files_per_source=1,
        row_group_size=ROW_GROUP,
        max_image_side=max_image_side,
    )
    return out


def sources_of(root: Path) -> list[dict]:
    """``[{"name", "kind" ("text"/"image_text"), "files"}]`` of a corpus, in source order."""
    manifest = read_manifest(root)
    if manifest is None:
        raise FileNotFoundError(f"{root} has no corpus manifest; generate it with corpus()")
    return [
        {"name": name, "kind": entry["kind"], "files": [str(root / rel) for rel in entry["files"]]}
        for name, entry in manifest["sources"].items()
    ]


def text_column(kind: str) -> str:
    """The column a source's rows are tokenized from."""
    return "caption" if kind == "image_text" else "text"


def tokenizer(root: Path) -> Path:
    """Trains (or reuses) the corpus's BPE tokenizer; returns its ``tokenizer.json``."""
    # deferred: tokenizers is the hf extra; only the bench needs its trainer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = root / "tokenizer"
    path = out / "tokenizer.json"
    if path.is_file():
        return path
    srcs = sources_of(root)
    step = max(1, len(srcs) // TOKENIZER_SOURCES)

    def texts():
        for src in srcs[::step]:
            column = text_column(src["kind"])
            for f in src["files"]:
                yield from pq.read_table(f, columns=[column]).column(column).to_pylist()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    tmp = root / f"tokenizer.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return path


class Sample:
    """The transform every loader applies; see the module docstring.

    Args:
        tokenizer: The corpus's ``tokenizer.json``.
        column: The text column (``text``, or ``caption`` for image-text rows).
        image_side: Side of the square every image is resized to (a multiple of 16);
            None: a text source.
        context_length: Most token ids per sample, BOS and EOS included.
    """

    def __init__(self, *, tokenizer: str, column: str = "text", image_side: int | None = None, context_length: int):
        if image_side is not None and (image_side < PATCH or image_side % PATCH):
            raise ValueError(f"image_side={image_side} must be a positive multiple of {PATCH}")
        self.tokenize = Tokenize(tokenizer=tokenizer, column=column, context_length=context_length)
        self.side = image_side

    def _image(self, data: bytes) -> dict[str, np.ndarray]:
        with Image.open(io.BytesIO(data)) as opened:
            img = opened.convert("RGB")
        side, n = self.side, self.side // PATCH
        pixels = np.asarray(img.resize((side, side), Image.Resampling.BILINEAR), dtype=np.uint8)
        patches = pixels.reshape(n, PATCH, n, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(n * n, PATCH * PATCH * 3)
        return {"pixel_values": np.ascontiguousarray(patches), "image_grid": np.array([[n, n]], dtype=np.int32)}

    def batch(self, rows: list[dict]) -> list[dict[str, np.ndarray]]:
        """One sample per row: one tokenizer call for the run, then each image."""
        samples = self.tokenize.batch(rows)
        if self.side is not None:
            for sample, row in zip(samples, rows):
                sample.update(self._image(bytes(row["image"])))
        return samples

    def __call__(self, row: dict) -> dict[str, np.ndarray]:
        """The sample of one row (what `batch` gives it)."""
        return self.batch([row])[0]


def sample_args(src: dict, tokenizer_path: Path, *, context_length: int, image_side: int) -> dict:
    """`Sample`'s keyword arguments for one source (also its Overlord ``transform_args``)."""
    return {
        "tokenizer": str(tokenizer_path),
        "column": text_column(src["kind"]),
        "image_side": image_side if src["kind"] == "image_text" else None,
        "context_length": context_length,
    }


def torchvision_without_ops() -> None:
    """Lets ``import torchvision`` succeed when its compiled ops cannot load.

    mosaicml-streaming imports ``streaming.vision`` (and so torchvision) in its package
    ``__init__``. PyPI's torchvision is built against PyPI's CUDA torch; next to the CPU
    torch its ``_C`` library does not load (it links ``libtorch_cuda.so``), and
    torchvision's ``_meta_registrations`` then fails on the two ops it registers without
    checking (``nms``, ``qnms``). Declaring their schemas first lets the import finish
    with torchvision's ops absent; neither peer runs a torchvision op here (samples hold
    encoded bytes and go through `Sample`). A CPU user would install torchvision from
    the PyTorch CPU index, which this machine cannot reach.
    """
    # deferred: the harness side never imports torch
    import torch

    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined: torchvision's own library loaded, or a second call


def _rows(src: dict):
    """Every row of a source as a dict of the columns the transform reads."""
    columns = ["caption", "image"] if src["kind"] == "image_text" else ["text"]
    for f in src["files"]:
        pf = pq.ParquetFile(f)
        for rg in range(pf.metadata.num_row_groups):
            yield from pf.read_row_group(rg, columns=columns).to_pylist()


def mds_shards(root: Path) -> Path:
    """Converts every source to an MDS dataset with ``MDSWriter`` (its defaults); returns the parent."""
    torchvision_without_ops()
    # deferred: mosaicml-streaming is a bench extra (make bench-peers)
    from streaming import MDSWriter

    out = root / "mds"
    if (out / ".done").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    for src in sources_of(root):
        columns = {"caption": "str", "image": "bytes"} if src["kind"] == "image_text" else {"text": "str"}
        with MDSWriter(out=str(out / src["name"]), columns=columns) as writer:
            for row in _rows(src):
                writer.write(row)
    (out / ".done").write_text("")
    return out


def _litdata_rows(src: dict):
    """`litdata.optimize`'s fn: yields a source's rows (its input is the source)."""
    yield from _rows(src)


def litdata_chunks(root: Path, workers: int = 1) -> Path:
    """Converts every source with ``litdata.optimize`` (its default chunking); returns the parent.

    Args:
        root: The corpus directory.
        workers: ``optimize``'s worker processes per source.
    """
    # deferred: litdata is a bench extra (make bench-peers)
    import litdata

    out = root / "litdata"
    if (out / ".done").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    for src in sources_of(root):
        litdata.optimize(
            fn=_litdata_rows,
            inputs=[src],
            output_dir=str(out / src["name"]),
            chunk_bytes="64MB",
            num_workers=workers,
            start_method="fork",  # its default (spawn) re-imports torch per call: 2.6 s a source here
            verbose=False,
        )
    (out / ".done").write_text("")
    return out


__all__ = sorted(
    [
        "Sample",
        "corpus",
        "litdata_chunks",
        "mds_shards",
        "sample_args",
        "sources_of",
        "text_column",
        "tokenizer",
        "torchvision_without_ops",
    ]
)
