"""Sample transforms: one source row in, named numpy arrays out.

A transform is a plain callable ``fn(row) -> dict[str, np.ndarray]``. ``row`` is one
row of a source as a dict of Python values (what ``pyarrow.Table.to_pylist()`` gives);
the result is the prepared sample a Source Loader keeps in its read buffer and reports
metadata for (see `sample_metadata`). Job configs name transforms as
``"module:callable"`` strings (``"overlord.transforms:text"``), turned into callables by
`resolve`.

Invariants:
- Pure and deterministic: the same row gives the same bytes in any process, on any
  machine, in any Python session (the tokenizer hashes with zlib.crc32, never with the
  salted built-in ``hash``), so a Shadow Loader rebuilds exactly the samples of the
  active one.
- A transform raises a plain ``KeyError``/``TypeError``/``ValueError`` naming what is
  wrong with the row; the Source Loader wraps it with the source, file and row.

Token ids: 0 pad, 1 bos, 2 eos, 3 image placeholder; every text piece hashes into
``[4, VOCAB_SIZE)``. That crc32 word hash (`tokenize`, `text`) is a toy for the demo and
the tests: no model's vocabulary, no subwords, collisions. Train on a real tokenizer with
``overlord.transforms_hf:Tokenize`` (a Hugging Face ``tokenizer.json``).

Transforms with arguments: ``Source.transform_args`` turns the spec into a factory,
called once per Source Loader with those keyword arguments (`build`). A transform may
also have a ``batch(rows) -> list[dict]`` method; the Source Loader then hands it runs
of rows, one run per worker thread, instead of one row at a time.
"""

from __future__ import annotations

import importlib
import inspect
import io
import re
import zlib
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np
from PIL import Image, UnidentifiedImageError

from overlord.errors import ConfigError

_T = TypeVar("_T")

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IMAGE_ID = 3
VOCAB_SIZE = 32000
_FIRST_PIECE_ID = 4

PATCH = 16
"""Side of a square image patch, in pixels (coyo-style 16x16 patches)."""
MAX_SIDE = 448
"""Largest image side after resizing, in pixels (28 patches)."""

# Words (runs of letters/digits/underscore) and single punctuation marks: cheap, and
# close enough to a real tokenizer's piece counts for cost modelling.
_PIECES = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> np.ndarray:
    """Splits ``text`` into words and punctuation and hashes each piece to a token id.

    The demo's documented toy (crc32 of each word, modulo a made-up vocabulary): cheap and
    deterministic, with token counts close to a real tokenizer's for cost modelling, but no
    model reads these ids. Use ``overlord.transforms_hf:Tokenize`` for training.

    Args:
        text: Any string; empty gives an empty array.

    Returns:
        int32 array of token ids in ``[4, VOCAB_SIZE)``, one per piece, no bos/eos.
    """
    pieces = _PIECES.findall(text)
    # crc32 is stable across processes and Python versions, unlike hash(); the modulo
    # is done once over the whole array rather than per piece.
    crcs = np.fromiter((zlib.crc32(p.encode("utf-8")) for p in pieces), dtype=np.uint32, count=len(pieces))
    ids = crcs % np.uint32(VOCAB_SIZE - _FIRST_PIECE_ID) + np.uint32(_FIRST_PIECE_ID)
    return ids.astype(np.int32)


def _with_bos_eos(ids: np.ndarray) -> np.ndarray:
    out = np.empty(ids.shape[0] + 2, dtype=np.int32)
    out[0] = BOS_ID
    out[1:-1] = ids
    out[-1] = EOS_ID
    return out


def _column(row: dict[str, object], name: str, kind: type[_T] | tuple[type[_T], ...], transform: str) -> _T:
    """Returns ``row[name]``, raising a message that says which column the transform needs."""
    try:
        value = row[name]
    except KeyError:
        raise KeyError(
            f"transform {transform!r} needs a column {name!r} but the row has "
            f"{sorted(row)}; point the source at a table with that column"
        ) from None
    except TypeError:
        raise TypeError(f"transform {transform!r} takes a row as a dict, got {type(row).__name__}") from None
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise TypeError(
            f"transform {transform!r}: column {name!r} must be "
            f"{' or '.join(k.__name__ for k in kinds)}, "
            f"got {type(value).__name__}"
        )
    return value


def text(row: dict[str, object]) -> dict[str, np.ndarray]:
    """Tokenizes a text row with the demo's crc32 word hash (`tokenize`, a toy).

    Args:
        row: A row with a string column ``text``.

    Returns:
        ``{"input_ids": int32 [n]}``: bos, the text's tokens, eos.

    Raises:
        KeyError: The row has no ``text`` column.
        TypeError: ``text`` is not a string.
    """
    value = _column(row, "text", str, "text")
    return {"input_ids": _with_bos_eos(tokenize(value))}


def _patch_grid(width: int, height: int) -> tuple[int, int]:
    """Patches per side after resizing: nearest multiple of PATCH, at least 1, at most MAX_SIDE."""
    max_patches = MAX_SIDE // PATCH

    def patches(side: int) -> int:
        # Half rounds up (40 px -> 3 patches); round() would round half to even.
        return min(max(int(side / PATCH + 0.5), 1), max_patches)

    return patches(height), patches(width)


def image_text(row: dict[str, object]) -> dict[str, np.ndarray]:
    """Decodes an image-caption row into caption tokens and image patches.

    The image is decoded to RGB, resized so both sides are multiples of 16 (nearest,
    at least 16, at most 448 per side, each side independently) and cut into 16x16
    patches in row-major order.

    Args:
        row: A row with a string column ``caption`` and a binary column ``image``
            holding an encoded picture (JPEG, or any format Pillow reads).

    Returns:
        ``{"input_ids": int32 [n]`` (bos, caption tokens, eos),
        ``"pixel_values": uint8 [h_patches * w_patches, 16 * 16 * 3]``,
        ``"image_grid": int32 [1, 2]`` = ``(h_patches, w_patches)}``.

    Raises:
        KeyError: A column is missing.
        TypeError: A column has the wrong type.
        ValueError: The image bytes do not decode.
    """
    caption = _column(row, "caption", str, "image_text")
    data = _column(row, "image", (bytes, bytearray, memoryview), "image_text")
    patches, hp, wp = _decode_patches(bytes(data), "image_text")
    return {
        "input_ids": _with_bos_eos(tokenize(caption)),
        "pixel_values": patches,
        "image_grid": np.array([[hp, wp]], dtype=np.int32),
    }


def _decode_patches(data: bytes, where: str) -> tuple[np.ndarray, int, int]:
    """Encoded image -> (uint8 [hp * wp, 768] patches, hp, wp), as `image_text` describes."""
    try:
        with Image.open(io.BytesIO(data)) as opened:
            img = opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"transform {where!r}: image bytes do not decode: {exc}") from exc
    hp, wp = _patch_grid(img.width, img.height)
    if (img.width, img.height) != (wp * PATCH, hp * PATCH):
        img = img.resize((wp * PATCH, hp * PATCH), Image.Resampling.BILINEAR)
    pixels = np.asarray(img, dtype=np.uint8)
    # (H, W, C) -> (hp, P, wp, P, C) -> (hp, wp, P, P, C): each patch's pixels contiguous.
    patches = pixels.reshape(hp, PATCH, wp, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(hp * wp, PATCH * PATCH * 3)
    return np.ascontiguousarray(patches), hp, wp


def image_text_deferred(row: dict[str, object]) -> dict[str, np.ndarray]:
    """`image_text` with the decode left to the Data Constructor (transformation reordering).

    The Source Loader reads only the image header (its size gives the patch grid, which
    the Planner needs) and passes the encoded bytes on: the rings carry the compressed
    image instead of its pixels. Pair it with `Source.decode: overlord.transforms:decode_image`.

    Returns:
        ``{"input_ids": int32 [n], "image_bytes": uint8 [encoded size],
        "image_grid": int32 [1, 2]}``.
    """
    caption = _column(row, "caption", str, "image_text_deferred")
    data = bytes(_column(row, "image", (bytes, bytearray, memoryview), "image_text_deferred"))
    try:
        with Image.open(io.BytesIO(data)) as img:  # lazy: reads the header, not the pixels
            width, height = img.size
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"transform 'image_text_deferred': image header does not parse: {exc}") from exc
    hp, wp = _patch_grid(width, height)
    return {
        "input_ids": _with_bos_eos(tokenize(caption)),
        "image_bytes": np.frombuffer(data, dtype=np.uint8).copy(),
        "image_grid": np.array([[hp, wp]], dtype=np.int32),
    }


def decode_image(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The deferred half of `image_text_deferred`, run by the Data Constructor: the
    encoded `image_bytes` become `pixel_values`, exactly as `image_text` makes them."""
    out = {k: v for k, v in sample.items() if k != "image_bytes"}
    patches, hp, wp = _decode_patches(sample["image_bytes"].tobytes(), "decode_image")
    out["pixel_values"] = patches
    if not np.array_equal(out["image_grid"], [[hp, wp]]):
        raise ValueError(
            f"decode_image: the decoded image has patch grid {(hp, wp)}, its header said {tuple(out['image_grid'][0])}"
        )
    return {
        "input_ids": out["input_ids"],
        "pixel_values": out["pixel_values"],
        "image_grid": out["image_grid"],
        **{k: v for k, v in out.items() if k not in ("input_ids", "pixel_values", "image_grid")},
    }


def sample_metadata(sample: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """Returns the metadata a Source Loader reports for one prepared sample.

    Args:
        sample: A transform's output.

    Returns:
        ``(tokens, image_patches, nbytes)``: ``len(input_ids)`` (0 if absent),
        ``pixel_values.shape[0]`` (or, with the decode deferred, the patches its
        ``image_grid`` announces; 0 if neither) and the bytes of all arrays.
    """
    ids = sample.get("input_ids")
    pixels = sample.get("pixel_values")
    grid = sample.get("image_grid")
    tokens = int(ids.shape[0]) if ids is not None else 0
    if pixels is not None:
        patches = int(pixels.shape[0])
    else:  # decode deferred to the Data Constructor: the grid says how many patches will come
        patches = int(np.prod(grid.reshape(-1, 2), axis=1).sum()) if grid is not None else 0
    nbytes = sum(int(a.nbytes) for a in sample.values())
    return tokens, patches, nbytes


def resolve(spec: str) -> Callable[..., object]:
    """Turns ``"module:callable"`` (e.g. ``"overlord.transforms:text"``) into the callable.

    The attribute may be dotted (``"pkg.mod:Class.method"``).

    Args:
        spec: The transform name from a job config.

    Returns:
        The callable object.

    Raises:
        ConfigError: The spec is malformed, the module does not import, the attribute is
            missing or is not callable. The message names the spec.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"transform spec {spec!r} must be 'module:callable', e.g. 'overlord.transforms:text'")
    module_name, attr_path = spec.split(":")
    if not module_name or not attr_path:
        raise ConfigError(f"transform spec {spec!r} must name both a module and a callable")
    try:
        obj: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = "" if exc.name == module_name else f" (it imports {exc.name!r}, which is missing)"
        raise ConfigError(
            f"transform spec {spec!r}: module {module_name!r} cannot be imported{missing}; "
            "check the spelling and that it is on the loader's PYTHONPATH"
        ) from exc
    except Exception as exc:  # the module itself raised at import time
        raise ConfigError(
            f"transform spec {spec!r}: importing {module_name!r} failed: {exc!r}; fix that module"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"transform spec {spec!r}: {module_name!r} has no attribute {attr_path!r}; check the name after the ':'"
            ) from None
    if not callable(obj):
        raise ConfigError(f"transform spec {spec!r} names a {type(obj).__name__}, which is not callable")
    return obj


def build(spec: str, args: dict | None = None, *, context_length: int | None = None) -> Callable[..., object]:
    """The transform a Source configures: `resolve(spec)` itself, or, given `args`, what
    the factory `spec` names returns for them.

    Args:
        spec: ``"module:callable"`` (``Source.transform``).
        args: the factory's keyword arguments (``Source.transform_args``); None: `spec`
            names the transform itself.
        context_length: ``BatchSpec.context_length``, passed to a factory that has a
            ``context_length`` parameter unless `args` sets it.

    Returns:
        The transform: ``fn(row) -> dict[str, np.ndarray]``, maybe with a ``batch`` method.

    Raises:
        ConfigError: the spec does not resolve, `args` do not fit the factory's
            parameters, the factory raises, or `spec` names a class but no `args` are given.
    """
    fn = resolve(spec)
    if args is None:
        if inspect.isclass(fn):
            raise ConfigError(
                f"transform spec {spec!r} names a class, a transform factory: give its arguments in "
                "Source.transform_args (e.g. {tokenizer: /path/tokenizer.json}; {} if it needs none)"
            )
        return fn
    kwargs = dict(args)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it as given
        params = {}
    if "context_length" in params and "context_length" not in kwargs and context_length is not None:
        kwargs["context_length"] = context_length
    if params:
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as exc:
            accepted = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
            raise ConfigError(
                f"transform spec {spec!r}: Source.transform_args {sorted(args)} do not fit it ({exc}); "
                f"it takes {accepted}"
            ) from None
    try:
        made = fn(**kwargs)
    except ConfigError:
        raise  # the factory's own message names what to change
    except Exception as exc:  # the user's factory: any failure is reported naming its spec and arguments
        raise ConfigError(
            f"transform spec {spec!r} with Source.transform_args {args} failed to build its transform: "
            f"{type(exc).__name__}: {exc}; fix the arguments (or the factory)"
        ) from exc
    if not callable(made):
        raise ConfigError(
            f"transform spec {spec!r} with Source.transform_args returned a {type(made).__name__}, not a transform"
        )
    return made


__all__ = sorted(
    [
        "BOS_ID",
        "EOS_ID",
        "IMAGE_ID",
        "MAX_SIDE",
        "PAD_ID",
        "PATCH",
        "VOCAB_SIZE",
        "build",
        "image_text",
        "resolve",
        "sample_metadata",
        "text",
        "tokenize",
    ]
)
