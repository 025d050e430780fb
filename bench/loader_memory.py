"""Where a Source Loader process's memory goes: many Source Loaders in one process.

Usage::

    .venv/bin/python bench/loader_memory.py --corpus bench/out/peers-corpus/s150-r2000-g256-seed0 --json

Builds (with the sidecar's heap settings, overlord/heap.py) one `SourceLoader` per source of a bench/peers_data.py corpus (the peers'
transform: tokenize, decode and resize images), as a loader process hosts them, and
runs them through `--steps` steps of the loader process's steady state without Redis:
each step takes the heads of the read buffers by a multinomial draw of ``--batch``
samples over the sources, keeps what it took for ``--keep-steps`` steps (what a loader
holds until every trainer read a step), then tops up every stream below its low-water
mark (runtime/readbuffer.py, the process's budgets). Prints ONE JSON line, the peak
over the steps of:

- ``rss_mb``, ``anon_mb``, ``file_mb``: /proc/self/smaps_rollup (``pss_mb`` too);
- ``arrow_mb``: pyarrow's pool (``pa.total_allocated_bytes``), ``arrow_pool``: its backend;
- ``window_mb``: decoded row groups the loaders hold (`SourceLoader.state_bytes`);
- ``buffered_mb`` / ``kept_mb``: prepared samples in read buffers / held for trainers;
- ``base_mb``: RSS after imports; ``built_mb``: after building the loaders (transforms, footers);
- ``end_anon_mb``: anonymous memory after the last step and a `heap.trim()`;
- with ``--tracemalloc``: ``python_mb``, Python objects' bytes (tracemalloc, slower).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from overlord import heap  # noqa: E402

heap.tune()  # as the sidecar does before it forks its roles
heap.use_system_arrow_pool()  # before pyarrow is imported, as the CLI does

import numpy as np  # noqa: E402
import peers_data  # noqa: E402
import pyarrow as pa  # noqa: E402

from overlord.config import Source  # noqa: E402
from overlord.loader.hosting import ring_max_record  # noqa: E402
from overlord.loader.process import CHUNK  # noqa: E402
from overlord.loader.source_loader import SourceLoader  # noqa: E402
from overlord.runtime.readbuffer import ReadBudget  # noqa: E402

MIB = 1 << 20


def smaps() -> dict[str, float]:
    """This process's smaps_rollup fields, in MiB."""
    out = {}
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--sources", type=int, default=0, help="first N sources (0: all)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=128, help="samples a step takes from this process's streams")
    p.add_argument("--job-batch", type=int, default=256, help="BatchSpec.global_batch (the budgets' draw)")
    p.add_argument("--job-sources", type=int, default=300, help="sources in the job (the budgets' draw)")
    p.add_argument("--keep-steps", type=int, default=8)
    p.add_argument("--plan-ahead", type=int, default=2)
    p.add_argument("--buffer-samples", type=int, default=64)
    p.add_argument("--buffer-bytes", type=int, default=64 << 20)
    p.add_argument("--shuffle-window", type=int, default=128)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--image-side", type=int, default=128)
    p.add_argument("--trim-every", type=int, default=10, help="steps between two heap.trim() (a role: 10 s)")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    if args.tracemalloc:
        tracemalloc.start()
    tok = args.corpus / "tokenizer" / "tokenizer.json"
    srcs = peers_data.sources_of(args.corpus)
    if args.sources:
        srcs = srcs[: args.sources]
    sources = [
        Source(
            name=s["name"],
            paths=tuple(s["files"]),
            transform="peers_data:Sample",
            transform_args=peers_data.sample_args(
                s, tok, context_length=args.context_length, image_side=args.image_side
            ),
            shuffle_window=args.shuffle_window,
        )
        for s in srcs
    ]
    started = time.monotonic()
    import overlord.transforms_hf  # noqa: F401  (what every loader process imports: in the base)

    base = smaps()["Rss"]
    loaders = []
    for src in sources:
        loaders.append(
            SourceLoader(
                src,
                0,
                seed=0,
                epochs=None,
                context_length=args.context_length,
                max_sample_bytes=ring_max_record(1 << 20),
            )
        )
    built = smaps()["Rss"]
    built_anon = smaps()["Anonymous"]
    budgets = [
        ReadBudget(
            draw=args.job_batch / args.job_sources,
            plan_ahead=args.plan_ahead,
            cap_bytes=args.buffer_bytes,
            cap_samples=args.buffer_samples,
        )
        for _ in loaders
    ]
    buffers: list[list] = [[] for _ in loaders]
    kept: list[list] = []
    rng = np.random.default_rng(0)
    peak: dict[str, float] = {}

    def refill() -> None:
        for i, ld in enumerate(loaders):
            held = sum(s.nbytes for s in buffers[i])
            room = budgets[i].room(len(buffers[i]), held, 0)
            if room > 0:
                samples, _ = ld.prepare(min(CHUNK, room))
                buffers[i].extend(samples)
                budgets[i].observe(s.nbytes for s in samples)

    def sample() -> None:
        m = smaps()
        now = {
            "rss_mb": m["Rss"],
            "pss_mb": m["Pss"],
            "anon_mb": m.get("Anonymous", 0.0),
            "file_mb": m.get("Pss_File", 0.0),
            "arrow_mb": pa.total_allocated_bytes() / MIB,
            "window_mb": sum(ld.state_bytes() - sum(f.nbytes for f in ld._files.values()) for ld in loaders) / MIB,
            "footers_mb": sum(sum(f.nbytes for f in ld._files.values()) for ld in loaders) / MIB,
            "buffered_mb": sum(s.nbytes for b in buffers for s in b) / MIB,
            "kept_mb": sum(s.nbytes for k in kept for s in k) / MIB,
        }
        if args.tracemalloc:
            now["python_mb"] = tracemalloc.get_traced_memory()[0] / MIB
        for k, v in now.items():
            peak[k] = max(peak.get(k, 0.0), v)

    refill()
    for step in range(args.steps):
        counts = rng.multinomial(args.batch, [1 / len(loaders)] * len(loaders))
        took = []
        for i, n in enumerate(counts):
            n = min(int(n), len(buffers[i]))
            took.extend(buffers[i][:n])
            del buffers[i][:n]
            budgets[i].took(n)
        kept.append(took)
        if len(kept) > args.keep_steps:
            kept.pop(0)
        refill()
        sample()
        if step % args.trim_every == args.trim_every - 1:
            heap.trim()  # what a role's heartbeat thread does every heap.TRIM_EVERY_S
    heap.trim()
    m = smaps()
    out = {
        "sources": len(loaders),
        "steps": args.steps,
        "base_mb": round(base, 1),
        "built_mb": round(built, 1),
        "built_anon_mb": round(built_anon, 1),
        **{k: round(v, 1) for k, v in peak.items()},
        "end_anon_mb": round(m.get("Anonymous", 0.0), 1),
        "arrow_pool": pa.default_memory_pool().backend_name,
        "arrow_pool_max_mb": round(pa.default_memory_pool().max_memory() / MIB, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
