"""`DGraph`: a step's samples as metadata, and the primitives a strategy composes.

A strategy is a short function of the step's data and the `ClientPlaceTree`:

    def long_short(data, tree):
        g = DGraph(data, tree, view="tokens").mix()
        g.distribute("DP").cost("attention")
        g.balance("karmarkar_karp", level="inter").balance("greedy", level="intra")
        return g.plan()

Primitives (the paper's names) record what to do; `plan()` runs the balancers once,
vectorised, and returns the `Plan`. Nothing here consumes a sample: the Planner
commits the plan's samples after the strategy returns, so a strategy that needs
metadata not yet reported (`NeedMetadata`) leaves no trace and is simply asked again.

Samples a capacity limit cannot place this step (an outlier that would wreck it) are
deferred: the next step takes them first, so they are still delivered exactly once.

The end of a finite job. No step is planned with an empty micro-batch, and the last
step that delivers samples carries `last`: while mixing a step, `mix()` also counts
what the next step could select (every sample left in the sources the schedule
weights there, once each of them has reported its end), and `plan_raw()` ends the job
at this step when the next one could not be delivered:

- nothing is left: this step is the last (a job whose sample count is a multiple of
  `global_batch` ends with a full step, never an extra empty one);
- `BatchSpec.drop_last=True` and less than a full step is left: the rest is dropped;
- `drop_last=False` and what is left (with any deferred samples) cannot give each
  micro-batch of each bucket one sample: the rest is dropped too, since a rank
  cannot train on an empty micro-batch. Otherwise the next step is the final partial
  step, every micro-batch of every bucket holding at least one sample.

Dropped samples are counted in `Plan.dropped` of the last step (the Planner adds them
to the `dropped_last` counter and logs them). A mixture that changes only at run time
(`mixing: {kind: dynamic}`) is read as it stands when the step is planned; should
metrics move weight away from every source still holding samples right at the end, the
job ends with a step that holds no sample at all (nothing is delivered for it, the
rings are closed) rather than one with empty micro-batches. A finite job whose sources
hold less than one deliverable step is refused at step 0 (PlanError).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from overlord.errors import ConfigError, PlanError
from overlord.plan.balance import assign, get_balancer
from overlord.plan.buffer import ITEM, Buffer, NeedMetadata
from overlord.plan.cost import CostFn, get_cost
from overlord.plan.schedule import Schedule, Weights
from overlord.plan.step_plan import Plan as Plan  # re-exported: strategies import it from here
from overlord.plan.tree import ClientPlaceTree

_MIX = 0x4D4958  # "MIX": domain separator of the mixing RNG
VIEWS = ("tokens", "patches", "nbytes")


@dataclass(slots=True)
class StepData:
    """What a strategy sees of one step: the buffer, the schedule and the batch shape."""

    step: int
    seed: int
    buffer: Buffer
    schedule: Schedule
    global_batch: int
    micro_batches: int
    context_length: int
    drop_last: bool
    round_robin: list[int]
    deferred: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=ITEM))
    mixing_unit: str = "step"  # "step", "substep" or "epoch"
    epoch: int = 0  # the job's epoch: the lowest any weighted source is being read in

    def rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, self.step, _MIX])

    def summary_buffer(self) -> dict[str, np.ndarray]:
        """Every reported, unplanned sample per stream (low-level interface)."""
        return self.buffer.summary()


class DGraph:
    """The step's samples, their costs and where they go.

    Args:
        data: the step's data (from the Planner).
        tree: the trainer mesh.
        view: the metadata that sizes a sample for this graph ("tokens" for a
            backbone, "patches" for a vision encoder); several graphs may share data.
    """

    def __init__(self, data: StepData, tree: ClientPlaceTree, view: str = "tokens") -> None:
        if view not in VIEWS:
            raise ConfigError(f"DGraph view {view!r} is not one of {VIEWS}")
        self.data, self.tree, self.metric = data, tree, view  # what sizes a sample here
        self.items: np.ndarray | None = None
        self.sub: NDArray[np.int64] | None = None  # micro-batch of each sample under substep mixing
        self.take: dict[int, int] = {}
        self.round_robin = list(data.round_robin)
        self.last = False  # this step is short: the weighted sources ran out
        self.after: int | None = None  # what the next step could select, when that decides the end
        self.axis: str = "DP"
        self.group_size: int | None = None
        self.costs: NDArray[np.float64] | None = None
        self.inter, self.intra = "round_robin", "round_robin"
        self.capacity: int | None = None
        self.mode = "two_level"

    # -- primitives ----------------------------------------------------------------------

    def mix(self, schedule: Schedule | None = None) -> DGraph:
        """Select this step's samples by the mixing schedule (deferred samples first).

        The schedule is read per step, per epoch (the job's epoch: the lowest epoch any
        weighted source is being read in) or per micro-batch ("substep": micro-batch m
        of step t gets the mixture of t + m/M, and keeps it through balancing).
        """
        d = self.data
        schedule = schedule or d.schedule
        need = max(d.global_batch - len(d.deferred), 0)
        rng = d.rng()
        if d.mixing_unit == "substep":
            sizes = [len(part) for part in np.array_split(np.arange(need), d.micro_batches)]
            parts: list[NDArray[np.int64]] = []
            counts = np.zeros(0, np.int64)
            for m, size in enumerate(sizes):
                weights = np.asarray(schedule.weights(d.step + m / d.micro_batches), dtype=np.float64)
                before = counts if m else np.zeros(len(weights), np.int64)
                counts = self._counts(weights, size, rng, before)
                parts.append(counts - before)
            per_mb: list[NDArray[np.int64]] | None = parts
        else:
            t = d.epoch if d.mixing_unit == "epoch" else d.step
            weights = np.asarray(schedule.weights(t), dtype=np.float64)
            counts = self._counts(weights, need, rng)
            per_mb = None
        self.last = int(counts.sum()) < need
        if self.last and d.drop_last:
            counts[:] = 0
            per_mb = None if per_mb is None else [c * 0 for c in per_mb]
        self.after = 0 if self.last else self._after(schedule, counts)
        fresh, self.take, self.round_robin = d.buffer.select(counts, d.round_robin)
        self.items = np.concatenate([d.deferred, fresh]) if len(d.deferred) else fresh  # fresh is a copy already
        self.sub = None if per_mb is None else _sub_batches(d.deferred, fresh, per_mb, d.micro_batches)
        return self

    def _after(self, schedule: Schedule, counts: NDArray[np.int64]) -> int | None:
        """Samples the next step could select once this step takes `counts`, when fewer
        than a full step are left in a finite job (every weighted source reported its
        end); None while a full step follows.

        Raises:
            NeedMetadata: less than a step is reported and a weighted source has not
                said whether it holds more.
        """
        d = self.data
        if not d.buffer.finite:
            return None
        nxt = d.step + 1
        if d.mixing_unit == "substep":
            weights = sum(
                np.asarray(schedule.weights(nxt + m / d.micro_batches), dtype=np.float64)
                for m in range(d.micro_batches)
            )
        else:
            weights = np.asarray(schedule.weights(d.epoch if d.mixing_unit == "epoch" else nxt), dtype=np.float64)
        left, open_sources = 0, []
        have, complete = d.buffer.remaining_all()
        for src in np.flatnonzero(weights > 0).tolist():
            left += int(have[src]) - int(counts[src])
            if not complete[src]:
                open_sources.append(src)
        if left >= d.global_batch:
            return None
        if open_sources:
            wanted: dict[int, int] = {}
            for source in open_sources:
                wanted.update(d.buffer.wanted(source, int(counts[source]) + d.global_batch))
            raise NeedMetadata(wanted)
        return left

    def _counts(
        self, weights: Weights, need: int, rng: np.random.Generator, base: NDArray[np.int64] | None = None
    ) -> NDArray[np.int64]:
        """Samples per source (on top of `base`), never more than the loaders reported."""
        buf = self.data.buffer
        counts = np.zeros(len(weights), dtype=np.int64) if base is None else base.copy()
        live = weights > 0
        held, complete = buf.remaining_all()  # the buffer does not change while a step is drawn
        while need > 0 and live.any():
            draw = rng.multinomial(need, weights * live / weights[live].sum())
            need = 0
            short = draw > held - counts
            if not short.any():  # every source holds its draw: the common case, in one pass
                counts += draw
                continue
            for src in np.flatnonzero(draw).tolist():
                have, drawn = int(held[src]) - int(counts[src]), int(draw[src])
                if drawn <= have:
                    counts[src] += drawn
                elif not (buf.finite and complete[src]):
                    raise NeedMetadata(buf.wanted(src, int(counts[src]) + drawn))
                else:  # the source runs out: take the rest, redraw elsewhere
                    counts[src] += have
                    need += drawn - have
                    live[src] = False
        return counts

    def distribute(self, axis: str = "DP", group_size: int | None = None) -> DGraph:
        """Spread samples over the nodes of `axis` (DP, CP: DPxCP ranks, WORLD: all ranks);
        with `group_size`, balance inside groups of that many buckets only."""
        self.tree.buckets(axis)  # validates the axis
        if group_size is not None and group_size < 1:
            raise ConfigError(f"distribute(group_size={group_size}) must be >= 1")
        self.axis, self.group_size = axis, group_size
        return self

    def cost(self, fn: str | CostFn) -> DGraph:
        """Register the cost model: a COSTS name or a function of the view's sizes."""
        model = get_cost(fn) if isinstance(fn, str) else fn
        items = self._require_items()
        costs = np.asarray(model(items[self.metric]), dtype=np.float64)
        if costs.shape != (len(items),):
            raise ConfigError(f"cost function returned shape {costs.shape}, expected ({len(items)},)")
        self.costs = costs
        return self

    def balance(
        self, method: str, level: str = "inter", *, capacity: int | None = None, keep_order: bool = False
    ) -> DGraph:
        """Balance costs over buckets (level="inter"), micro-batches ("intra"), both,
        or "interleaved" (over all buckets x micro-batches at once, then dealt).

        Args:
            method: a BALANCERS name ("greedy", "karmarkar_karp", or a registered one).
            level: "inter", "intra", "both" or "interleaved".
            capacity: hard limit of the view's size per micro-batch (e.g. tokens);
                samples that fit nowhere are deferred to the next step.
            keep_order: keep the global batch's composition and order (round robin in
                selection order); only the capacity is enforced.

        Once one level is balanced, a level not named in any balance() call is
        balanced greedily too (round robin applies only when nothing is balanced).
        """
        get_balancer(method)
        if level not in ("inter", "intra", "both", "interleaved"):
            raise ConfigError(f"balance(level={level!r}) must be 'inter', 'intra', 'both' or 'interleaved'")
        if level in ("inter", "both", "interleaved"):
            self.inter = method
        if level in ("intra", "both", "interleaved"):
            self.intra = method
        self.mode = "keep_order" if keep_order else "interleaved" if level == "interleaved" else "two_level"
        if capacity is not None:
            self.capacity = capacity
        return self

    def broadcast_at(self, dim: str) -> DGraph:
        """The trainer broadcasts along `dim` itself: only its rank 0 fetches bytes."""
        self.tree.broadcast_at(dim)
        return self

    @property
    def selected(self) -> np.ndarray:
        """This step's samples (metadata rows, ITEM dtype) once `mix()` chose them."""
        return self._require_items()

    # -- the plan ------------------------------------------------------------------------

    def _require_items(self) -> np.ndarray:
        if self.items is None:
            raise ConfigError("call mix() before distribute/cost/balance/plan")
        return self.items

    def assignment(
        self, subset: np.ndarray | None = None, bins: int | None = None
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(bucket, micro-batch) of every selected sample (or of `subset`); -1 for deferred ones."""
        items = self._require_items()
        n_buckets, bins = self.tree.buckets(self.axis), bins or self.data.micro_batches
        costs = self.costs if self.costs is not None else items[self.metric].astype(np.float64)
        if subset is not None:
            items, costs = np.take(items, subset), costs[subset]  # take: fancy indexing of records is ~80x slower
        sizes = self._sizes(items)
        if subset is None and self.sub is not None:  # substep mixing: micro-batch m keeps sub-batch m
            bucket = np.full(len(items), -1, dtype=np.int64)
            for m in range(bins):
                mine = np.flatnonzero(self.sub == m)
                b, _ = _assign(costs[mine], n_buckets, 1, self.inter, self.intra, sizes[mine], self.capacity, self.mode)
                bucket[mine] = b
            return bucket, np.where(bucket >= 0, self.sub, -1)
        group = self.group_size or n_buckets
        if group >= n_buckets:  # one group of every bucket: no samples to deal out and gather back
            return _assign(costs, n_buckets, bins, self.inter, self.intra, sizes, self.capacity, self.mode)
        bucket = np.full(len(items), -1, dtype=np.int64)
        mbin = np.full(len(items), -1, dtype=np.int64)
        groups = [np.arange(g, min(g + group, n_buckets)) for g in range(0, n_buckets, group)]
        owner = np.arange(len(items)) % len(groups)  # samples dealt to groups evenly
        for gi, members in enumerate(groups):
            mine = np.flatnonzero(owner == gi)
            b, mb = _assign(
                costs[mine], len(members), bins, self.inter, self.intra, sizes[mine], self.capacity, self.mode
            )
            placed = b >= 0
            bucket[mine[placed]] = members[b[placed]]
            mbin[mine[placed]] = mb[placed]
        return bucket, mbin

    def _sizes(self, items: np.ndarray) -> NDArray[np.int64]:
        """Each sample's size in this view as delivered: the constructor truncates a
        document to context_length, so that is the most tokens it takes in a micro-batch.
        A sample that fits in no micro-batch even alone would be deferred at every step
        and never delivered: that is a configuration error, said at once."""
        sizes = items[self.metric].astype(np.int64)
        if self.metric == "tokens":
            sizes = np.minimum(sizes, self.data.context_length)
        if self.capacity is not None and len(sizes) and sizes.max() > self.capacity:
            i = int(np.argmax(sizes))
            name = self.data.buffer.streams[items["stream"][i]].name
            raise PlanError(
                f"step {self.data.step}: sample {int(items['seq'][i])} of stream {name!r} (epoch "
                f"{int(items['epoch'][i])}) has {int(sizes[i])} {self.metric}"
                + (
                    f" (documents are cut at context_length={self.data.context_length})"
                    if self.metric == "tokens"
                    else ""
                )
                + f" but balance(capacity={self.capacity}) holds at most {self.capacity} per micro-batch, so no "
                "micro-batch could ever take it; raise capacity to at least the largest sample"
                + (" (context_length)" if self.metric == "tokens" else "")
                + " or filter such samples in the transform"
            )
        return sizes

    def view(self, name: str) -> DGraph:
        """Another graph over the same selected samples, sized by other metadata
        (e.g. "patches" for a vision encoder beside a "tokens" backbone graph)."""
        other = DGraph(self.data, self.tree, view=name)
        other.items, other.take, other.round_robin, other.last = (
            self._require_items(),
            self.take,
            self.round_robin,
            self.last,
        )
        other.sub, other.after = self.sub, self.after
        return other

    def plan(self, encoder: DGraph | None = None) -> Planned:
        """Run the balancers and build the Plan (committed by the Planner).

        Args:
            encoder: a second graph over the same samples (`view("patches")`) whose
                distribution places each sample's images on the rank that encodes them
                (e.g. over WORLD), apart from where its tokens go.
        """
        bucket, mbin = self.assignment()
        _fill_empty(bucket, mbin, self.tree.buckets(self.axis), self.data.micro_batches)
        encoder_rank = None
        if encoder is not None:
            if encoder.items is not self.items:
                raise ConfigError("plan(encoder=...) needs a graph made with view() of this one")
            has_images = encoder._require_items()["patches"] > 0
            encoder_rank = np.full(len(self._require_items()), -1, dtype=np.int64)
            rank, _ = encoder.assignment(subset=np.flatnonzero(has_images & (bucket >= 0)), bins=1)
            encoder_rank[has_images & (bucket >= 0)] = rank
        return self.plan_raw(bucket, mbin, encoder_rank, encoder_axis=encoder.axis if encoder else None)

    def plan_raw(
        self,
        bucket: np.ndarray,
        mbin: np.ndarray,
        encoder_rank: np.ndarray | None = None,
        encoder_axis: str | None = None,
    ) -> Planned:
        """Build the Plan from an explicit placement (low-level interface).

        Args:
            bucket: [n] bucket (node of `axis`) of each selected sample, -1 to defer it.
                A placement that leaves a micro-batch empty is kept as given (`plan()`
                fills every micro-batch when there are enough samples), except on a
                final step too short to fill them all, which is dropped (see above).
            mbin: [n] micro-batch of each sample within its bucket.
            encoder_rank: [n] bucket of `encoder_axis` that encodes the sample's images,
                -1 for none.
        """
        items = self._require_items()
        n_buckets, bins = self.tree.buckets(self.axis), self.data.micro_batches
        bucket, mbin = np.asarray(bucket, dtype=np.int64), np.asarray(mbin, dtype=np.int64)
        if (
            bucket.shape != (len(items),)
            or mbin.shape != (len(items),)
            or (bucket >= n_buckets).any()
            or ((bucket >= 0) & ((mbin < 0) | (mbin >= bins))).any()
        ):
            raise ConfigError(
                f"plan_raw: need one bucket in [-1, {n_buckets}) and micro-batch in [0, {bins}) per sample"
            )
        bucket, mbin = bucket.copy(), mbin.copy()
        d = self.data
        deferred = items[bucket < 0]
        ends, dropped = False, 0
        if self.after is not None:  # what the next step could deliver (with the deferred) decides the end
            follow = self.after + len(deferred)
            if follow < (d.global_batch if d.drop_last else n_buckets * bins):
                ends, dropped = True, follow
        if ends and int((bucket >= 0).sum()) < n_buckets * bins:
            # a final step that cannot give every micro-batch a sample: no rank gets an empty one
            if d.step == 0:
                raise PlanError(
                    f"the job's sources hold {int((bucket >= 0).sum())} sample(s) in all, fewer than one step can "
                    f"deliver ({n_buckets} bucket(s) x {bins} micro-batch(es) need one each"
                    + (f", and drop_last=True needs global_batch={d.global_batch}" if d.drop_last else "")
                    + "); lower BatchSpec.global_batch or micro_batches, or add data"
                )
            dropped += int((bucket >= 0).sum())
            bucket[:] = -1
            encoder_rank = None if encoder_rank is None else np.full(len(items), -1, dtype=np.int64)
        placed = np.flatnonzero(bucket >= 0)
        # keep each micro-batch in selection order, so the bytes do not depend on the balancer's internals
        cell = bucket[placed] * bins + mbin[placed]
        order = placed[_stable_argsort(cell, n_buckets * bins)]  # placed is ascending: ties stay in selection order
        counts = np.bincount(cell, minlength=n_buckets * bins)
        encoder_items = encoder_bounds = None
        if encoder_rank is not None:
            ranks = self.tree.buckets(encoder_axis or "WORLD")
            encoded = np.flatnonzero(encoder_rank >= 0)
            encoded = encoded[np.argsort(encoder_rank[encoded], kind="stable")]  # per rank, in selection order
            encoder_items = triples(items)[encoded]
            encoder_bounds = _offsets(np.bincount(encoder_rank[encoded], minlength=ranks))
        deferred = items[bucket < 0]
        plan = Plan(
            step=self.data.step,
            items=triples(items)[order],
            bounds=_offsets(counts),
            micro_batches=bins,
            axis=self.axis,
            last=ends,
            broadcast=tuple(sorted(self.tree.broadcast)),
            deferred=0 if ends else len(deferred),
            encoder_items=encoder_items,
            encoder_bounds=encoder_bounds,
            dropped=dropped,
        )
        return Planned(plan, self.take, self.round_robin, deferred)


def _sub_batches(
    deferred: np.ndarray, fresh: np.ndarray, per_mb: list[NDArray[np.int64]], bins: int
) -> NDArray[np.int64]:
    """Micro-batch of each selected sample under substep mixing: of each source's fresh
    samples, the first per_mb[0][s] go to micro-batch 0, the next per_mb[1][s] to 1...;
    deferred samples are dealt round robin."""
    sub = np.empty(len(deferred) + len(fresh), dtype=np.int64)
    sub[: len(deferred)] = np.arange(len(deferred)) % bins
    cuts = np.cumsum(np.stack(per_mb), axis=0)  # [bins, sources]
    rank = np.zeros(len(fresh), dtype=np.int64)  # position of each sample among its source's
    for src in np.unique(fresh["source"]):
        idx = np.flatnonzero(fresh["source"] == src)
        rank[idx] = np.arange(len(idx))
    sub[len(deferred) :] = (rank[:, None] >= cuts[:, fresh["source"]].T).sum(axis=1)
    return sub


def _fill_empty(bucket: NDArray[np.int64], mbin: NDArray[np.int64], n_buckets: int, bins: int) -> bool:
    """Give every (bucket, micro-batch) at least one sample, in place: each empty one
    takes the last sample of the fullest (lowest index on ties). A balancer seldom leaves
    one empty; a short final step may. Returns whether none is left empty."""
    placed = bucket >= 0
    counts = np.zeros(n_buckets * bins, dtype=np.int64)
    np.add.at(counts, bucket[placed] * bins + mbin[placed], 1)
    for cell in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        if counts[donor] < 2:
            return False
        i = np.flatnonzero(placed & (bucket * bins + mbin == donor))[-1]
        bucket[i], mbin[i] = divmod(int(cell), bins)
        counts[donor] -= 1
        counts[cell] += 1
    return True


def _stable_argsort(keys: NDArray[np.int64], bound: int) -> NDArray[np.intp]:
    """Stable argsort of keys in [0, bound): as 16-bit ints where they fit (numpy sorts
    those by radix, O(n)), else as they are."""
    if bound <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")


def _offsets(counts: NDArray[np.int64]) -> NDArray[np.int64]:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def triples(items: np.ndarray) -> NDArray[np.int64]:
    """(stream, epoch, seq) of ITEM rows as an int64 [n, 3] array, the plan's item form."""
    out = np.empty((len(items), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = items["stream"], items["epoch"], items["seq"]
    return out


@dataclass(frozen=True, slots=True)
class Planned:
    """A strategy's result: the plan and what committing it consumes."""

    plan: Plan
    take: dict[int, int]
    round_robin: list[int]
    deferred: np.ndarray


def _assign(
    costs: NDArray[np.float64],
    buckets: int,
    bins: int,
    inter: str,
    intra: str,
    sizes: NDArray[np.int64],
    capacity: int | None,
    mode: str = "two_level",
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    if inter == "round_robin" and intra == "round_robin" and capacity is None:
        i = np.arange(len(costs), dtype=np.int64)
        return i % buckets, (i // buckets) % bins
    return assign(
        costs,
        buckets,
        bins,
        inter=_method(inter),
        intra=_method(intra),
        sizes=sizes if capacity is not None else None,
        bin_capacity=capacity,
        mode=mode,
    )


def _method(name: str) -> str:
    return "greedy" if name == "round_robin" else name
