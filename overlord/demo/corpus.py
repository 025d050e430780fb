"""Synthetic multi-source corpus: real Parquet files, deterministic from a seed.

The demo job, the tests and the benchmarks need many sources that look like real
pre-training data without downloading anything. Each source is a directory of Parquet
files (pyarrow, ``row_group_size`` rows per row group):

- text sources ``web``, ``code``, ``books``, ``text3``, ``text4``, ...:
  ``id`` int64 (unique per source), ``text`` string;
- image-text sources ``images``, ``images1``, ...: ``id`` int64, ``caption`` string,
  ``image`` binary (a real JPEG made with Pillow), ``width``/``height`` int32.

Text lengths follow coyo-700m's shape (~98% of texts <= 64 tokens, a long tail up to a
few thousand): a lognormal body clipped to 64 tokens plus a Pareto tail, with
parameters that differ per source so that mixes look different. Words come from a small
fixed vocabulary; every text holds exactly its drawn number of tokens as counted by
`overlord.transforms.tokenize` (words and punctuation are separate pieces).

Invariants:
- Same parameters and seed give byte-identical files (each source has its own RNG
  stream, seeded from ``(seed, kind, index)``).
- ``manifest.json`` is written last; a directory whose manifest matches the parameters
  and whose files are all present is returned as is, without regenerating.
"""

from __future__ import annotations

import functools
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from overlord.errors import ConfigError

MANIFEST = "manifest.json"
_FORMAT_VERSION = 1
_TEXT_NAMES = ("web", "code", "books")
_VOCAB_SEED = 0x0E7104D  # fixed: the vocabulary is the same for every corpus seed
_VOCAB_WORDS = 4096
_PUNCT_RATE = 0.08  # share of tokens that are "." or ","
_LONG_MIN = 1024  # every text source holds at least one text this long

TEXT_TRANSFORM = "overlord.transforms:text"
IMAGE_TRANSFORM = "overlord.transforms:image_text"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Lengths:
    """Token-length model of one source: lognormal body <= 64, Pareto tail > 64."""

    median: float
    sigma: float
    tail: float  # fraction of rows drawn from the tail
    alpha: float  # Pareto shape: smaller is heavier
    max_tokens: int


_NAMED_LENGTHS = {
    "web": _Lengths(median=12, sigma=0.6, tail=0.015, alpha=1.1, max_tokens=4096),
    "code": _Lengths(median=16, sigma=0.5, tail=0.02, alpha=0.9, max_tokens=4096),
    "books": _Lengths(median=8, sigma=0.7, tail=0.01, alpha=1.3, max_tokens=4096),
}


def _text_lengths(rng: np.random.Generator) -> _Lengths:
    """Length model for an unnamed text source, drawn so its mix differs from others'."""
    return _Lengths(
        median=float(rng.uniform(6, 16)),
        sigma=float(rng.uniform(0.45, 0.7)),
        tail=float(rng.uniform(0.005, 0.02)),
        alpha=float(rng.uniform(0.9, 1.4)),
        max_tokens=4096,
    )


def _caption_lengths(rng: np.random.Generator) -> _Lengths:
    """Captions: the same shape as texts, shorter, tail capped at 256 tokens."""
    return _Lengths(
        median=float(rng.uniform(6, 10)),
        sigma=float(rng.uniform(0.4, 0.6)),
        tail=float(rng.uniform(0.003, 0.01)),
        alpha=1.5,
        max_tokens=256,
    )


@functools.cache
def _vocabulary() -> np.ndarray:
    """The fixed word list (pure ``[a-z]`` so each word is one tokenizer piece) + "." + ","."""
    rng = np.random.default_rng(_VOCAB_SEED)
    consonants = list("bcdfghjklmnprstvwz")
    vowels = list("aeiou")
    words: dict[str, None] = {}  # ordered set: insertion order is deterministic
    while len(words) < _VOCAB_WORDS:
        n = int(rng.integers(1, 5))
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n))
        words[word] = None
    return np.array([*words, ".", ","], dtype=object)


def _draw_lengths(rng: np.random.Generator, n: int, model: _Lengths, force_long: bool) -> np.ndarray:
    body = np.clip(np.rint(rng.lognormal(np.log(model.median), model.sigma, n)), 1, 64)
    tail = np.minimum(65 * (1 + rng.pareto(model.alpha, n)), model.max_tokens)
    lengths = np.where(rng.random(n) < model.tail, np.rint(tail), body).astype(np.int64)
    if force_long and n and lengths.max() < _LONG_MIN:
        # Small sources would often miss the tail entirely; the planner's balancing and
        # the benchmarks need a few heavy samples in every text source.
        lengths[int(rng.integers(n))] = int(rng.integers(_LONG_MIN, model.max_tokens + 1))
    return lengths


def _draw_texts(rng: np.random.Generator, lengths: np.ndarray) -> list[str]:
    vocab = _vocabulary()
    n_words = len(vocab) - 2
    # Zipf-like word frequencies over a per-source permutation: every source has its
    # own frequent words, as web text and code do.
    probs = 1.0 / (np.arange(n_words) + 2.7) ** 1.07
    probs = probs[rng.permutation(n_words)] / probs.sum()
    total = int(lengths.sum())
    ids = rng.choice(n_words, size=total, p=probs)
    u = rng.random(total)
    punct = np.where(u < _PUNCT_RATE * 0.6, n_words, n_words + 1)  # "." or ","
    is_punct = u < _PUNCT_RATE
    is_punct[1:] &= ~is_punct[:-1]  # no ",." runs: a mark never follows a mark
    ids = np.where(is_punct, punct, ids)
    tokens = vocab[ids].tolist()
    texts = []
    start = 0
    for length in lengths.tolist():
        joined = " ".join(tokens[start : start + length])
        texts.append(joined.replace(" .", ".").replace(" ,", ","))
        start += length
    return texts


def _draw_jpeg(rng: np.random.Generator, max_side: int) -> tuple[bytes, int, int]:
    """A cheap synthetic picture: a two-colour gradient with a few shapes, as JPEG."""
    w, h = (int(v) for v in rng.integers(32, max_side + 1, size=2))
    angle = rng.uniform(0, 2 * np.pi)
    xs, ys = np.linspace(0, 1, w)[None, :], np.linspace(0, 1, h)[:, None]
    ramp = np.cos(angle) * xs + np.sin(angle) * ys
    ramp = (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1e-6)
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    # Mild noise gives the JPEG texture, so its size is closer to a photo's than a
    # flat gradient's would be.
    noise = rng.integers(-10, 11, size=(h, w, 1), dtype=np.int16)
    pixels = np.clip(c0 + ramp[..., None] * (c1 - c0) + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 4))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, w, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, h, size=2))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), w, h


def source_names(text_sources: int, image_sources: int) -> tuple[list[str], list[str]]:
    """Names of the text and image-text sources of a corpus, in generation order.

    Args:
        text_sources: How many text sources.
        image_sources: How many image-text sources.

    Returns:
        ``(text_names, image_names)``: ``web, code, books, text3, ...`` and
        ``images, images1, ...``.
    """
    text = [_TEXT_NAMES[i] if i < len(_TEXT_NAMES) else f"text{i}" for i in range(text_sources)]
    image = ["images" if i == 0 else f"images{i}" for i in range(image_sources)]
    return text, image


def _source_table(kind: str, index: int, name: str, rows: int, seed: int, max_image_side: int) -> pa.Table:
    rng = np.random.default_rng([seed, 0 if kind == "text" else 1, index])
    ids = pa.array(np.arange(rows, dtype=np.int64))
    if kind == "text":
        model = _NAMED_LENGTHS.get(name) or _text_lengths(rng)
        texts = _draw_texts(rng, _draw_lengths(rng, rows, model, force_long=True))
        return pa.table({"id": ids, "text": pa.array(texts, pa.string())})
    captions = _draw_texts(rng, _draw_lengths(rng, rows, _caption_lengths(rng), force_long=False))
    images = [_draw_jpeg(rng, max_image_side) for _ in range(rows)]
    return pa.table(
        {
            "id": ids,
            "caption": pa.array(captions, pa.string()),
            "image": pa.array([b for b, _, _ in images], pa.binary()),
            "width": pa.array([w for _, w, _ in images], pa.int32()),
            "height": pa.array([h for _, _, h in images], pa.int32()),
        }
    )


def read_manifest(out_dir: str | Path) -> dict | None:
    """Returns a corpus directory's manifest, or None when it has none (or it is unreadable).

    The manifest holds ``params`` (the generation parameters), ``files`` (relative path
    -> size in bytes) and ``sources`` (name -> ``{"kind", "transform", "files"}``, with
    ``transform`` a ``"module:callable"`` spec for `overlord.transforms.resolve`).

    Args:
        out_dir: The corpus directory.
    """
    try:
        return json.loads((Path(out_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete(root: Path, manifest: dict | None, params: dict) -> bool:
    if not manifest or manifest.get("params") != params:
        return False
    files = manifest.get("files", {})
    try:
        return all((root / rel).stat().st_size == size for rel, size in files.items())
    except OSError:
        return False


def generate_corpus(
    out_dir: str | Path,
    *,
    seed: int = 0,
    text_sources: int = 3,
    image_sources: int = 1,
    rows_per_source: int = 2000,
    files_per_source: int = 2,
    row_group_size: int = 128,
    max_image_side: int = 256,
) -> dict[str, list[str]]:
    """Writes a deterministic multi-source Parquet corpus (or reuses a complete one).

    Files are ``<out_dir>/<source>/part-NNNNN.parquet``; rows are split into
    ``files_per_source`` contiguous files, ids ``0..rows_per_source-1`` in order.

    Args:
        out_dir: Directory to write into; created if missing.
        seed: Corpus seed; same seed and parameters give byte-identical files.
        text_sources: Number of text sources (``web``, ``code``, ``books``, ``text3``...).
        image_sources: Number of image-text sources (``images``, ``images1``, ...).
        rows_per_source: Rows in each source.
        files_per_source: Parquet files per source.
        row_group_size: Rows per Parquet row group (the read granularity).
        max_image_side: Largest image side in pixels; sides are drawn from 32..this.

    Returns:
        ``{source_name: [absolute file paths]}``, text sources first.

    Raises:
        ConfigError: A count or size is out of range.
    """
    checks = {
        "text_sources": (text_sources, text_sources >= 0),
        "image_sources": (image_sources, image_sources >= 0),
        "rows_per_source": (rows_per_source, rows_per_source >= max(files_per_source, 1)),
        "files_per_source": (files_per_source, files_per_source >= 1),
        "row_group_size": (row_group_size, row_group_size >= 1),
        "max_image_side": (max_image_side, max_image_side >= 32),
    }
    for field, (value, ok) in checks.items():
        if not ok:
            raise ConfigError(
                f"generate_corpus: {field}={value!r} is out of range "
                "(counts >= 0, rows_per_source >= files_per_source >= 1, "
                "row_group_size >= 1, max_image_side >= 32)"
            )
    if text_sources + image_sources == 0:
        raise ConfigError("generate_corpus: text_sources + image_sources must be >= 1")
    params = {
        "version": _FORMAT_VERSION,
        "seed": seed,
        "text_sources": text_sources,
        "image_sources": image_sources,
        "rows_per_source": rows_per_source,
        "files_per_source": files_per_source,
        "row_group_size": row_group_size,
        "max_image_side": max_image_side,
        "pyarrow": pa.__version__,  # the writer's version is in the bytes
    }
    root = Path(out_dir).resolve()
    manifest = read_manifest(root)
    if manifest is None or not _complete(root, manifest, params):
        manifest = _write(root, params)
    return {name: [str(root / rel) for rel in entry["files"]] for name, entry in manifest["sources"].items()}


def _write(root: Path, params: dict) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    # Drop a stale manifest first: a crash half-way must not leave a manifest that
    # vouches for files being rewritten.
    (root / MANIFEST).unlink(missing_ok=True)
    text_names, image_names = source_names(params["text_sources"], params["image_sources"])
    plan = [("text", i, n) for i, n in enumerate(text_names)]
    plan += [("image", i, n) for i, n in enumerate(image_names)]
    sources: dict[str, dict] = {}
    files: dict[str, int] = {}
    for kind, index, name in plan:
        table = _source_table(kind, index, name, params["rows_per_source"], params["seed"], params["max_image_side"])
        (root / name).mkdir(exist_ok=True)
        rels = []
        bounds = np.linspace(0, table.num_rows, params["files_per_source"] + 1).astype(int)
        for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rel = f"{name}/part-{part:05d}.parquet"
            tmp = root / f"{rel}.tmp"
            pq.write_table(table.slice(lo, hi - lo), tmp, row_group_size=params["row_group_size"])
            os.replace(tmp, root / rel)  # a reader never sees a half-written file
            files[rel] = (root / rel).stat().st_size
            rels.append(rel)
        sources[name] = {
            "kind": "text" if kind == "text" else "image_text",
            "transform": TEXT_TRANSFORM if kind == "text" else IMAGE_TRANSFORM,
            "files": rels,
        }
    manifest = {"params": params, "files": files, "sources": sources}
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))  # key order = source order
    os.replace(tmp, root / MANIFEST)
    return manifest


def generate_many(
    out_dir: str | Path,
    n_sources: int,
    rows_per_source: int = 500,
    *,
    seed: int = 0,
    image_every: int = 30,
    files_per_source: int = 2,
    row_group_size: int = 128,
    max_image_side: int = 128,
) -> dict[str, list[str]]:
    """Many small sources, mostly text, for the memory benchmark.

    One source in ``image_every`` (at least one) is image-text, with smaller images
    than `generate_corpus`'s default so that hundreds of sources stay cheap to make.

    Args:
        out_dir: Directory to write into.
        n_sources: Total number of sources.
        rows_per_source: Rows in each source.
        seed: Corpus seed.
        image_every: One image-text source per this many sources.
        files_per_source: Parquet files per source.
        row_group_size: Rows per row group.
        max_image_side: Largest image side in pixels.

    Returns:
        ``{source_name: [absolute file paths]}`` as `generate_corpus`.

    Raises:
        ConfigError: A count is out of range.
    """
    if n_sources < 1 or image_every < 1:
        raise ConfigError(f"generate_many: n_sources={n_sources} and image_every={image_every} must be >= 1")
    images = max(1, n_sources // image_every) if n_sources > 1 else 0
    return generate_corpus(
        out_dir,
        seed=seed,
        text_sources=n_sources - images,
        image_sources=images,
        rows_per_source=rows_per_source,
        files_per_source=files_per_source,
        row_group_size=row_group_size,
        max_image_side=max_image_side,
    )


__all__ = sorted(
    [
        "IMAGE_TRANSFORM",
        "MANIFEST",
        "TEXT_TRANSFORM",
        "generate_corpus",
        "generate_many",
        "read_manifest",
        "source_names",
    ]
)
