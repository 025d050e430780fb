"""`Mesh` (the trainers' device mesh) and `BatchSpec` (what a step delivers)."""

from __future__ import annotations

from dataclasses import dataclass

from overlord.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """The trainer's device mesh. Rank order is dp-major, tp fastest (Megatron's).

    Attributes:
        dp: data-parallel groups; each gets its own share of every step's samples,
            built by one Data Constructor. BatchSpec.global_batch must be a multiple of it.
        pp: pipeline stages of a group: the first stage receives the inputs, the last the
            labels and loss mask, middle stages only the packing metadata.
        cp: context-parallel ranks of a group: each receives a zigzag slice (chunks r and
            2*cp-1-r) of every document.
        tp: tensor-parallel ranks of a group: they receive the same micro-batch, or, with
            a strategy's broadcast_at("TP"), tp rank 0 the bytes and the others a marker
            with the shapes.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "cp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Mesh.{axis}={value!r} must be an int >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: {"dp", "pp", "cp", "tp"}."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh (world size {self.world_size})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        pp = (rank // (self.tp * self.cp)) % self.pp
        dp = rank // (self.tp * self.cp * self.pp)
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}

    def ranks_of_dp(self, dp: int) -> list[int]:
        """Global ranks that consume data-parallel group `dp`'s batches."""
        per = self.pp * self.cp * self.tp
        return list(range(dp * per, (dp + 1) * per))


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec:
    """What one step delivers.

    Attributes:
        global_batch: samples per step across all data-parallel groups.
        micro_batches: micro-batches per step per data-parallel group.
        context_length: tokens per packed row (and the truncation length).
        packing: pack several documents per row (cu_seqlens) instead of one padded row each.
        ring_bytes: capacity of each client's shared-memory ring; /dev/shm holds up to about three times its peak fill.
        drop_last: drop a final partial step at the end of the last epoch.
        vocab_size: the model's vocabulary size: every token id a transform returns
            (input_ids, labels) must lie in [0, vocab_size), else the row is a bad row
            (see Source.on_error). None: token ids are only checked to be >= 0.
    """

    global_batch: int = 32
    micro_batches: int = 1
    context_length: int = 2048
    packing: bool = True
    ring_bytes: int = 16 << 20
    drop_last: bool = False
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batches", "context_length", "ring_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"BatchSpec.{name}={value!r} must be an int >= 1")
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size < 1
        ):
            raise ConfigError(
                f"BatchSpec.vocab_size={self.vocab_size!r} must be an int >= 1 (the model's vocabulary size), or null"
            )
        if self.ring_bytes < 1 << 16:
            raise ConfigError(f"BatchSpec.ring_bytes={self.ring_bytes} is below 64 KiB; raise it")
