"""Reshards: a source read by another number of streams from a step boundary on.

A source's partitions are its order (row group i goes to partition i % P), so changing
how many streams read it cannot move a stream's samples around: it retires the
source's streams and starts new ones over what they had not planned yet. A reshard
made before planning step m:

    retired   every stream of the source: each one's samples after its cursor in the
              planner state before m (the rest of its epoch, and of any epoch up to the
              highest one among them), and the samples the state deferred, are its
              remainder; it serves plans through m - 1 and is dropped
    new       P' streams `<source>.r<g>p<q>` (g: the job's g-th reshard, q: 0..P'-1);
              the remainders, end to end (the deferred samples first, then each retired
              stream's in stream order, epoch by epoch), cut in P' runs of nearly equal
              length, are their epoch `epoch`; from the next epoch on, stream q reads
              partition q of P' (row group i where i % P' == q) like any other stream

Every sample of every epoch is still planned once: the new streams' remainder epoch
holds exactly what the retired streams had not, and a later epoch is read by the new
streams alone. Their order is a pure function of this record and the source's row
groups (overlord.loader.order), so any process (the one hosting a new stream, a
restarted one) derives the same samples.

A record is kept in the planner checkpoint (`reshards`, every full snapshot) for the
whole job: a new stream's remainder epoch needs it for as long as it is read, and a
later reshard's remainder may reach back through it. Plans carry how many reshards the
job has made (`Plan.generation`): a role that sees a higher count than it knows reads
the records from the checkpoint before that plan's step and grows its layout
(`Layout.grown`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overlord.errors import PlanError

RETIRED = -1  # the loader process of a stream a reshard retired: served by none


def reshard_stream_name(source: str, generation: int, partition: int) -> str:
    """The name of partition `partition` of the streams made by the job's
    `generation`-th reshard, `<source>.r<g>p<q>` (`<source>.<partition>` before any)."""
    return f"{source}.r{generation}p{partition}"


@dataclass(frozen=True, slots=True)
class Reshard:
    """One reshard of one source (see the module docstring).

    Attributes:
        generation: 1 for the job's first reshard (of any source), 2 for the next, ...
        source: the source's name.
        source_index: its index in Job.sources.
        step: the first step planned with the new streams.
        epoch: the epoch the new streams' remainder counts as: the highest cursor epoch
            among the retired streams.
        parents: (name, cursor epoch, cursor seq) of each retired stream, in stream
            order: its samples after the cursor, through `epoch`, are its remainder
            (cursor seq -1: none of that epoch was planned).
        deferred: (name, epoch, seq) of the retired streams' samples that the state
            before `step` deferred (planned by no step yet), in the state's order.
        streams: the new streams' names; partition q is streams[q].
        homes: the loader process that serves each new stream first.
    """

    generation: int
    source: str
    source_index: int
    step: int
    epoch: int
    parents: tuple[tuple[str, int, int], ...]
    deferred: tuple[tuple[str, int, int], ...]
    streams: tuple[str, ...]
    homes: tuple[int, ...]

    @property
    def partitions(self) -> int:
        return len(self.streams)

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "source": self.source,
            "source_index": self.source_index,
            "step": self.step,
            "epoch": self.epoch,
            "parents": [list(p) for p in self.parents],
            "deferred": [list(d) for d in self.deferred],
            "streams": list(self.streams),
            "homes": list(self.homes),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Reshard:
        return cls(
            generation=int(obj["generation"]),
            source=str(obj["source"]),
            source_index=int(obj["source_index"]),
            step=int(obj["step"]),
            epoch=int(obj["epoch"]),
            parents=tuple((str(n), int(e), int(s)) for n, e, s in obj["parents"]),
            deferred=tuple((str(n), int(e), int(s)) for n, e, s in obj["deferred"]),
            streams=tuple(str(n) for n in obj["streams"]),
            homes=tuple(int(k) for k in obj["homes"]),
        )


def reshards_of(state: dict[str, Any]) -> list[Reshard]:
    """The reshards a planner checkpoint state records, oldest first.

    Raises:
        PlanError: an entry is not a record (a damaged checkpoint).
    """
    out = []
    for k, obj in enumerate(state.get("reshards") or []):
        try:
            out.append(Reshard.from_json(obj))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"the planner checkpoint's reshards entry {k} is not a reshard record ({type(exc).__name__}: "
                f"{exc}): {str(obj)[:200]}; the checkpoint is damaged: resume from an earlier checkpoint, or "
                "start the job fresh (without --resume)"
            ) from None
    return out


def check_record(
    record: Reshard,
    streams: Sequence[str],
    stream_source: Sequence[int],
    live: Sequence[bool],
    loaders: int | None = None,
) -> None:
    """Raise PlanError unless `record` can follow the streams it is applied to: `streams`
    (names), the source of each and whether each is live, as they stand before it (a
    layout, or the Planner core's buffer); `loaders`, when known, bounds its homes.

    Only the Planner writes records, in the checkpoint of the job it plans; a record
    that fails here comes from a damaged checkpoint, or one of another job or of
    another configuration of this one, and applying it would plan samples twice or
    never, or fail later without naming why."""
    what = _record_fault(record, streams, stream_source, live, loaders)
    if what:
        raise PlanError(
            f"the planner checkpoint's reshard {record.generation} (source {record.source!r}, step {record.step}) "
            f"{what}; the checkpoint is damaged or not this job's: run one job configuration on every node, "
            "or resume from an earlier checkpoint, or start the job fresh (without --resume)"
        )


def _record_fault(
    record: Reshard, streams: Sequence[str], stream_source: Sequence[int], live: Sequence[bool], loaders: int | None
) -> str:
    """What is wrong with `record` on top of those streams ("" when nothing is)."""
    g, source = record.generation, record.source
    if not record.streams or len(record.homes) != len(record.streams):
        return f"makes {len(record.streams)} stream(s) with {len(record.homes)} home(s): one home each, at least one"
    named = tuple(reshard_stream_name(source, g, q) for q in range(len(record.streams)))
    if record.streams != named:
        return f"names its streams {list(record.streams)}, not {list(named)}"
    if any(k < 0 or (loaders is not None and k >= loaders) for k in record.homes):
        return f"homes its streams on loader processes {list(record.homes)}, and the job has {loaders}"
    if not set(record.streams).isdisjoint(streams):
        return f"makes streams {list(record.streams)}, and some of them exist already"
    if record.source_index not in set(stream_source):
        return f"names source index {record.source_index}, which has no streams"
    if record.step < 0 or record.epoch < 0:
        return f"takes effect at step {record.step} in epoch {record.epoch}"
    mine = [name for i, name in enumerate(streams) if stream_source[i] == record.source_index and live[i]]
    parents = [name for name, _, _ in record.parents]
    if parents != mine:
        return f"retires streams {parents}, and the source's live streams are {mine}"
    if any(not name.startswith(f"{source}.") for name in parents):
        return f"retires streams {parents}, which are not source {source!r}'s"
    if max((e for _, e, _ in record.parents), default=-1) != record.epoch or any(s < -1 for _, _, s in record.parents):
        return f"counts its remainder as epoch {record.epoch} from cursors {list(record.parents)}"
    if len(set(record.deferred)) != len(record.deferred):
        return "holds a deferred sample twice"
    strays = [d for d in record.deferred if d[0] not in parents or not 0 <= d[1] <= record.epoch or d[2] < 0]
    if strays:
        return f"holds deferred samples {strays[:3]} that are not its retired streams' up to epoch {record.epoch}"
    return ""
