"""The Planner's pure core: buffer metadata in, one plan per step out.

No I/O here: the same metadata, seed and step give the same plan, byte for byte.
For now the strategy is constant mixing weights and round-robin distribution over
data-parallel groups and micro-batches; the plan format already names, per DP group
and micro-batch, every sample (stream, epoch, seq), which is what balancing needs.

A decision that depends on data not yet reported (is a source exhausted? has its
loader prepared enough samples?) is never taken early: `plan_step` returns None and
is asked again, so the plan does not depend on timing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from overlord.planner.meta import MetaChunk

_MIX = 0x4D4958  # "MIX": domain separator of the mixing RNG


@dataclass(slots=True)
class _Stream:
    """Metadata the Planner holds for one Source Loader stream (a source partition)."""

    name: str
    source: int
    chunks: list[MetaChunk] = field(default_factory=list)
    offset: int = 0  # consumed samples of chunks[0]
    count: int = 0  # reported and not yet planned
    final: bool = False  # the loader has reported every sample it will ever prepare
    cursor: tuple[int, int] = (0, -1)  # (epoch, seq) of the last planned sample

    def available(self) -> int:
        return self.count

    def add(self, chunk: MetaChunk) -> None:
        if len(chunk):
            self.chunks.append(chunk)
            self.count += len(chunk)
        self.final = self.final or chunk.final

    def take(self) -> tuple[int, int]:
        chunk = self.chunks[0]
        item = (chunk.epoch, int(chunk.seq[self.offset]))
        self.offset += 1
        self.count -= 1
        if self.offset == len(chunk):
            self.chunks.pop(0)
            self.offset = 0
        self.cursor = item
        return item


@dataclass(frozen=True, slots=True)
class Plan:
    """One step's plan: `dp[d][m]` lists the (stream, epoch, seq) of micro-batch m of DP group d."""

    step: int
    dp: list[list[list[tuple[int, int, int]]]]
    last: bool = False

    def to_json(self) -> bytes:
        return json.dumps({"step": self.step, "last": self.last, "dp": self.dp}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Plan":
        obj = json.loads(data)
        dp = [[[tuple(item) for item in mb] for mb in group] for group in obj["dp"]]
        return cls(step=obj["step"], dp=dp, last=obj["last"])

    def samples(self) -> int:
        return sum(len(mb) for group in self.dp for mb in group)


class PlannerCore:
    """Builds plans from buffer metadata.

    Args:
        streams: stream names, in the job's layout order (plans refer to their index).
        stream_source: index of each stream's source.
        weights: mixing weight of each source.
        seed: job seed.
        global_batch: samples per step.
        dp: data-parallel groups.
        micro_batches: micro-batches per step per DP group.
        finite: True when the job runs a fixed number of epochs (sources can run out).
        drop_last: drop a final partial step.
    """

    def __init__(
        self,
        *,
        streams: list[str],
        stream_source: list[int],
        weights: list[float],
        seed: int,
        global_batch: int,
        dp: int,
        micro_batches: int,
        finite: bool,
        drop_last: bool = False,
    ) -> None:
        self.streams = [_Stream(n, s) for n, s in zip(streams, stream_source)]
        self.by_source = [[i for i, s in enumerate(stream_source) if s == src] for src in range(len(weights))]
        self.weights = np.asarray(weights, dtype=np.float64)
        self.seed, self.global_batch, self.dp, self.mb = seed, global_batch, dp, micro_batches
        self.finite, self.drop_last = finite, drop_last
        self.rr = [0] * len(weights)  # next stream (round robin) of each source
        self.step = 0
        self.done = False

    # -- metadata in ---------------------------------------------------------------------

    def add(self, stream: int, chunk: MetaChunk) -> None:
        self.streams[stream].add(chunk)

    # -- state (checkpointed every step) -------------------------------------------------

    def state(self) -> dict:
        return {
            "step": self.step,
            "cursors": {s.name: list(s.cursor) for s in self.streams},
            "round_robin": list(self.rr),
            "rng": {"kind": "numpy.default_rng", "seed_words": [self.seed, "step", _MIX]},
        }

    # -- planning ------------------------------------------------------------------------

    def _remaining(self, src: int) -> tuple[int, bool]:
        """(samples reported and unplanned, whether that is all the source will ever have)."""
        ids = self.by_source[src]
        return sum(self.streams[i].available() for i in ids), all(self.streams[i].final for i in ids)

    def _counts(self, rng: np.random.Generator) -> np.ndarray | None:
        """Samples per source this step, or None to wait for more metadata."""
        n_src = len(self.weights)
        counts = np.zeros(n_src, dtype=np.int64)
        live = self.weights > 0
        need = self.global_batch
        while need > 0:
            if not live.any():
                break
            draw = rng.multinomial(need, self.weights * live / self.weights[live].sum())
            need = 0
            for src in np.flatnonzero(draw):
                have, complete = self._remaining(int(src))
                have -= int(counts[src])
                if draw[src] <= have:
                    counts[src] += draw[src]
                elif not (self.finite and complete):
                    return None  # its loader has not prepared enough yet
                else:  # the source runs out: take what is left, redraw the rest elsewhere
                    counts[src] += have
                    need += int(draw[src]) - have
                    live[src] = False
        return counts

    def plan_step(self) -> Plan | None:
        """The plan of `self.step`, or None if metadata is missing; advances on success."""
        if self.done:
            return None
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.step, _MIX])
        counts = self._counts(rng)
        if counts is None:
            return None
        total = int(counts.sum())
        last = False
        if total < self.global_batch:
            last = True  # a finite job's final, partial step
            if self.drop_last:
                counts[:] = 0
                total = 0
        # check per-stream availability before taking anything, so a wait changes nothing
        picks: list[int] = []
        rr = list(self.rr)
        avail = [s.available() for s in self.streams]
        for src, count in enumerate(counts):
            ids = self.by_source[src]
            for _ in range(int(count)):
                for _try in range(len(ids)):
                    i = ids[rr[src] % len(ids)]
                    rr[src] += 1
                    if avail[i] > 0:
                        break
                    if not self.streams[i].final:
                        return None
                else:  # pragma: no cover - counts never exceed what _remaining reported
                    raise AssertionError("planner: source remainder miscounted")
                avail[i] -= 1
                picks.append(i)
        self.rr = rr
        items = [(i, *self.streams[i].take()) for i in picks]
        order = rng.permutation(len(items))
        dp: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(self.mb)] for _ in range(self.dp)]
        for slot, k in enumerate(order):
            dp[slot % self.dp][(slot // self.dp) % self.mb].append(items[int(k)])
        plan = Plan(step=self.step, dp=dp, last=last)
        self.step += 1
        self.done = last
        return plan
