"""Intake: the Source Loaders' buffer metadata, into the Planner.

Per turn one XREAD over every loader's metadata stream (`meta:<stream>`). What the
Planner has read lives in its memory (and its checkpoint), so it trims the streams
behind what it read, every TRIM_EVERY_S in one round trip: trimmed after each read, a
job of 300 streams sent 17 XTRIMs a step, each for the one or two entries a stream got
since (a Planner that takes over reads what is left and drops it by its generation).
Chunks of an older generation (reported before this Planner took over) are dropped:
every loader reports its read buffer again with the new one (see leadership.py).

When a step needs more samples of a stream than it holds, the Planner tells the
loaders (`demand` hash): a full read buffer may be smaller than what one step takes
from a stream. The same fenced script (the lease checked first, so a
deposed Planner writes neither) adds an entry carrying what it set to the `demanded`
stream, which the loaders block on with the plans stream: a shortage wakes them at
once, not when their idle wait ends.

A demand follows need down as well: once DEMAND_HOLD_STEPS planned steps in a row took
less of a stream than it was asked to hold, it is lowered to the most one of them took
(0: none), in the same fenced write. A loader holds max(its budget, the demand), so a
mixing schedule that turned to a source and away again does not leave its buffer at
the old demand for the rest of the job; a step that needs more again asks again. A
Planner that takes over reads the `demand` hash, so it lowers what its predecessor asked.

No new samples for `Job.timeout_s` is a stall only if the loaders of the starving
streams have not turned their loops for as long either (else it is back-pressure).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import redis

from overlord.errors import PlanError
from overlord.plan import meta
from overlord.plan.meta import MetaChunk
from overlord.runtime.flow import alive_within
from overlord.runtime.layout import Layout
from overlord.runtime.lease import Lease, Superseded
from overlord.runtime.reshard import RETIRED
from overlord.store import Keys
from overlord.store.lane import Lane
from overlord.store.schema import DEMAND_HOLD_STEPS, DEMANDED_MAXLEN, demanded_values

WAIT_MS = 20  # longest block on the metadata streams
TRIM_EVERY_S = 5.0  # how often the read metadata streams are trimmed

# KEYS: the lease, `demand`, `demanded`; ARGV: the lease value, then field/value pairs.
# -1 (nothing written) unless the lease holds this Planner's value.
_DEMAND_SCRIPT = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
redis.call('XADD', KEYS[3], 'MAXLEN', '~', {DEMANDED_MAXLEN}, '*', unpack(ARGV, 2))
return 1
"""


class Intake:
    """Reads the loaders' reports of one generation, asks for what a step lacks, and
    tells a stall from back-pressure."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        layout: Layout,
        lease: Lease,
        generation: int,
        *,
        timeout_s: float,
        run_dir: Path | str,
        trim_every_s: float = TRIM_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        lane: Lane | None = None,
    ) -> None:
        self.lane = lane if lane is not None else Lane(r)  # the metadata reads' connection (overlord.store.lane)
        self.r, self.keys, self.layout, self.lease, self.generation = r, keys, layout, lease, generation
        self.trim_every_s, self.clock = trim_every_s, clock
        self._read_to: dict[bytes, bytes] = {}  # stream key -> the last entry read, not yet trimmed
        self._trimmed: float | None = None  # when the read streams were last trimmed
        self.ask = r.register_script(_DEMAND_SCRIPT)  # EVALSHA; loaded again on NOSCRIPT
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.index = {keys.meta(name).encode(): i for i, name in enumerate(layout.streams)}
        self.last_ids: dict[str, str | bytes] = {keys.meta(name): "0-0" for name in layout.streams}
        index = {name: i for i, name in enumerate(layout.streams)}
        # what the loaders were last asked to hold, per stream (a predecessor's asks included)
        self.asked: dict[int, int] = {
            index[name]: n for name, n in demanded_values(r.hgetall(keys.demand)).items() if n > 0 and name in index
        }
        self.held: dict[int, tuple[int, int]] = {}  # demanded stream -> (most a step took, steps) since its last ask
        self.waiting_since = time.monotonic()

    def grow(self, layout: Layout) -> None:
        """Read the reports of `layout`'s streams from now on (a reshard: its new streams
        from their start, the retired ones no more)."""
        self.layout = layout
        for i, name in enumerate(layout.streams):
            key = self.keys.meta(name)
            if layout.loader_of[i] == RETIRED:
                self.last_ids.pop(key, None)
            elif key not in self.last_ids:
                self.index[key.encode()] = i
                self.last_ids[key] = "0-0"

    def progressed(self) -> None:
        """The job moved (a step was planned, or trainers are what it waits on): the
        wait for samples starts again."""
        self.waiting_since = time.monotonic()

    def read(self, wanted: dict[int, int], block_ms: int = WAIT_MS) -> list[tuple[int, MetaChunk]]:
        """Ask for `wanted` (stream -> samples a step needs) where more than asked before
        (fenced: `demand` and a `demanded` entry, see the module docstring), then wait at
        most `block_ms` for reports.

        Returns:
            (stream index, chunk) of this generation, in the order reported.

        Raises:
            Superseded: another Planner holds the lease (nothing was asked).
        """
        raised = {i: n for i, n in wanted.items() if n > self.asked.get(i, 0)}
        if raised:
            self._write(raised)
            self.asked.update(raised)  # what the `demand` hash holds
            for i in raised:
                self.held.pop(i, None)
        reply = self.lane.xread(self.last_ids, block_ms=block_ms, count=64)
        if not reply:
            return []
        out = []
        for stream_key, entries in reply:
            for entry_id, fields in entries:
                chunk = meta.decode(fields)
                if chunk.token == self.generation:  # older ones are reported again with this one
                    out.append((self.index[stream_key], chunk))
                self.last_ids[stream_key.decode()] = entry_id
            self._read_to[stream_key] = entries[-1][0]
        self._trim()
        self.progressed()
        return out

    def _trim(self) -> None:
        """Drop what was read of the metadata streams (it lives in the Planner's memory
        and its checkpoint), at most once every `trim_every_s`."""
        now = self.clock()
        if not self._read_to or (self._trimmed is not None and now - self._trimmed < self.trim_every_s):
            return
        trim = self.r.pipeline(transaction=False)
        for stream_key, last in self._read_to.items():
            trim.xtrim(stream_key, minid=last, approximate=False)
        trim.execute()
        self._read_to.clear()
        self._trimmed = now

    def planned(self, took: Mapping[int, int]) -> None:
        """A step was planned that took `took[i]` samples of stream i: lower each demand
        that DEMAND_HOLD_STEPS steps in a row took less than (the module docstring).

        Raises:
            Superseded: another Planner holds the lease (nothing was written).
        """
        lowered = {}
        for i, asked in self.asked.items():
            most, steps = self.held.get(i, (0, 0))
            most, steps = max(most, took.get(i, 0)), steps + 1
            if steps >= DEMAND_HOLD_STEPS:
                if most < asked:
                    lowered[i] = most
                most, steps = 0, 0
            self.held[i] = (most, steps)
        if lowered:
            self._write(lowered)
            for i, n in lowered.items():
                if n:
                    self.asked[i] = n
                else:
                    del self.asked[i]
                    self.held.pop(i, None)

    def _write(self, demand: Mapping[int, int]) -> None:
        """Set `demand` (stream index -> samples) in the `demand` hash, with its `demanded`
        entry, fenced by the lease."""
        pairs = [x for i, n in demand.items() for x in (self.layout.streams[i], n)]
        keys_ = [self.keys.leader, self.keys.demand, self.keys.demanded]
        if self.ask(keys=keys_, args=[self.lease.value or b"", *pairs]) == -1:
            self.lease.lost.set()
            raise Superseded(f"the Planner lease (token {self.lease.token}) is no longer this process's")

    def check_stalled(self, step: int, streams: Sequence, serving: Sequence[int] | None = None) -> None:
        """Args:
            step: the step that waits.
            streams: the core's stream buffers (`count`, `final`, `name`), read only.
            serving: the loader process serving each stream (the layout's by default).

        Raises:
            PlanError: no report for `timeout_s` while the loaders of the streams with
                nothing buffered have not turned their loops for as long (hung or dead).
        """
        if time.monotonic() - self.waiting_since <= self.timeout_s:
            return
        starving = [i for i, s in enumerate(streams) if s.count == 0 and not s.final and not s.retired]
        loader_of = self.layout.loader_of if serving is None else serving
        owners = sorted({loader_of[i] for i in starving})
        if all(alive_within(self.r, self.keys, "loader", k, self.timeout_s) for k in owners):
            self.progressed()  # the loaders turn their loops: back-pressure, not a hang
            return
        raise PlanError(
            f"step {step}: no Source Loader reported new samples for {self.timeout_s:g}s and loader "
            f"process(es) {owners} have not turned their loops for as long (hung or dead); streams with none "
            f"buffered: {[streams[i].name for i in starving]}. Check the loader logs in {self.run_dir}, "
            "or raise Job.timeout_s for slow transforms"
        )
