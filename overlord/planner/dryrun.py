"""`overlord plan --dry-run`: what a job's strategy would do, without starting anything.

The job's Source Loaders run in this process (real files, real transforms) to get the
metadata of the first steps' samples; the Planner core plans those steps with the
job's strategy and with `vanilla` (round robin, what per-rank DataLoaders do), and the
attention cost model prices every DP rank's step. No sidecar, Redis or ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overlord.config import Job
from overlord.loader.source_loader import SourceLoader
from overlord.plan.core import PlannerCore, resolve_strategy
from overlord.plan.cost import transformer_cost
from overlord.plan.lowlevel import bucket_groups
from overlord.plan.meta import MetaChunk
from overlord.plan.schedule import from_config, mixing_unit
from overlord.plan.strategies import vanilla
from overlord.plan.tree import ClientPlaceTree
from overlord.runtime.layout import Layout


@dataclass(frozen=True, slots=True)
class DryRun:
    strategy: str
    steps: int
    rank_cost: np.ndarray  # [steps, dp] cost of each DP rank's step, with the job's strategy
    vanilla_cost: np.ndarray  # the same with round robin

    @property
    def imbalance(self) -> float:
        """Median over steps of max/mean DP-rank cost, job's strategy."""
        return float(np.median(self.rank_cost.max(1) / self.rank_cost.mean(1)))

    @property
    def vanilla_imbalance(self) -> float:
        return float(np.median(self.vanilla_cost.max(1) / self.vanilla_cost.mean(1)))

    @property
    def speedup(self) -> float:
        """Predicted step-time speedup over vanilla: the slowest rank gates each step."""
        return float(self.vanilla_cost.max(1).sum() / self.rank_cost.max(1).sum())

    def render(self) -> str:
        lines = [
            f"strategy {self.strategy}: {self.steps} steps, {self.rank_cost.shape[1]} DP ranks",
            f"imbalance (max/mean rank cost, median step): {self.imbalance:.3f}  (vanilla {self.vanilla_imbalance:.3f})",
            f"predicted step-time speedup over vanilla: {self.speedup:.2f}x",
            "mean cost per DP rank (strategy | vanilla), relative to the mean:",
        ]
        mean = self.rank_cost.mean()
        for d in range(self.rank_cost.shape[1]):
            lines.append(
                f"  dp {d:<4} {self.rank_cost[:, d].mean() / mean:6.3f} | {self.vanilla_cost[:, d].mean() / mean:6.3f}"
            )
        return "\n".join(lines)


def _core(job: Job, layout: Layout, strategy) -> PlannerCore:
    return PlannerCore(
        streams=layout.streams,
        stream_source=layout.stream_source,
        tree=ClientPlaceTree(job.mesh),
        schedule=from_config(job.mixing, [s.name for s in job.sources], [s.weight for s in job.sources]),
        strategy=strategy,
        seed=job.seed,
        global_batch=job.batch.global_batch,
        micro_batches=job.batch.micro_batches,
        context_length=job.batch.context_length,
        finite=job.epochs is not None,
        drop_last=job.batch.drop_last,
        mixing_unit=mixing_unit(job.mixing),
    )


def dry_run(job: Job, steps: int = 20) -> DryRun:
    """Plan the first `steps` steps of `job` with its strategy and with vanilla."""
    layout = Layout.plan(job)
    per_stream = max(64, 2 * steps * job.batch.global_batch // max(1, len(layout.streams)))
    chunks: list[tuple[int, MetaChunk]] = []
    for i, name in enumerate(layout.streams):
        src = job.sources[layout.stream_source[i]]
        loader = SourceLoader(
            src,
            int(name.rsplit(".", 1)[1]),
            seed=job.seed,
            epochs=job.epochs,
            context_length=job.batch.context_length,
            vocab_size=job.batch.vocab_size,
        )
        samples, ended = loader.prepare(per_stream)
        chunks.append(
            (
                i,
                MetaChunk(
                    epoch=samples[0].epoch if samples else 0,
                    seq=np.asarray([s.seq for s in samples], np.int64),
                    tokens=np.asarray([s.tokens for s in samples], np.int64),
                    patches=np.asarray([s.patches for s in samples], np.int64),
                    nbytes=np.asarray([s.nbytes for s in samples], np.int64),
                    ended=ended,
                    final=loader.finished,
                ),
            )
        )
    costs = []
    for strategy in (resolve_strategy(job.strategy), vanilla):
        core = _core(job, layout, strategy)
        for i, chunk in chunks:
            core.add(i, chunk)
        cap = job.batch.context_length  # the packer truncates longer documents
        tokens_of = {i: dict(zip(np.asarray(c.seq).tolist(), np.minimum(c.tokens, cap).tolist())) for i, c in chunks}
        rows = []
        for _ in range(steps):
            plan = core.plan_step()
            if plan is None:
                break
            rows.append(
                [
                    sum(
                        float(transformer_cost(np.asarray([tokens_of[s][q] for s, _, q in mb] or [0])).sum())
                        for mb in _group_of(plan, job, d)
                    )
                    for d in range(job.mesh.dp)
                ]
            )
        costs.append(np.asarray(rows))
    n = min(len(costs[0]), len(costs[1]))
    return DryRun(job.strategy, n, costs[0][:n], costs[1][:n])


def _group_of(plan, job: Job, dp: int):
    """Every micro-batch that DP group `dp` trains on in this plan."""
    groups = bucket_groups(plan, job.mesh)
    return [plan.micro_batch(b, m) for b in range(plan.n_buckets) if groups[b] == dp for m in range(plan.micro_batches)]
