"""A Data Constructor: builds the micro-batches of one data-parallel group.

Per step it reads the plan, collects exactly the planned samples from the rings of
the loader processes (any ring that has data, so no ring's back-pressure can block
another's), checks each is the one planned (stream, epoch, seq), applies the
micro-batch transform (packing or padding) and writes every micro-batch into the ring
of each trainer client of the group (its PP/CP/TP peers). Progress goes to Redis, the
last step written (c<dp>) and how far the group's trainers consumed (t<dp>, see
marks.py), so the Planner stays at most `plan_ahead` steps ahead of both.

Recovery. A restarted Data Constructor continues at the first step its trainers may
not have read whole (their mark t<dp>, `unread`), not after the last step written
(c<dp>): what its predecessor wrote and its trainers did not read may be gone with it
(rings on another node that died or was cut off, a ring the trainer can no longer
reach), and building a step twice costs a little work while building it not at all
loses it. It asks the loader processes to replay from there (`progress` r<dp>): they
keep what they sent until the trainers read it (overlord.loader.process). Its rings may
then hold a sample twice (sent before and after the restart) or samples of a later
step: duplicates and samples of finished steps are dropped, later ones kept aside. A
trainer drops the micro-batches it already has by position (see
overlord.torch.DataLoader), so a step built twice reaches it once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import redis

from overlord.config import Job
from overlord.constructor.inputs import open_input
from overlord.constructor.marks import STREAM_MAXLEN, MarkWatch, Owner, check
from overlord.constructor.packing import pack, pad
from overlord.constructor.parallel import cp_split, pp_stage, tp_marker
from overlord.errors import PeerDied, PlanError, RingTimeout, SourceReadError
from overlord.plan.checkpoint import Checkpoints
from overlord.plan.lowlevel import constructor_do_plan, encoder_destinations
from overlord.plan.waiting import SharedPlans, resume_point, wait_plan
from overlord.remote.bridge import Breaks, Bridge
from overlord.runtime.flow import Beat, Stopped, alive_within, push
from overlord.runtime.layout import Layout, client_ring, sample_ring
from overlord.runtime.reshard import Reshard, reshards_of
from overlord.shm import Ring, decode_batch
from overlord.store.schema import (
    BUILT,
    PROGRESSED_VALUE,
    built_entry,
    built_field,
    consumed_field,
    copied_field,
    replay_field,
    replay_request,
    skips,
    truncated_field,
)
from overlord.transforms import resolve

log = logging.getLogger("overlord.constructor")

# A restarted Data Constructor's start, in one step on the server: the first step its
# trainers may not have read whole (`unread`: their mark t<dp> less one, else the job's
# first step), its built mark c<dp> set back to before it (so no loader drops what it
# is about to ask for: they keep a step until every group built it and every trainer
# read it), with its `progressed` entry (the Planner follows the marks by their entries),
# its replay request r<dp> from there, and its claim on the group's marks (o<dp>, see
# marks.Owner). Read apart from the writes, a trainer moving on in between could let a
# loader drop the step the replay asks for.
_RESTART = """
local mark = redis.call('HGET', KEYS[1], ARGV[1])
local step = tonumber(ARGV[4])
if mark then step = math.max(step, tonumber(mark) - 1) end
redis.call('HSET', KEYS[1], ARGV[2], step - 1, ARGV[3], ARGV[5] .. ':' .. step, ARGV[10], ARGV[5])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[9], '*', ARGV[6], ARGV[7], ARGV[8], step - 1)
return step
"""

_WAIT_S = 0.05  # one futex wait on a loader ring when none has a record


class DataConstructor:
    """The constructor of DP group `dp`."""

    def __init__(
        self,
        job: Job,
        layout: Layout,
        dp: int,
        r,
        keys,
        stop: threading.Event,
        beat: Beat,
        restarted: bool = False,
        bridges: Mapping[int, Bridge] | None = None,
        plans: SharedPlans | None = None,
        on_superseded: Callable[[], None] | None = None,
    ) -> None:
        self.job, self.layout, self.dp, self.restarted = job, layout, dp, restarted
        self.on_superseded = on_superseded  # another process owns the group now (its watch saw it)
        self.plans = plans  # the host's plans, read once for its DP groups
        self.r, self.keys, self.stop, self.beat = r, keys, stop, beat
        self.owner = Owner(r, keys, dp)
        self.bridges = list(bridges.values()) if bridges else []
        self.breaks = Breaks(self.bridges)
        # per loader process: its ring on this node, and on several nodes a Bridge that
        # carries its samples when it runs elsewhere (overlord.remote.bridge)
        self.inputs: list[list] = []
        for loader in range(layout.loaders):
            ring = Ring.attach(sample_ring(job, loader, dp), timeout=job.timeout_s)
            # on several nodes this node's Flight endpoint may have served the ring to this
            # group's constructor elsewhere; it stops when it sees the claim change
            local = open_input(ring, take_over=bool(bridges))
            self.inputs.append([local] + ([bridges[loader]] if bridges else []))
        self.outputs: dict[int, Ring] = {}
        for rank in job.mesh.ranks_of_dp(dp):
            ring = Ring.attach(client_ring(job, rank), timeout=job.timeout_s)
            ring.claim_producer()
            self.outputs[rank] = ring
        self.written: dict[int, int] = {}  # rank -> the last step written to its ring (or skipped: it had it)
        self.truncated = 0
        self.copied = 0  # samples copied out of the loader rings (inputs.py), published
        self.skip: dict[int, int] = {}
        # transformation reordering: the deferred half of a source's transform runs here
        self.decoders = {
            i: (decode, resolve(decode))
            for i, src in enumerate(layout.stream_source)
            if (decode := job.sources[src].decode)
        }
        self.stash: dict[tuple[int, int, int], tuple[int, dict[str, np.ndarray], str]] = {}  # samples of later steps
        self.dropped = 0  # duplicate records seen (after a restart)
        self._ahead: list[Reshard] = []  # reshard records read, not yet in effect (`_grow`)
        self._turn = 0

    def _grow(self, plan) -> None:
        """Know the streams of the reshards that take effect by `plan`'s step (from the
        planner checkpoint after it): which loader process serves each one first, and
        its source's deferred decode. A plan that made a reshard is still the retired
        streams': the record read with it is kept for the next plan, not read again."""
        if not any(r.generation == plan.generation for r in self._ahead):
            self._ahead = reshards_of(Checkpoints(self.keys).load(self.r, plan.step + 1))
        self.layout = self.layout.grown([r for r in self._ahead if r.step <= plan.step])
        self._ahead = [r for r in self._ahead if r.generation > self.layout.generation]
        for i, src in enumerate(self.layout.stream_source):
            if i not in self.decoders and (decode := self.job.sources[src].decode):
                self.decoders[i] = (decode, resolve(decode))

    def _start(self) -> int:
        """The first step to build: the job's (or the resume's), or after a restart the
        first step its trainers may not have read whole, whose samples the loaders are
        asked to replay."""
        point = resume_point(self.r, self.keys)
        first = point[0] if point else 0
        if self.restarted:
            step = int(
                self.r.eval(
                    _RESTART,
                    2,
                    self.keys.progress,
                    self.keys.progressed,
                    consumed_field(self.dp),
                    built_field(self.dp),
                    replay_field(self.dp),
                    first,
                    self.owner.me,
                    BUILT,
                    self.dp,
                    PROGRESSED_VALUE,
                    STREAM_MAXLEN,
                    self.owner.field,
                )
            )
            log.warning("DataConstructor dp=%d restarted at step %d; asked the loaders for a replay", self.dp, step)
            # every step before `step` was built (into a ring this process may never see: on
            # another node, its sidecar dead); an empty ring of ours then counts as read up
            # to there (marks.py), so the Planner's bound on the trainers cannot wait on a
            # mark nobody is left to publish
            for rank in self.outputs:
                self.written.setdefault(rank, step - 1)
            return step
        self.owner.claim()
        # on a resume, micro-batches of the first steps a rank had already consumed
        raw = self.r.hgetall(self.keys.resume) if point else {}
        self.skip = skips(raw, self.outputs)
        return first

    def run(self) -> None:
        step = self._start()
        marks = MarkWatch(
            self.job, self.dp, self.r, self.keys, self.outputs, self.written, self.owner, self.on_superseded
        ).start()
        try:
            while not self.stop.is_set():
                plan = wait_plan(
                    self.r, self.keys, step, self.stop, self.job.timeout_s, beat=self.beat, shared=self.plans
                )
                receivers = constructor_do_plan(plan, self.job.mesh, self.dp)  # rank -> bucket
                buckets = sorted(set(receivers.values()))
                bins = self.job.batch.micro_batches
                batches = {(b, mb): plan.micro_batch(b, mb) for b in buckets for mb in range(bins)}
                wanted = [item for items in batches.values() for item in items]
                if plan.encoder_items is not None:
                    wanted += [item for rank in receivers for item in map(tuple, plan.encoder_rows(rank).tolist())]
                if plan.generation > self.layout.generation:  # a reshard's streams (overlord.runtime.reshard)
                    self._grow(plan)
                samples = self._collect(plan.step, wanted, plan.loader_of(self.layout.loader_of))
                self._build(plan, receivers, buckets, batches, samples)
                del samples  # its leases end: the loaders get this step's ring space back
                if not self.outputs:
                    log.info("DataConstructor dp=%d: every client left; idle until the sidecar stops", self.dp)
                    self.stop.wait()
                    return
                pipe = self.r.pipeline(transaction=False)
                self.owner.write(built_field(self.dp), plan.step, entry=built_entry(self.dp, plan.step), client=pipe)
                if self.truncated:
                    pipe.hset(self.keys.counters, truncated_field(self.dp), self.truncated)
                copied = sum(i.copies for rings in self.inputs for i in rings[:1])
                if copied > self.copied:  # a count across restarts of the group's constructor
                    pipe.hincrby(self.keys.counters, copied_field(self.dp), copied - self.copied)
                    self.copied = copied
                try:
                    done = pipe.execute()[0]
                except redis.exceptions.NoScriptError:  # the server lost its scripts (restarted, failed over)
                    self.owner.write(built_field(self.dp), plan.step, entry=built_entry(self.dp, plan.step))
                    done = 1  # the counters went out with the pipeline: the mark alone again
                check(done, self.dp)
                step += 1
                if plan.last:
                    for ring in self.outputs.values():
                        ring.close_writer()
                    return
        finally:
            marks.stop()
            for ring in [*(i for rings in self.inputs for i in rings), *self.outputs.values()]:
                ring.close()

    def _build(self, plan, receivers: dict[int, int], buckets: list[int], batches: dict, samples: dict) -> None:
        """Pack the step's micro-batches from its samples and write each to its ranks."""
        bins = self.job.batch.micro_batches
        transform = pack if self.job.batch.packing else pad
        encoded = self._encoder_batches(plan, receivers, samples) if plan.encoder_items is not None else {}
        # a plan without a sample only ends the job (see overlord.plan.dgraph): no rank
        # is ever handed an empty micro-batch
        for mb in range(bins if plan.samples() else 0):
            for b in buckets:
                batch_samples = [samples[item] for item in batches[b, mb]]
                arrays, truncated = transform([a for a, _ in batch_samples], self.job.batch.context_length)
                self.truncated += truncated
                if plan.encoder_items is not None:  # the pixels travel to their encoder ranks instead
                    arrays.pop("pixel_values", None)
                meta = {
                    "step": plan.step,
                    "microbatch": mb,
                    "dp": self.dp,
                    "bucket": b,
                    "keys": [k for _, k in batch_samples],
                    "last": plan.last and mb == self.job.batch.micro_batches - 1,
                }
                cp_parts: dict[int, dict[str, np.ndarray]] = {}
                for rank in [r for r, rb in receivers.items() if rb == b]:
                    out = self._for_rank(arrays, rank, plan, cp_parts)
                    if mb == 0 and rank in encoded:  # the step's images this rank encodes
                        out = {**out, **encoded[rank]}
                    self._deliver(rank, out, meta)

    def _for_rank(self, arrays: dict[str, np.ndarray], rank: int, plan, cp_parts: dict) -> dict[str, np.ndarray]:
        """The parallelism transform: what this rank's role needs of the micro-batch.

        With the DP axis, the CP ranks of the group share the micro-batch and each gets
        its zigzag slice (computed once per CP rank, shared by its TP peers); with the
        CP or WORLD axis every rank already has samples of its own. Then PP keeps the
        stage's fields and, under broadcast at TP, ranks tp > 0 get only a marker.
        """
        mesh = self.job.mesh
        c = mesh.coords(rank)
        part = arrays
        if plan.axis == "DP" and mesh.cp > 1:
            if c["cp"] not in cp_parts:
                cp_parts[c["cp"]] = cp_split(arrays, mesh.cp, c["cp"])
            part = cp_parts[c["cp"]]
        part = pp_stage(part, mesh.pp, c["pp"], self.job.batch.micro_batches)
        return tp_marker(part, c["tp"], broadcast="TP" in plan.broadcast)

    def _encoder_batches(self, plan, receivers, samples) -> dict[int, dict[str, np.ndarray]]:
        """Per rank: the images it encodes this step and where each one's embeddings go.

        encoder_pixel_values uint8 [patches, 768], encoder_image_grid int32 [images, 2],
        encoder_dest int32 [images, 4] = (bucket, micro-batch, document, image in document).
        """
        dest = encoder_destinations(plan)
        out = {}
        for rank in receivers:
            pix, grid, where = [], [], []
            for item in map(tuple, plan.encoder_rows(rank).tolist()):
                arrays = samples[item][0]
                g = np.asarray(arrays["image_grid"], dtype=np.int32).reshape(-1, 2)
                pix.append(arrays["pixel_values"].reshape(len(arrays["pixel_values"]), -1))
                grid.append(g)
                where += [(*dest[item], i) for i in range(len(g))]
            out[rank] = {
                "encoder_pixel_values": np.concatenate(pix) if pix else np.zeros((0, 768), np.uint8),
                "encoder_image_grid": np.concatenate(grid) if grid else np.zeros((0, 2), np.int32),
                "encoder_dest": np.asarray(where, dtype=np.int32).reshape(-1, 4),
            }
        return out

    def _deliver(self, rank: int, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Write one micro-batch to a client; a client that exited is dropped."""
        ring = self.outputs.get(rank)
        if ring is None:
            return
        if self.skip.get(rank):
            # this rank consumed it before the resume: written and read, as far as the
            # rank's mark goes (MarkWatch). Unmarked, a rank that skipped every step the
            # Planner had planned ahead held the job's bound, and the Planner the step
            # it waited for
            self.skip[rank] -= 1
            self.written[rank] = meta["step"]
            return
        try:
            push(ring, arrays, meta, self.stop, self.beat)
            self.written[rank] = meta["step"]
        except PeerDied as exc:
            log.warning("DataConstructor dp=%d: %s; no longer writing to rank %d", self.dp, exc, rank)
            del self.outputs[rank]
            ring.close()

    def _collect(
        self, step: int, items, serving: list[int]
    ) -> dict[tuple[int, int, int], tuple[dict[str, np.ndarray], str]]:
        """Read this step's planned samples (`items`) from the loader rings (`serving`:
        the loader process of each stream this step, as its plan says)."""
        wanted = set(items)
        got: dict[tuple[int, int, int], tuple[dict[str, np.ndarray], str]] = {}
        for ident in [i for i, (t, _, _) in self.stash.items() if t <= step]:
            t, arrays, key = self.stash.pop(ident)
            if t == step and ident in wanted:
                got[ident] = (arrays, key)
        owed = [0] * len(self.inputs)
        for ident in wanted - set(got):
            owed[serving[ident[0]]] += 1
        deadline = time.monotonic() + self.job.timeout_s
        while any(owed):
            self._replay_if_broken(step)
            progressed = False
            for k, rings in enumerate(self.inputs):
                for ring in rings:
                    while owed[k] and (record := ring.try_read()) is not None:
                        owed[k] -= self._take(step, k, record, wanted, got)
                        progressed = True
            if progressed:
                deadline = time.monotonic() + self.job.timeout_s
                continue
            if self.stop.is_set():
                raise Stopped()  # stopped mid-step (moving to another node, or shutting down)
            self.beat()
            if time.monotonic() > deadline:
                waiting = [k for k, n in enumerate(owed) if n]
                if all(alive_within(self.r, self.keys, "loader", k, self.job.timeout_s) for k in waiting):
                    deadline = time.monotonic() + self.job.timeout_s  # loaders back-pressured, not hung
                    continue
                raise PlanError(
                    f"DataConstructor dp={self.dp} waited {self.job.timeout_s:g}s for step {step} samples "
                    f"from loader process(es) {waiting}, whose loops have not turned for as long (hung or dead); "
                    "see their logs, or raise Job.timeout_s"
                )
            # nothing ready anywhere: sleep on the input that owes the most (a futex wait;
            # with a bridge too, the two are polled in turn)
            k = max(range(len(owed)), key=owed.__getitem__)
            rings = self.inputs[k]
            ring = rings[self._turn % len(rings)]
            self._turn += 1
            try:
                record = ring.read(timeout=_WAIT_S / len(rings))
            except RingTimeout:
                continue
            except PeerDied:
                time.sleep(_WAIT_S / len(rings))  # its loader process died: the sidecar starts another (or its shadow)
                continue
            owed[k] -= self._take(step, k, record, wanted, got)
        return got

    def _replay_if_broken(self, step: int) -> None:
        """A bridge's stream broke (records in transit may be lost): ask the loaders to
        send again every step from the one being collected (not from c<dp>: samples of
        this step and later ones may have been in transit); at most one request every
        REPLAY_GAP_S (overlord.remote.bridge.Breaks)."""
        if self.breaks.owed():
            self.owner.write(replay_field(self.dp), replay_request(os.getpid(), step))

    def _decoded(self, meta: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Apply the source's deferred decode (`Source.decode`), if it has one."""
        decoder = self.decoders.get(meta["s"])
        if decoder is None:
            return arrays
        spec, fn = decoder
        try:
            out = fn(arrays)
            if not isinstance(out, dict) or not all(isinstance(v, np.ndarray) for v in out.values()):
                raise TypeError(f"returned {type(out).__name__}; a decode must return dict[str, numpy.ndarray]")
            return out
        except Exception as exc:  # noqa: BLE001 - any user decode failure names its sample
            source, file, row = meta["k"].rsplit(":", 2)
            raise SourceReadError(
                f"source {source!r} file {self.job.sources[self.layout.stream_source[meta['s']]].files()[int(file)]!r} "
                f"row {row}: decode {spec} raised {type(exc).__name__}: {exc}. Fix the data or Source.decode"
            ) from exc

    def _take(self, step: int, loader: int, record, wanted, got) -> int:
        """Check a sample record against the plan and keep it (views over the record,
        see inputs.py); 1 if it was one this step still needed, 0 for a duplicate or a
        later step's sample."""
        arrays, meta = decode_batch(record)
        ident, t = (meta["s"], meta["e"], meta["q"]), meta["t"]
        needed = 0
        if t > step:
            self.stash[ident] = (t, self._decoded(meta, arrays), meta["k"])
        elif t < step or ident in got:
            self.dropped += 1  # sent again after a restart
        elif ident not in wanted:
            raise PlanError(
                f"DataConstructor dp={self.dp} step {step}: loader process {loader} sent "
                f"{meta['k']} (step {t}), which this step did not plan; this is a bug"
            )
        else:
            got[ident] = (self._decoded(meta, arrays), meta["k"])
            needed = 1
        return needed
