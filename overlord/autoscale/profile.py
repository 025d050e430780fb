"""Profiling Source Loaders: what a sample of each source really costs.

Every Source Loader keeps running totals (`Profile`, overlord.loader.profile) and loader
processes journal them in Redis every few seconds; this module reads them as the costs
the autoscaler partitions by. The journal survives restarts of the job (the sidecar
keeps it), so the next start partitions from it; `measure` profiles a few samples in-process when there is none.
"""

from __future__ import annotations

from overlord.autoscale.partition import SourceCost
from overlord.loader.profile import Profile
from overlord.loader.source_loader import SourceLoader


def costs_from(profiles: dict[str, Profile], job) -> dict[str, SourceCost]:
    """Per-source costs from per-stream profiles (a source's partitions pooled); sources
    with no profiled sample are left out."""
    out = {}
    for src in job.sources:
        parts = [p for name, p in profiles.items() if name.rsplit(".", 1)[0] == src.name and p.samples]
        if not parts:
            continue
        n = sum(p.samples for p in parts)
        out[src.name] = SourceCost(
            name=src.name,
            weight=src.weight,
            transform_ms=1000 * sum(p.seconds for p in parts) / n,
            sample_kb=sum(p.out_bytes for p in parts) / n / 1024,
            state_mb=sum(p.state_bytes for p in parts) / 2**20,  # every partition's share, summed
        )
    return out


def journaled(r, keys) -> dict[str, Profile]:
    """The profiles in Redis, per stream."""
    return {k.decode(): Profile.from_json(v) for k, v in r.hgetall(keys.profile).items()}


def measure(job, samples: int = 64) -> dict[str, SourceCost]:
    """Profile `samples` samples of every source in this process (real files and transforms)."""
    profiles = {}
    for src in job.sources:
        loader = SourceLoader(
            src,
            0,
            seed=job.seed,
            epochs=job.epochs,
            context_length=job.batch.context_length,
            vocab_size=job.batch.vocab_size,
        )
        loader.prepare(min(8, samples))  # warm-up: imports, first file open
        loader.profile = Profile()
        loader.prepare(samples)
        loader.profile.state_bytes = max(loader.profile.state_bytes, loader.state_bytes())
        profiles[f"{src.name}.0"] = loader.profile
        loader.profile.state_bytes *= src.partitions  # one partition's state stands for each
    return costs_from(profiles, job)
