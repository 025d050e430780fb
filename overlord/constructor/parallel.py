"""Parallelism transforms: from one micro-batch of a DP group to what each rank needs.

A Data Constructor builds each micro-batch once (`packing.pack` / `packing.pad`) and
delivers it to every trainer rank of its data-parallel group: the PP, CP and TP peers.
These pure functions (no I/O, numpy in, numpy out) cut it down to each rank's role,
applied in this order by `for_rank`: CP split -> PP stage filter -> TP marker.

CP (`cp_split`), zigzag per document. Every real document (a cu_seqlens segment that is
a document, not a row's padding) is padded to a multiple of 2*cp and cut into 2*cp
equal chunks; CP rank r keeps chunks r and 2*cp-1-r, the load-balanced split of causal
attention used by Megatron-LM and TransformerEngine (THD format). Row padding is
dropped: it carries no loss, and each rank then gets exactly T_global / cp tokens.
Example, cp=2 (4 chunks per document), pack() rows of L=8, documents A (5) and B (8)::

    pack():          row 0 | A0 A1 A2 A3 A4 .  .  .  |   (. = row padding segment)
                     row 1 | B0 B1 B2 B3 B4 B5 B6 B7 |
    pad_for_cp():    [1, 16] A0 A1 A2 A3 A4 p  p  p  B0 B1 B2 B3 B4 B5 B6 B7
                     chunks  [A0 A1][A2 A3][A4 p][p p] [B0 B1][B2 B3][B4 B5][B6 B7]
    cp rank 0:       [1, 8]  A0 A1 p  p  | B0 B1 B6 B7      chunks 0 and 3
    cp rank 1:       [1, 8]  A2 A3 A4 p  | B2 B3 B4 B5      chunks 1 and 2
    cu_seqlens (local) [0 4 8], cu_seqlens_global [0 8 16], doc_lengths [4 4]

CP output layout (the varlen/THD layout attention kernels with CP expect):

    input_ids, labels  int64   [1, T_local]  each document's two kept chunks, in
    position_ids       int64   [1, T_local]  document order; T_local = sum(padded)/cp
    loss_mask          float32 [1, T_local]
    cu_seqlens         int32   [docs + 1]    local pieces (= cu_seqlens_global / cp)
    max_seqlen         int32   []            longest local piece
    doc_lengths        int32   [docs]        local piece lengths (2 * chunk)
    cu_seqlens_global  int32   [docs + 1]    the padded full documents
    max_seqlen_global  int32   []            longest padded full document
    cp_rank, cp_size   int32   []

Padding tokens are input 0, label -100, loss_mask 0; their position ids continue the
document (last position + 1, + 2, ...), so the padded document is one arithmetic run
and a rank's RoPE never sees a repeated position. Kept tokens keep their ORIGINAL
position ids and labels (labels are shifted before the split, so a label at a chunk's
edge is still the document's next token). Empty documents stay as empty segments, so
document indices (and `image_doc`) keep their meaning. Images (pixel_values,
image_grid, image_doc) are not split: every CP rank gets them whole; the vision
encoder runs on each CP rank or is balanced separately by the Planner (axis='WORLD').
Fields that are neither per-token nor packing metadata pass through unchanged. A
padded batch (`pad()`, attention_mask) also comes out in this packed layout.

PP (`pp_stage`, pp > 1): every stage gets METADATA_FIELDS (packing metadata, plus
`micro_batches` int32 [] and `seq_shape` int64 [2], the input_ids shape it needs to
size P2P activation buffers); the first stage adds the inputs (FIRST_STAGE_FIELDS),
the last the targets (LAST_STAGE_FIELDS), middle stages get METADATA_FIELDS only.
Fields this module does not know go to the first stage, as inputs. pp == 1: unchanged.

TP (`tp_marker`): with broadcast at TP, tp rank 0 gets its batch and ranks > 0 only a
marker (TP_MARKER_FIELDS plus `shape.<field>` int64 [ndim] for every field tp rank 0
holds), enough to allocate receive buffers for the broadcast; dtypes are the format's.
"""

from __future__ import annotations

import numpy as np

from overlord.config import Mesh
from overlord.constructor.packing import IGNORE_INDEX
from overlord.errors import BatchFormatError, ConfigError
from overlord.plan.tree import ClientPlaceTree

IMAGE_FIELDS = frozenset({"pixel_values", "image_grid", "image_doc"})
CP_FIELDS = frozenset({"cu_seqlens_global", "max_seqlen_global", "cp_rank", "cp_size"})
METADATA_FIELDS = frozenset(
    {"cu_seqlens", "max_seqlen", "doc_lengths", "attention_mask", "micro_batches", "seq_shape"} | CP_FIELDS
)
FIRST_STAGE_FIELDS = METADATA_FIELDS | {"input_ids", "position_ids"} | IMAGE_FIELDS
LAST_STAGE_FIELDS = METADATA_FIELDS | {"labels", "loss_mask"}
MIDDLE_STAGE_FIELDS = METADATA_FIELDS
TP_MARKER_FIELDS = frozenset({"broadcast_from_tp0", "seq_shape", "max_seqlen"})
SHAPE_PREFIX = "shape."

# Per-token fields are padded with these (any other per-token field with 0); position
# ids are continued instead (module docstring).
_PAD_VALUE = {"input_ids": 0, "labels": IGNORE_INDEX, "loss_mask": 0}
# Packing metadata that the CP split rewrites (attention_mask: cu_seqlens replaces it).
_PACKING = frozenset({"cu_seqlens", "max_seqlen", "doc_lengths", "attention_mask"})


def _cu(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _max(lengths: np.ndarray) -> np.ndarray:
    return np.asarray(lengths.max() if len(lengths) else 0, dtype=np.int32)


def _token_fields(batch: dict[str, np.ndarray]) -> list[str]:
    """Fields laid out like input_ids ([rows, L, ...]), i.e. one value per token."""
    shape = batch["input_ids"].shape
    return [
        k for k, v in batch.items()
        if k not in IMAGE_FIELDS and k not in _PACKING and v.ndim >= 2 and v.shape[:2] == shape
    ]  # fmt: skip


def _documents(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Flat start and length of every document of a pack() or pad() micro-batch.

    pack()'s cu_seqlens mixes documents and row padding. A segment is the next document
    when its length is that document's and it lies inside one row; otherwise it must be
    a row's padding tail. With pack()'s next-fit this is unambiguous: a padding tail of
    length L - o is only written when the next document does not fit (o + n > L).
    """
    ids = batch.get("input_ids")
    if ids is None or ids.ndim != 2 or "doc_lengths" not in batch:
        raise BatchFormatError("CP split needs a micro-batch from pack() or pad(): input_ids [rows, L], doc_lengths")
    rows, L = ids.shape
    lengths = np.asarray(batch["doc_lengths"], dtype=np.int64)
    if "cu_seqlens" not in batch:  # pad(): document r alone at the start of row r
        if len(lengths) != rows:
            raise BatchFormatError(f"padded micro-batch has {rows} rows but {len(lengths)} doc_lengths")
        return np.arange(rows, dtype=np.int64) * L, lengths
    cu = np.asarray(batch["cu_seqlens"], dtype=np.int64).tolist()
    want = lengths.tolist()
    starts: list[int] = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        one_row = n == 0 or a // L == (b - 1) // L
        if len(starts) < len(want) and n == want[len(starts)] and one_row:
            starts.append(a)
        elif not (one_row and n > 0 and b % L == 0):
            raise BatchFormatError(
                f"cu_seqlens segment [{a}, {b}) is neither document {len(starts)} (length "
                f"{want[len(starts)] if len(starts) < len(want) else None}) nor a padding tail of a row of {L}; "
                "cu_seqlens and doc_lengths disagree"
            )
    if not cu or cu[0] != 0 or cu[-1] != rows * L or len(starts) != len(want):
        raise BatchFormatError(
            f"cu_seqlens {cu[:8]}... covers {len(starts)} of {len(want)} documents over {rows}x{L} tokens"
        )
    return np.asarray(starts, dtype=np.int64), lengths


def _chunks(lengths: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk size and padded length (a multiple of 2*cp, the least) of every document."""
    chunk = -(-lengths // (2 * cp))
    return chunk, chunk * 2 * cp


def _zigzag(chunk: np.ndarray, cp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(document, offset in the padded document) of every token CP rank `rank` keeps."""
    local = 2 * chunk
    doc = np.repeat(np.arange(len(chunk)), local)
    k = np.arange(int(local.sum())) - np.repeat(np.cumsum(local) - local, local)
    c = chunk[doc]
    offset = np.where(k < c, rank * c + k, (2 * cp - 1 - rank) * c + (k - c))
    return doc, offset


def _gather(batch: dict[str, np.ndarray], starts, lengths, doc, offset) -> dict[str, np.ndarray]:
    """Per-token fields at (document, offset) as one row [1, T]; offsets past a document's end are padding."""
    n = lengths[doc]
    real = offset < n
    # a padding token reads the document's last real token, then gets overwritten
    src = starts[doc] + np.minimum(offset, n - 1)
    out: dict[str, np.ndarray] = {}
    for name in _token_fields(batch):
        arr = batch[name]
        flat = arr.reshape(arr.shape[0] * arr.shape[1], *arr.shape[2:])
        got = flat[src]
        if name == "position_ids":
            step = (offset - n + 1)[~real]
            got[~real] += step.reshape(-1, *[1] * (got.ndim - 1))
        else:
            got[~real] = _PAD_VALUE.get(name, 0)
        out[name] = got.reshape(1, len(src), *arr.shape[2:])
    return out


def _passthrough(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fields the CP split leaves alone: images and anything not per-token or packing."""
    tokens = set(_token_fields(batch))
    return {k: v for k, v in batch.items() if k not in tokens and k not in _PACKING and k not in CP_FIELDS}


def _check_cp(cp: int, rank: int = 0) -> None:
    if not isinstance(cp, int) or cp < 1 or not 0 <= rank < cp:
        raise ConfigError(f"CP split with cp={cp!r}, rank={rank!r}: need an int cp >= 1 and 0 <= rank < cp")


def pad_for_cp(batch: dict[str, np.ndarray], cp: int) -> dict[str, np.ndarray]:
    """Every document padded to a multiple of 2*cp, end to end in one row, row padding dropped.

    This is the sequence the CP ranks' chunks partition (`cp_merge` rebuilds it).

    Args:
        batch: A micro-batch from `pack()` or `pad()`.
        cp: Context-parallel size.

    Returns:
        input_ids/labels/position_ids/loss_mask [1, sum(padded)], cu_seqlens of the
        padded documents, max_seqlen, doc_lengths (padded lengths), other fields as they were.

    Raises:
        ConfigError: cp is not an int >= 1.
        BatchFormatError: cu_seqlens and doc_lengths disagree.
    """
    _check_cp(cp)
    starts, lengths = _documents(batch)
    _, padded = _chunks(lengths, cp)
    doc = np.repeat(np.arange(len(padded)), padded)
    offset = np.arange(int(padded.sum())) - np.repeat(np.cumsum(padded) - padded, padded)
    out = _gather(batch, starts, lengths, doc, offset)
    out.update(cu_seqlens=_cu(padded), max_seqlen=_max(padded), doc_lengths=padded.astype(np.int32))
    out.update(_passthrough(batch))
    return out


def cp_split(batch: dict[str, np.ndarray], cp: int, rank: int) -> dict[str, np.ndarray]:
    """The zigzag share of CP rank `rank`: chunks rank and 2*cp-1-rank of every document.

    Args:
        batch: A micro-batch from `pack()` or `pad()`.
        cp: Context-parallel size; 1 returns `batch` itself.
        rank: This rank's CP coordinate, 0 <= rank < cp.

    Returns:
        The local micro-batch in the layout of the module docstring.

    Raises:
        ConfigError: cp or rank out of range.
        BatchFormatError: cu_seqlens and doc_lengths disagree.
    """
    _check_cp(cp, rank)
    if cp == 1:
        return batch
    starts, lengths = _documents(batch)
    chunk, padded = _chunks(lengths, cp)
    doc, offset = _zigzag(chunk, cp, rank)
    out = _gather(batch, starts, lengths, doc, offset)
    local = 2 * chunk
    out.update(cu_seqlens=_cu(local), max_seqlen=_max(local), doc_lengths=local.astype(np.int32))
    out.update(cu_seqlens_global=_cu(padded), max_seqlen_global=_max(padded))
    out.update(cp_rank=np.asarray(rank, dtype=np.int32), cp_size=np.asarray(cp, dtype=np.int32))
    out.update(_passthrough(batch))
    return out


def cp_merge(parts: list[dict[str, np.ndarray]], cp: int) -> dict[str, np.ndarray]:
    """Reassemble the CP ranks' shares into `pad_for_cp(batch, cp)` (the inverse of `cp_split`).

    Args:
        parts: One `cp_split` output per CP rank, in any order.
        cp: Context-parallel size; with 1, `parts` is `[batch]` and `batch` is returned.

    Returns:
        The padded full micro-batch, equal to `pad_for_cp(batch, cp)`.

    Raises:
        BatchFormatError: the parts are not exactly CP ranks 0..cp-1 of one micro-batch.
    """
    _check_cp(cp)
    if cp == 1 and len(parts) == 1:
        return parts[0]
    ranks = sorted(int(p["cp_rank"]) for p in parts)
    if ranks != list(range(cp)) or any(int(p["cp_size"]) != cp for p in parts):
        raise BatchFormatError(f"cp_merge needs one part per CP rank 0..{cp - 1}, got ranks {ranks}")
    cu_global = np.asarray(parts[0]["cu_seqlens_global"], dtype=np.int64)
    padded = np.diff(cu_global)
    chunk = padded // (2 * cp)
    out: dict[str, np.ndarray] = {}
    for name in _token_fields(parts[0]):
        first = parts[0][name]
        full = np.empty((1, int(cu_global[-1]), *first.shape[2:]), dtype=first.dtype)
        for part in parts:
            doc, offset = _zigzag(chunk, cp, int(part["cp_rank"]))
            full[0, cu_global[:-1][doc] + offset] = part[name][0]
        out[name] = full
    out.update(cu_seqlens=_cu(padded), max_seqlen=_max(padded), doc_lengths=padded.astype(np.int32))
    out.update(_passthrough(parts[0]))
    return out


def _seq_shape(batch: dict[str, np.ndarray]) -> np.ndarray:
    if "seq_shape" in batch:
        return batch["seq_shape"]
    for name in ("input_ids", "labels", "attention_mask"):
        if name in batch:
            return np.asarray(batch[name].shape[:2], dtype=np.int64)
    raise BatchFormatError(f"micro-batch has no per-token field to take seq_shape from; fields: {sorted(batch)}")


def pp_stage(batch: dict[str, np.ndarray], pp: int, stage: int, micro_batches: int) -> dict[str, np.ndarray]:
    """The fields PP stage `stage` uses (FIRST/MIDDLE/LAST_STAGE_FIELDS).

    Args:
        batch: A (CP-local) micro-batch.
        pp: Pipeline-parallel size; 1 returns `batch` itself.
        stage: This rank's PP coordinate, 0 <= stage < pp.
        micro_batches: Micro-batches per step, sent as `micro_batches` for the PP schedule.

    Returns:
        The stage's fields, plus `micro_batches` and `seq_shape` when pp > 1.

    Raises:
        ConfigError: pp, stage or micro_batches out of range.
    """
    if not isinstance(pp, int) or pp < 1 or not 0 <= stage < pp or micro_batches < 1:
        raise ConfigError(f"pp_stage with pp={pp!r}, stage={stage!r}, micro_batches={micro_batches!r}: out of range")
    if pp == 1:
        return batch
    full = dict(batch)
    full["seq_shape"] = _seq_shape(batch)
    full["micro_batches"] = np.asarray(micro_batches, dtype=np.int32)
    known = FIRST_STAGE_FIELDS | LAST_STAGE_FIELDS
    keep = METADATA_FIELDS
    if stage == 0:  # unknown fields are taken to be inputs: losing them would be silent
        keep = FIRST_STAGE_FIELDS | {k for k in full if k not in known}
    elif stage == pp - 1:
        keep = LAST_STAGE_FIELDS
    return {k: v for k, v in full.items() if k in keep}


def tp_marker(batch: dict[str, np.ndarray], tp_rank: int, *, broadcast: bool = True) -> dict[str, np.ndarray]:
    """What TP rank `tp_rank` receives when tp rank 0 broadcasts (or not) to its TP group.

    Args:
        batch: The micro-batch of this rank's (PP stage, CP rank).
        tp_rank: This rank's TP coordinate.
        broadcast: The trainer broadcasts the batch from tp rank 0 (`broadcast_at("TP")`).

    Returns:
        `batch` for tp rank 0 or without broadcast; otherwise the marker:
        broadcast_from_tp0 int32 [] = 1, seq_shape int64 [2], max_seqlen (if `batch` has
        it) and `shape.<field>` int64 [ndim] for every field of `batch`.
    """
    if tp_rank < 0:
        raise ConfigError(f"tp_rank={tp_rank!r} must be >= 0")
    if not broadcast or tp_rank == 0:
        return batch
    marker = {"broadcast_from_tp0": np.asarray(1, dtype=np.int32), "seq_shape": _seq_shape(batch)}
    if "max_seqlen" in batch:
        marker["max_seqlen"] = batch["max_seqlen"]
    marker.update({SHAPE_PREFIX + k: np.asarray(v.shape, dtype=np.int64) for k, v in batch.items()})
    return marker


def for_rank(
    batch: dict[str, np.ndarray], mesh: Mesh, rank: int, *, micro_batches: int, broadcast_tp: bool
) -> dict[str, np.ndarray]:
    """What global rank `rank` receives of its DP group's micro-batch: CP split, PP filter, TP marker.

    Args:
        batch: The DP group's micro-batch from `pack()` or `pad()`.
        mesh: The trainer mesh.
        rank: A global rank of the group that built `batch`.
        micro_batches: Micro-batches per step (for PP stages).
        broadcast_tp: The trainer broadcasts from tp rank 0 to its TP group.

    Returns:
        The rank's micro-batch; with a 1x1x1 (pp, cp, tp) group, `batch` itself.

    Raises:
        ConfigError: rank outside the mesh, or a parallelism argument out of range.
        BatchFormatError: `batch` is not a well-formed micro-batch.
    """
    at = mesh.coords(rank)
    local = cp_split(batch, mesh.cp, at["cp"])
    local = pp_stage(local, mesh.pp, at["pp"], micro_batches)
    return tp_marker(local, at["tp"], broadcast=broadcast_tp)


def needs_bytes(mesh: Mesh, rank: int, broadcast_tp: bool) -> bool:
    """Whether `rank` receives sample bytes (tokens, labels, images), not only metadata or a marker.

    False for tp > 0 under TP broadcast and for middle PP stages (packing metadata only,
    which follows from sample lengths), so no rank loads bytes it does not use.

    Raises:
        ConfigError: rank outside the mesh.
    """
    # the tree owns who receives what
    return ClientPlaceTree(mesh, {"TP"} if broadcast_tp else set()).needs_bytes(rank)
