"""What a Source Loader process tells Redis about its streams, apart from serving plans.

- metadata reports: a chunk of prepared samples' metadata per stream on its
  `meta:<stream>` stream, queued in one pipeline and sent (durably: a replica has them
  before the loader counts them sent) when the process flushes;
- skip counters (`skips.py`) in `counters`, with the report after they change and at exit;
- the cost journal (`profile`), every JOURNAL_EVERY_S, for the next auto-partitioning;
- the running totals (`stats`), every STATS_S, for `overlord top` and the metrics
  endpoint: one HSET a second, never on the data path.

The loader process (process.py) owns the streams, buffers and budgets; `Reports` reads
them and writes back only each Source Loader's profile peak (`journal`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import redis

from overlord.loader.profile import JOURNAL_EVERY_S
from overlord.loader.source_loader import Prepared, SourceLoader
from overlord.plan import meta
from overlord.runtime.readbuffer import ReadBudget
from overlord.store.durable import Durability
from overlord.store.schema import encode_record, loader_stats_field

STATS_S = 1.0  # between two publications of the running totals


class Reports:
    """One loader process's reports to Redis (module docstring)."""

    def __init__(self, r: redis.Redis, keys, streams: list[str], durable: Durability) -> None:
        """Args:
        streams: the layout's stream names, by stream index."""
        self.r, self.keys, self.streams, self.durable = r, keys, streams, durable
        self._pipe: Any = None  # a redis pipeline: metadata reports queued for one round trip
        self._journaled = time.monotonic()
        self._stated = 0.0  # when the running totals were last published
        self._skips_published: dict[int, int] = {}  # stream -> Skips.version last written to Redis

    def chunk(self, i: int, loader: SourceLoader, samples: list[Prepared], ended, epoch: int, token: int) -> None:
        """Queue stream `i`'s metadata for `samples` (and its skip counters, if they changed)."""
        if self._pipe is None:
            self._pipe = self.r.pipeline(transaction=False)
        chunk = meta.MetaChunk(
            epoch=samples[0].epoch if samples else epoch,
            seq=[s.seq for s in samples],
            tokens=[s.tokens for s in samples],
            patches=[s.patches for s in samples],
            nbytes=[s.nbytes for s in samples],
            ended=ended,
            final=loader.finished,
            token=token,
        )
        self._pipe.xadd(self.keys.meta(self.streams[i]), meta.encode(chunk))
        if loader.skips.version != self._skips_published.get(i, 0):  # only what changed since the last report
            self._skips_published[i] = loader.skips.version
            self._pipe.hset(self.keys.counters, mapping=loader.skips.fields())

    def flush(self) -> None:
        """Send the queued reports, durably."""
        pipe = self._pipe
        if pipe is not None:
            self._pipe = None
            self.durable.execute(pipe)

    def all(
        self, buffers: Mapping[int, dict[tuple[int, int], Prepared]], loaders: Mapping[int, SourceLoader], token: int
    ) -> None:
        """Report every unsent sample again, in order (the Planner keeps what is new)."""
        for i, buffer in buffers.items():
            by_epoch: dict[int, list[Prepared]] = {}
            for key in sorted(buffer):
                by_epoch.setdefault(key[0], []).append(buffer[key])
            for epoch, samples in sorted(by_epoch.items()):
                self.chunk(i, loaders[i], samples, [], epoch, token)
            if not by_epoch and loaders[i].finished:
                self.chunk(i, loaders[i], [], [], loaders[i].epoch, token)
        self.flush()

    def forget(self, i: int) -> None:
        """Stream `i` left this process (a handoff): its counters are its new owner's to write."""
        self._skips_published.pop(i, None)

    def skips(self, loaders: Mapping[int, SourceLoader]) -> None:
        """Every stream's skip counters, now."""
        fields = {k: v for ld in loaders.values() if ld.skips.any for k, v in ld.skips.fields().items()}
        if fields:
            self.r.hset(self.keys.counters, mapping=fields)

    def journal_due(self) -> bool:
        return time.monotonic() - self._journaled > JOURNAL_EVERY_S

    def journal(self, loaders: Mapping[int, SourceLoader]) -> None:
        """Journal what this process's samples cost, for the next auto-partitioning."""
        self._journaled = time.monotonic()
        mapping = {}
        for i, loader in loaders.items():
            loader.profile.state_bytes = max(loader.profile.state_bytes, loader.state_bytes())
            if loader.profile.samples:
                mapping[self.streams[i]] = loader.profile.to_json()
        if mapping:
            self.r.hset(self.keys.profile, mapping=mapping)

    def stats_due(self) -> bool:
        return time.monotonic() - self._stated > STATS_S

    def stats(
        self,
        index: int,
        node: str,
        step: int,
        loaders: Mapping[int, SourceLoader],
        buffers: Mapping[int, dict],
        held_bytes: Mapping[int, int],
        budgets: Mapping[int, ReadBudget],
        kept: Mapping[Any, Prepared],
    ) -> None:
        """Loader process `index`'s running totals per stream (`stats` hash): what
        `overlord top` and the metrics endpoint turn into rates."""
        self._stated = time.monotonic()
        streams = {}
        for i, loader in loaders.items():
            streams[self.streams[i]] = {
                "prepared": loader.profile.samples,
                "transform_s": round(loader.profile.seconds, 4),
                "buffered": len(buffers[i]),
                "workers": loader.workers,
                "skipped": loader.skipped,
                "skipped_files": loader.skips.files_skipped,
                "skipped_row_groups": loader.skips.groups_skipped,
                "epoch": loader.epoch,
                "buffered_bytes": held_bytes[i],
                "budget_bytes": budgets[i].target_bytes(),
            }
        record = {
            "node": node,
            "pid": os.getpid(),
            "time": time.time(),
            "step": step,
            "kept_bytes": sum(p.nbytes for p in kept.values()),  # sent, kept until every trainer read the step
            "arrow_bytes": pa.total_allocated_bytes(),  # row groups read, in Arrow's pool
            "streams": streams,
        }
        try:
            self.r.hset(self.keys.stats, loader_stats_field(index), encode_record(record))
        except redis.RedisError:
            pass  # statistics wait for the next second; the data path does not
