"""A Source Loader process: hosts several Source Loaders (streams) and serves plans.

Loop: serve every published plan in step order (pop the planned samples from the
read buffers and write them to the rings of their Data Constructors), then top up
each stream's bounded read buffer by one chunk and report its metadata (a turn gives
way between streams to a plan published meanwhile: refill.py); when neither has work, block on the plans stream and the `demanded` stream in one XREAD. Serving
comes first so trainers never wait on a buffer refill that is not needed yet.

Demand. When a step needs more of a stream than its read buffer holds, the Planner
sets `demand` and adds a `demanded` entry carrying the same values, in one fenced
script: the entry wakes an idle loader at once (its wait on the plans stream alone
would end only when the idle block runs out: a shortage cost up to that much of the
pipeline). A process reads the hash and the stream's newest id in one MULTI when it
starts (a restart, or a shadow that is promoted later, misses no demand written
before), then only the entries after; the hash is read again after DEMAND_REFRESH_S
of idle waits with no entry, a backstop for entries a Redis failover lost.

Recovery. A sample sent for step t is kept until every Data Constructor has finished
step t and every trainer has read it (their `progress` c<dp> and t<dp>), so a restarted
Data Constructor can ask for a replay of every step its trainers may still need (`r<dp>`
in `progress`): what its predecessor built may be gone with it, on a node that died or
was cut off. A process runs in one of two modes:

- active: owns the rings to the Data Constructors and reports metadata.
- shadow (a Shadow Loader, `Source.shadow`): a hot standby that follows the same plans
  and holds the same read buffers, writing nothing. When the Planner promotes it (the
  active's heartbeat lapsed), it claims the rings, reports its read buffers (the
  Planner drops what it already knew) and replays to each Data Constructor the steps
  it has not finished, from memory: no file is read again.

Fencing. `active` names the one process that delivers a loader's samples (by pid and
node). An active process that sees another one named there (a cut-off node's loader
whose shadow was promoted on another node while Redis was out of its reach) stops at
once: it serves no further plan and reports nothing; the samples it sent before are
the same bytes as its successor's, and the Data Constructors drop those twice seen.

A process started after the job began (a restart, or a new shadow) rebuilds its read
buffers by replay from the planner checkpoint of the earliest unfinished step: reading
order is a pure function of (seed, epoch, partition), so cursors are enough.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import redis

from overlord.errors import PeerDied, PlanError, RingFullError, SourceReadError
from overlord.loader.hosting import Hosting
from overlord.loader.inflight import Deadline, Inflight, inflight_path
from overlord.loader.refill import SHADOW_BLOCK_MS, Pace, PlanWatch, RefillTurns, idle_ms
from overlord.loader.reports import Reports
from overlord.loader.source_loader import Prepared, SourceLoader
from overlord.plan.checkpoint import Checkpoints
from overlord.plan.lowlevel import loader_do_plan
from overlord.plan.step_plan import Plan
from overlord.plan.waiting import resume_point
from overlord.runtime.flow import Stopped, push
from overlord.runtime.layout import Layout, sample_ring
from overlord.runtime.readbuffer import ReadBudget
from overlord.shm import Ring, SampleMeta
from overlord.store.durable import Durability
from overlord.store.schema import (
    PLANNER_TOKEN,
    built,
    demanded_values,
    encode_active,
    plans_after,
    replay,
    unread,
)

log = logging.getLogger("overlord.loader")

CHUNK = 64  # samples prepared per stream between two looks at the plans

DEMAND_REFRESH_S = 1.0  # the `demand` hash is read again after this long without an entry

Item = tuple[int, int, int]  # (stream, epoch, seq)


class LoaderProcess:
    """The Source Loaders of loader process `ctx.index`, active or shadow (`ctx.role`)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        job, layout = ctx.job, ctx.layout
        self.job, self.r, self.keys = job, ctx.r, ctx.keys
        # reports reach a replica before the loader counts them sent: a failover loses
        # none of them (a report lost with a primary would leave the Planner waiting for
        # samples the loader believes reported)
        self.durable = Durability(self.r, timeout_s=job.redis_outage_s)
        self._table: Inflight | None = None  # the transforms' in-flight table, once run() made it
        self._deadline: Deadline | None = None
        self.reports = Reports(self.r, self.keys, list(layout.streams), self.durable)
        # the streams this process serves: the layout's, until a plan hands one over or
        # a reshard retires or makes some (hosting.py); the per-stream dicts are its own
        self.hosting = Hosting(job, self.r, self.keys, ctx.index, layout, self.reports, self._opened)
        self._pace = Pace(job.plan_ahead)
        self._turns = RefillTurns()
        self._plans = PlanWatch(self.r, self.keys, ctx.stop)  # started with the loop
        self.sent: dict[int, list] = {}  # step -> its sends, kept until every trainer read the step
        self.kept: dict[Item, Prepared] = {}  # samples of those steps
        self.active = ctx.role == "loader"
        self.me = encode_active(os.getpid(), job.node).encode()  # this process in `active`
        self.confirmed = False  # `active` named this process once (then another name there supersedes it)
        self.rings: list[Ring] = []
        self.broken: set[int] = set()  # DP groups whose constructor died: they get a replay
        self.replays: dict[int, bytes | None] = {}  # dp -> the replay request last handled
        self.skip_upto: dict[int, int] = {}  # dp -> steps it finished before this process started
        self.token: bytes | None = None  # the Planner's fencing token last seen
        self.demand: dict[str, int] = {}  # stream -> samples the Planner asked it to hold
        self.demanded = "0-0"  # the last `demanded` entry applied
        self._demand_read = 0.0  # monotonic: when the `demand` hash or an entry last told it
        self.idle_ms = idle_ms()
        self.last_step: int | None = None
        self.step = 0
        self.first = 0  # the job's first step (0, or the resume's)

    @property
    def layout(self) -> Layout:
        """The job's layout as this process has followed it (reshards grow it)."""
        return self.hosting.layout

    @property
    def loaders(self) -> dict[int, SourceLoader]:
        """The Source Loader of each stream this process hosts (hosting.py)."""
        return self.hosting.loaders

    @property
    def buffers(self) -> dict[int, dict[tuple[int, int], Prepared]]:
        """Each hosted stream's read buffer: prepared samples not yet sent."""
        return self.hosting.buffers

    @property
    def held_bytes(self) -> dict[int, int]:
        """Bytes of each hosted stream's read buffer."""
        return self.hosting.held_bytes

    @property
    def budgets(self) -> dict[int, ReadBudget]:
        """Each hosted stream's read-buffer budget."""
        return self.hosting.budgets

    def _opened(self, i: int) -> None:
        """Stream i was started while the process runs: watch its transforms."""
        if self._table is not None and self._deadline is not None:
            self._watch(i, self._table, self._deadline)

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        progress = self.r.hgetall(self.keys.progress)
        point = resume_point(self.r, self.keys)
        first = self.first = point[0] if point else 0
        done = {dp: built(progress, dp, first - 1) for dp in range(self.job.mesh.dp)}
        self.replays = {dp: replay(progress, dp) for dp in done}
        # from the first step a trainer may still need: a Data Constructor restarted
        # later asks for a replay from there (sends to the ones that built a step are skipped)
        self.step = min(min(done.values()) + 1, *(unread(progress, dp, first) for dp in done)) if done else first
        if self.step > 0:
            state = point[1] if point and self.step == first else Checkpoints(self.keys).load(self.r, self.step)
            self.hosting.grow(state, self.step, rebuild=False)  # the reshards before this step: their streams
            self.hosting.rebuild(self.step, state)
        self.skip_upto = done
        self._read_demand()
        self._plans.start(self.step)
        if self.active:
            self._claim_rings()
        log.info(
            "%s loader process %d at step %d hosting streams %s",
            "active" if self.active else "shadow",
            self.ctx.index,
            self.step,
            [self.layout.streams[i] for i in sorted(self.loaders)],
        )

    def _read_demand(self) -> None:
        """The `demand` hash and the newest `demanded` id, in one MULTI: an entry after
        that id is newer than the hash read here, an older one is in it."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.keys.demand)
        pipe.xrevrange(self.keys.demanded, count=1)
        demand, newest = pipe.execute()
        self.demand = demanded_values(demand)
        if newest:
            self.demanded = newest[0][0]
        self._demand_read = time.monotonic()

    def _wait(self) -> None:
        """Block until a plan is published or the Planner demands samples (at most the
        idle block); apply the demand entries read."""
        block = self.idle_ms if self.active else SHADOW_BLOCK_MS
        reply = self.r.xread(
            {self.keys.plans: plans_after(self.step), self.keys.demanded: self.demanded}, block=block, count=64
        )
        demanded = self.keys.demanded.encode()
        entries = [e for key, es in reply or [] if key == demanded for e in es]
        for entry_id, fields in entries:  # in the order the Planner wrote them: the newest wins
            self.demand.update(demanded_values(fields))
            self.demanded = entry_id
        if entries:
            self._demand_read = time.monotonic()
        elif not reply and time.monotonic() - self._demand_read > DEMAND_REFRESH_S:
            self._read_demand()

    def _claim_rings(self) -> None:
        for dp in range(self.job.mesh.dp):
            ring = Ring.attach(sample_ring(self.job, self.ctx.index, dp), timeout=self.job.timeout_s)
            ring.claim_producer()
            self.rings.append(ring)

    # -- loop --------------------------------------------------------------------------

    def run(self) -> None:
        ctx = self.ctx
        table = self._watch_transforms()
        try:
            self.start()
            while not ctx.stop.is_set():
                ctx.beat()
                if self.active and self.reports.journal_due():
                    self.reports.journal(self.loaders)
                if self.active and self.reports.stats_due():
                    self._publish_stats()
                pipe = self.r.pipeline(transaction=False)
                pipe.get(self.keys.plan(self.step))
                pipe.hgetall(self.keys.progress)
                pipe.hget(self.keys.planner, PLANNER_TOKEN)
                pipe.hget(self.keys.active, ctx.index)
                pipe.hgetall(self.keys.workers)
                raw_plan, progress, token, active_pid, workers = pipe.execute()
                if workers:
                    self._scale(workers)
                if not self.active and active_pid == self.me:
                    self._promote(progress)
                if self.active and active_pid == self.me:
                    self.confirmed = True
                elif self.active and self.confirmed and active_pid is not None:
                    self._superseded(active_pid)
                    return
                self._follow(progress)
                if token != self.token:
                    self.token = token
                    if self.active:
                        self._report_all()  # a new Planner knows only its checkpoint
                if self.last_step is not None and self.step > self.last_step:
                    if self._finished(progress):
                        return
                    ctx.stop.wait(0.05)
                    continue
                if raw_plan is not None:
                    plan = Plan.decode(raw_plan)
                    self._serve(plan)
                    self._pace.served(plan.step, time.monotonic())
                    self.step += 1
                    if plan.last:
                        self.last_step = plan.step
                    continue
                if not self._refill():
                    self._wait()
        except Stopped:
            return
        finally:
            if self.active:
                try:
                    self.reports.journal(self.loaders)
                except Exception:  # noqa: BLE001 - a profile is never worth failing the exit
                    pass
                try:  # the skip counters reach Redis even when a loader stops on them
                    self.reports.skips(self.loaders)
                except redis.RedisError:
                    pass
            for ring in self.rings:
                ring.close()
            for loader in self.loaders.values():
                loader.close()
            table.close()

    def _watch_transforms(self) -> Inflight:
        """Record what each transform thread is on (inflight.py), in a file the sidecar
        reads if this process dies, and fail the job naming a sample whose transform
        runs past its source's deadline."""
        ids = sorted(self.loaders)
        streams = [(self.loaders[i].source.name, self.loaders[i].paths) for i in ids]
        table = Inflight(inflight_path(self.ctx.run_dir, os.getpid()), streams)
        for k, i in enumerate(ids):
            self.loaders[i].inflight, self.loaders[i].stream_id = table, k
        deadline = Deadline(
            table,
            streams,
            [self.job.transform_deadline(self.loaders[i].source) for i in ids],
            [self.loaders[i].source.transform for i in ids],
            self._hung,
        )
        threading.Thread(target=deadline.run, args=(self.ctx.stop,), daemon=True, name="transform-deadline").start()
        self._table, self._deadline = table, deadline
        return table

    def _watch(self, i: int, table: Inflight, deadline: Deadline) -> None:
        """Watch the transforms of stream i, handed to this process while it runs."""
        loader = self.loaders[i]
        loader.inflight, loader.stream_id = table, table.add_stream(loader.source.name, loader.paths)
        deadline.streams.append((loader.source.name, loader.paths))
        deadline.deadlines.append(self.job.transform_deadline(loader.source))
        deadline.specs.append(loader.source.transform)

    def _hung(self, message: str) -> None:
        """A transform is stuck: report it and end the process (Python cannot stop the
        thread); the sidecar fails the job with this error, not a restart."""
        log.error("%s", message)
        self.ctx.report_error(SourceReadError(message))
        logging.shutdown()
        os._exit(1)

    def _finished(self, progress) -> bool:
        """After the last plan: stay (to serve replays) until every constructor is done."""
        last = self.last_step
        return last is not None and all(built(progress, dp, -1) >= last for dp in range(self.job.mesh.dp))

    def _follow(self, progress: dict) -> None:
        """Drop what every constructor has finished and every trainer read (a restarted
        constructor sets its mark back to before the step it restarts at, with its
        replay request, in one script: what it asks for is still here); serve replay
        requests."""
        dps = range(self.job.mesh.dp)
        finished = min((min(built(progress, dp, -1), unread(progress, dp, self.first) - 1) for dp in dps), default=-1)
        for t in [t for t in self.sent if t <= finished]:
            for _, _, _, item in self.sent.pop(t):
                self.kept.pop(item, None)
        for dp in range(self.job.mesh.dp):
            request = replay(progress, dp)
            if request == self.replays.get(dp):
                continue
            self.replays[dp] = request
            if self.active and request is not None:
                first = int(request.split(b":")[1])
                self.broken.discard(dp)
                # a constructor restarted just after this process read its built mark at
                # start: the steps this process skipped as built must now go out as served
                self.skip_upto[dp] = min(self.skip_upto.get(dp, -1), first - 1)
                self._replay(dp, first)

    def _replay(self, dp: int, first: int) -> None:
        """Send again to constructor `dp` every kept sample of steps >= `first`."""
        count = 0
        try:
            for t in sorted(t for t in self.sent if t >= first):
                for d, bucket, mb, item in self.sent[t]:
                    if d == dp:
                        self._push(t, d, bucket, mb, item, self.kept[item])
                        count += 1
        finally:
            self.rings[dp].wake()
        log.info("replayed %d sample(s) of steps >= %d to Data Constructor dp=%d", count, first, dp)

    def _superseded(self, successor: bytes) -> None:
        """Another process delivers this loader's samples now: stop, writing nothing more."""
        log.warning(
            "loader process %d (pid %d on node %r): superseded by %s in `active` (promoted while this one was "
            "out of reach); it stops delivering",
            self.ctx.index,
            os.getpid(),
            self.job.node,
            successor.decode(),
        )
        self.active = False  # nothing more from here: no journal, no counters, no heartbeat as the loader
        self.ctx.silent = True  # its heartbeat goes: the successor beats as the loader
        self.ctx.superseded = True  # exits SUPERSEDED: placed here again, the sidecar starts a new one

    def _promote(self, progress: dict) -> None:
        """Shadow -> active: claim the rings, report the read buffers, replay unfinished steps."""
        ctx = self.ctx
        log.warning("promoted: shadow of loader process %d becomes active at step %d", ctx.index, self.step)
        ctx.role = "loader"
        ctx.publish_heartbeat()
        shadow_key = self.keys.heartbeat("shadow", str(ctx.index))
        raw = self.r.get(shadow_key)
        if raw is not None and encode_active(json.loads(raw)["pid"], json.loads(raw)["node"]).encode() == self.me:
            self.r.delete(shadow_key)  # no longer a standby: the Planner must not promote this pid again
        self._claim_rings()
        self.active = self.confirmed = True
        self._report_all()
        for dp in range(self.job.mesh.dp):
            self.replays[dp] = replay(progress, dp)
            self._replay(dp, built(progress, dp, -1) + 1)
        self.skip_upto = {}

    # -- serving -----------------------------------------------------------------------

    def _serve(self, plan) -> None:
        """Send this process's samples of `plan` to their Data Constructors, in plan order.
        A plan that made a reshard (`Plan.generation`) is the retired streams' last: the
        new ones start after it, from the state its checkpoint holds. (A reshard made
        before the step this process started at is in the state `start` grew from; every
        later one is announced by a plan it serves.)"""
        self.hosting.handoffs(plan)
        sends = loader_do_plan(plan, self.job.mesh, set(self.buffers))
        samples = []
        took = dict.fromkeys(self.budgets, 0)
        for _, _, _, item in sends:  # a sample may go to two constructors (tokens and images apart)
            if item not in self.kept:
                self.kept[item] = self._take(plan.step, item)
                took[item[0]] += 1
            samples.append(self.kept[item])
        for i, n in took.items():  # what a step takes, measured: a mixing schedule moves it
            self.budgets[i].took(n)
        self.sent[plan.step] = sends
        if self.active:
            self._deliver(plan.step, sends, samples)
        if plan.generation > self.layout.generation:  # made after this step: the new streams start now
            self.hosting.grow(Checkpoints(self.keys).load(self.r, plan.step + 1), plan.step + 1)

    def _deliver(self, step: int, sends: list, samples: list[Prepared]) -> None:
        """Write a step's samples to the rings of their Data Constructors."""
        run = None  # the DP group of the run of records being written (sends are in plan order: by group)
        try:
            for (dp, bucket, mb, item), sample in zip(sends, samples):
                if dp in self.broken or step <= self.skip_upto.get(dp, -1):
                    continue  # finished before this process started, or sent again on a replay request
                if dp != run and run is not None:
                    self.rings[run].wake()  # its run is written: one wake-up for all of it
                run = dp
                self._push(step, dp, bucket, mb, item, sample)
        finally:
            for ring in self.rings:
                ring.wake()

    def _take(self, step: int, item: Item) -> Prepared:
        stream, epoch, seq = item
        sample = self.buffers[stream].pop((epoch, seq), None)
        if sample is None:
            self._prepare_through(stream, epoch, seq)
            sample = self.buffers[stream].pop((epoch, seq), None)
        if sample is None:
            raise PlanError(
                f"plan {step} asks stream {self.layout.streams[stream]!r} for epoch {epoch} seq {seq}, "
                "which its Source Loader does not hold (planner and loader disagree; this is a bug)"
            )
        self.held_bytes[stream] -= sample.nbytes
        return sample

    def _prepare_through(self, stream: int, epoch: int, seq: int) -> None:
        """Read on until (epoch, seq) is prepared: a rebuilt loader may be behind the plans."""
        loader = self.loaders[stream]
        while (loader.epoch, loader.seq) <= (epoch, seq) and not loader.finished:
            # no further than asked (a stream just handed over is read on the spot): the
            # refills read on in the next turns
            self._prepare(stream, min(CHUNK, seq - loader.seq + 1) if loader.epoch == epoch else CHUNK)
        self.reports.flush()

    def _push(self, step: int, dp: int, bucket: int, mb: int, item: Item, sample: Prepared) -> None:
        stream, epoch, seq = item
        record_meta = SampleMeta(stream, epoch, seq, sample.key, step, bucket, mb)  # no JSON per sample
        try:
            # woken by the caller after its run of records (Ring.commit): one wake-up a run
            push(self.rings[dp], sample.arrays, record_meta, self.ctx.stop, self.ctx.beat, wake=False)
        except PeerDied:
            # its Data Constructor died: the restarted one asks for a replay of what it lost
            log.warning("Data Constructor dp=%d died; holding its samples for a replay", dp)
            self.broken.add(dp)
        except RingFullError as exc:
            source = self.job.sources[self.layout.stream_source[stream]].name
            raise RingFullError(
                f"sample {sample.key} from source {source!r} is {sample.nbytes} B, larger than the "
                f"loader-to-constructor ring (Job.sample_ring_bytes={self.job.sample_ring_bytes}); "
                "raise Job.sample_ring_bytes"
            ) from exc

    # -- reading and reporting ---------------------------------------------------------

    def _refill(self) -> bool:
        """Top up every stream below its low-water mark by one chunk; True if any was."""
        pace = self._pace.known()
        if pace is not None:
            for budget in self.budgets.values():
                budget.pace(*pace)
        started = time.monotonic()

        def top_up(i: int) -> bool:
            # refill only below the low-water mark (in bytes, runtime/readbuffer.py), so
            # a step that takes one sample from each of many streams does not cost one
            # Redis write per stream; what the Planner asks for (`demand`) is read at once
            loader = self.loaders[i]
            wanted = self.demand.get(self.layout.streams[i], 0)
            room = 0 if loader.finished else self.budgets[i].room(len(self.buffers[i]), self.held_bytes[i], wanted)
            if room > 0:
                self._prepare(i, min(CHUNK, room))
            return room > 0

        # a plan published meanwhile is served before the rest of the turn (refill.py)
        filled = self._turns.turn(list(self.loaders), top_up, lambda: self._plans.published(self.step))
        self.reports.flush()
        if filled:
            self._pace.refilled(time.monotonic() - started)
        return filled

    def _prepare(self, i: int, limit: int) -> None:
        loader = self.loaders[i]
        samples, ended = loader.prepare(limit)
        for s in samples:
            self.buffers[i][(s.epoch, s.seq)] = s
            self.held_bytes[i] += s.nbytes
        self.budgets[i].observe(s.nbytes for s in samples)
        if self.active:
            self.reports.chunk(i, loader, samples, ended, loader.epoch, int(self.token or 0))

    def _report_all(self) -> None:
        """Report every unsent sample again, in order (the Planner keeps what is new)."""
        self.reports.all(self.buffers, self.loaders, int(self.token or 0))

    def _publish_stats(self) -> None:
        self.reports.stats(
            self.ctx.index,
            self.job.node,
            self.step,
            self.loaders,
            self.buffers,
            self.held_bytes,
            self.budgets,
            self.kept,
        )

    def _scale(self, workers: dict) -> None:
        """Run each stream's transforms on the workers the Planner's scaler set."""
        for i, loader in self.loaders.items():
            n = workers.get(self.layout.streams[i].encode())
            if n is not None and int(n) != loader.workers:
                log.info("stream %s: %d -> %d transform worker(s)", self.layout.streams[i], loader.workers, int(n))
                loader.set_workers(int(n))


def run_loader(ctx) -> None:
    LoaderProcess(ctx).run()
