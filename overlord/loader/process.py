"""A Source Loader process: hosts several Source Loaders (streams) and serves plans.

Loop: serve every published plan in step order (pop the planned samples from the
read buffers and write them to the rings of their Data Constructors), then top up
each stream's bounded read buffer by one chunk and report its metadata; when neither
has work, block on the plans stream. Serving comes first so trainers never wait on a
buffer refill that is not needed yet.
"""

from __future__ import annotations

import logging

from overlord.errors import PlanError, RingFullError
from overlord.loader.source_loader import Prepared, SourceLoader
from overlord.planner import meta
from overlord.planner.lowlevel import loader_do_plan
from overlord.shm import Ring
from overlord.sidecar.flow import Stopped, fetch_plan, push, resume_point
from overlord.sidecar.layout import sample_ring

log = logging.getLogger("overlord.loader")

CHUNK = 64  # samples prepared per stream between two looks at the plans


def run_loader(ctx) -> None:
    job, r, keys, layout = ctx.job, ctx.r, ctx.keys, ctx.layout
    hosted = [i for i, owner in enumerate(layout.loader_of) if owner == ctx.index]
    loaders: dict[int, SourceLoader] = {}
    for i in hosted:
        src = job.sources[layout.stream_source[i]]
        partition = int(layout.streams[i].rsplit(".", 1)[1])
        loaders[i] = SourceLoader(src, partition, seed=job.seed, epochs=job.epochs)
    buffers: dict[int, dict[tuple[int, int], Prepared]] = {i: {} for i in hosted}
    reported_final = {i: False for i in hosted}
    rings = []
    for dp in range(job.mesh.dp):
        ring = Ring.attach(sample_ring(job, ctx.index, dp), timeout=job.timeout_s)
        ring.claim_producer()
        rings.append(ring)
    log.info("hosting streams %s", [layout.streams[i] for i in hosted])

    low_water = max(1, job.buffer_samples // 2)
    demand: dict[str, int] = {}  # stream -> samples the Planner needs it to hold (beyond the bound)
    step = _resume(r, keys, layout, loaders, buffers)
    try:
        while not ctx.stop.is_set():
            ctx.beat()
            plan = fetch_plan(r, keys, step)
            if plan is not None:
                _serve(ctx, plan, buffers, rings)
                step += 1
                if plan.last:
                    return
                continue
            filled = False
            pipe = r.pipeline(transaction=False)  # one round trip for every chunk of this pass
            for i, loader in loaders.items():
                # refill only below the low-water mark, so a step that takes one sample
                # from each of many streams does not cost one Redis write per stream
                wanted = demand.get(layout.streams[i], 0)
                room = max(job.buffer_samples, wanted) - len(buffers[i])
                if reported_final[i] or room <= 0 or (room < low_water and wanted <= len(buffers[i])):
                    continue
                samples, ended = loader.prepare(min(CHUNK, room))
                for s in samples:
                    buffers[i][(s.epoch, s.seq)] = s
                chunk = meta.MetaChunk(
                    epoch=samples[0].epoch if samples else loader.epoch,
                    seq=[s.seq for s in samples],
                    tokens=[s.tokens for s in samples],
                    patches=[s.patches for s in samples],
                    nbytes=[s.nbytes for s in samples],
                    ended=ended,
                    final=loader.finished,
                )
                pipe.xadd(keys.meta(layout.streams[i]), meta.encode(chunk), maxlen=job.buffer_samples + 64, approximate=True)
                reported_final[i] = loader.finished
                if loader.skipped:
                    pipe.hset(keys.counters, f"skipped:{loader.source.name}.{loader.partition}", loader.skipped)
                filled = True
            pipe.execute()
            if not filled:
                r.xread({keys.plans: f"{step}-0"}, block=200, count=1)
                demand = {k.decode(): int(v) for k, v in r.hgetall(keys.demand).items()}
    except Stopped:
        return
    finally:
        for ring in rings:
            ring.close()


def _resume(r, keys, layout, loaders, buffers) -> int:
    """On a resume, start every stream after its planner cursor and re-prepare the
    samples the checkpoint deferred (they sit behind the cursor); returns the first step."""
    point = resume_point(r, keys)
    if point is None:
        return 0
    step, state = point
    for i, loader in loaders.items():
        epoch, seq = state["cursors"][layout.streams[i]]
        loader.start_at(epoch, seq + 1)
    deferred: dict[tuple[int, int], list[int]] = {}
    for stream, epoch, seq, *_ in state["deferred"]:
        if stream in loaders:
            deferred.setdefault((stream, epoch), []).append(seq)
    for (stream, epoch), seqs in deferred.items():
        for sample in loaders[stream].prepare_at(epoch, seqs):
            buffers[stream][(sample.epoch, sample.seq)] = sample
    log.info("resuming at step %d after the planner's cursors (%d deferred samples re-read)",
             step, sum(len(v) for v in deferred.values()))
    return step


def _serve(ctx, plan, buffers, rings) -> None:
    """Send this process's samples of `plan` to their Data Constructors, in plan order."""
    sends = loader_do_plan(plan, ctx.job.mesh, set(buffers))
    for dp, bucket, mb, (stream, epoch, seq) in sends:
        sample = buffers[stream].get((epoch, seq))
        if sample is None:
            raise PlanError(
                f"plan {plan.step} asks stream {ctx.layout.streams[stream]!r} for epoch {epoch} seq {seq}, "
                "which is not in its read buffer (planner and loader disagree; this is a bug)"
            )
        record_meta = {"s": stream, "e": epoch, "q": seq, "k": sample.key, "t": plan.step, "b": bucket, "m": mb}
        try:
            push(rings[dp], sample.arrays, record_meta, ctx.stop, ctx.beat)
        except RingFullError as exc:
            source = ctx.job.sources[ctx.layout.stream_source[stream]].name
            raise RingFullError(
                f"sample {sample.key} from source {source!r} is {sample.nbytes} B, larger than the "
                f"loader-to-constructor ring (Job.sample_ring_bytes={ctx.job.sample_ring_bytes}); "
                "raise Job.sample_ring_bytes"
            ) from exc
    # a sample may go to two constructors (tokens and images apart): drop it once all are sent
    for _, _, _, (stream, epoch, seq) in sends:
        buffers[stream].pop((epoch, seq), None)
