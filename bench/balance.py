"""Benchmark: load balancing of simulated training steps, and the Planner's balancing time.

No GPU, no processes: each step draws a global batch of samples, places them on DP
ranks x micro-batches with `overlord.plan.balance.assign`, and prices every rank
with `overlord.plan.cost`. What is measured:

- Sample distributions, for context lengths 4k, 8k, 16k (a document never exceeds it):
  - text (coyo-like): 98% of lengths lognormal (median 12 tokens) clipped to 1..64,
    2% Pareto (alpha 1.1) from 65 tokens up.
  - navit (image-text): 1-16 images per sample (geometric, mean 1.7), each with sides
    log-uniform in 64..1024 px and 16-px patches (16..4096 patches per image); the
    backbone sees 1 token per 2x2 patches plus a caption (lognormal median 8 tokens,
    1% tail to 256); trailing images are dropped, then the caption cut, until the
    document fits the context.
- Cost of a sample: vision encoder `sum encoder_cost(patches of each image)` (ViT,
  h=1024) + backbone `transformer_cost(tokens)` (h=4096). Both are per-layer FLOPs;
  with a 24-layer ViT and a 32-layer backbone the ratio would shift, not the method.
- Simulated step time = max over DP ranks of the sum of that rank's micro-batch costs
  (a micro-batch costs the sum of its samples: documents are packed with per-document
  attention), since the slowest rank gates the gradient all-reduce.
- Strategies, on the same samples:
  - vanilla: arrival order, round robin (`assign(mode="keep_order")`), as a plain
    per-rank DataLoader would; the encoder runs where its sample lands.
  - backbone: `assign` (Karmarkar-Karp over ranks + swap refinement, greedy over
    micro-batches) on the backbone cost only; the encoder runs where its sample lands.
  - hybrid: `assign` on the sum encoder + backbone cost of each sample, the shipped
    `strategies.vlm_hybrid`. Encoder and backbone run one after the other on the same
    rank, so under this step model balancing the per-sample sum is exact; a design
    that syncs between the two phases (step = max encoder + max backbone) would
    balance the images separately over all ranks (distribute("WORLD")) instead.
    For text, hybrid = backbone (no images).
- imbalance = max / mean per-rank cost (median over steps), 4096 samples over 64 DP
  ranks x 8 micro-batches. The top-level `imbalance` is hybrid on navit, worst over
  the three context lengths. `lower_bound` = max(largest sample, mean) / mean: no
  placement can do better.
- speedup_vs_vanilla = sum of vanilla step times / sum of hybrid step times (navit).
- planner_ms / planner_ms_p99 = p50 / p99 wall time of one whole Planner step
  (`PlannerCore.plan_step` with the shipped vlm_hybrid strategy, plus encoding the
  plan) at 64 ranks x 8 on navit 4k metadata, over `--planner-steps` steps;
  planner_ms_512dp / _p99 the same at 512 ranks x 8 with 16x the samples (65,536), over
  a third as many steps. planner_cpu_ms(_p99, _512dp, _512dp_p99) are the same steps'
  CPU time of this process (`time.process_time`): on a shared machine the wall time
  counts other processes' turns on the cores, the CPU time does not (the targets are
  for the wall time, on a machine otherwise idle). planner_imbalance(_512dp) is the
  max / mean per-rank cost of those plans (median over steps), planner_plan_bytes(_512dp)
  their encoded size.
  assign_ms / assign_ms_512dp time the balancer call alone.
  The process first sets up its allocator as the Planner process does
  (`overlord.heap.tune_planner`), so the steps timed are the Planner's.

Usage: python bench/balance.py [--json] [--seed 0] [--steps 5] [--planner-steps 60] [--png bench/out/balance.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from overlord.heap import tune_planner  # noqa: E402
from overlord.plan.balance import assign  # noqa: E402
from overlord.plan.cost import encoder_cost, transformer_cost  # noqa: E402

CONTEXTS = {"4k": 4096, "8k": 8192, "16k": 16384}
DP, MICRO, SAMPLES = 64, 8, 4096
PAPER = {"average": 1.77, "max": 4.54}


def text_lengths(rng: np.random.Generator, n: int, ctx: int) -> np.ndarray:
    """coyo-like token counts: 98% short (<= 64), 2% heavy Pareto tail up to `ctx`."""
    body = np.clip(np.rint(rng.lognormal(np.log(12), 0.6, n)), 1, 64)
    tail = np.rint(65 * (1 + rng.pareto(1.1, n)))
    return np.minimum(np.where(rng.random(n) < 0.02, tail, body), ctx)


def caption_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Captions, as `overlord.demo.corpus` draws them: short, 1% tail (alpha 1.5) to 256."""
    body = np.clip(np.rint(rng.lognormal(np.log(8), 0.5, n)), 1, 64)
    tail = np.minimum(np.rint(65 * (1 + rng.pareto(1.5, n))), 256)
    return np.where(rng.random(n) < 0.01, tail, body)


def navit_samples(rng: np.random.Generator, n: int, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """(encoder cost, backbone tokens) of n image-text samples fitted to `ctx` tokens."""
    images = np.minimum(rng.geometric(0.6, n), 16)
    owner = np.repeat(np.arange(n), images)
    sides = np.exp(rng.uniform(np.log(64), np.log(1024), (2, len(owner))))
    patches = np.ceil(sides[0] / 16) * np.ceil(sides[1] / 16)
    img_tokens = np.ceil(patches / 4)  # 2x2 patch merge before the backbone
    caption = caption_lengths(rng, n)
    # Running token count within each sample: keep the images that still fit the context.
    start = np.concatenate([[0], np.cumsum(images)[:-1]])
    running = np.cumsum(img_tokens) - np.repeat(np.cumsum(img_tokens)[start] - img_tokens[start], images)
    keep = running <= ctx - 1  # leave at least one caption token
    kept_tokens = np.bincount(owner[keep], weights=img_tokens[keep], minlength=n)
    enc = np.bincount(owner[keep], weights=encoder_cost(patches[keep]), minlength=n)
    tokens = kept_tokens + np.minimum(caption, ctx - kept_tokens)
    return enc, tokens


def rank_costs(costs: np.ndarray, bucket: np.ndarray, buckets: int) -> np.ndarray:
    on = bucket >= 0
    return np.bincount(bucket[on], weights=costs[on], minlength=buckets)


def simulate(dist: str, ctx: int, steps: int, seed: int) -> dict:
    """Per strategy: median imbalance, summed step time; plus a sample step's rank costs."""
    out = {s: {"imbalance": [], "step": []} for s in ("vanilla", "backbone", "hybrid")}
    bound, mb_imb, mb_bound, example = [], [], [], None
    for step in range(steps):
        rng = np.random.default_rng([seed, step, ctx, dist == "navit"])
        if dist == "navit":
            enc, tokens = navit_samples(rng, SAMPLES, ctx)
        else:
            enc, tokens = np.zeros(SAMPLES), text_lengths(rng, SAMPLES, ctx)
        bb = transformer_cost(tokens)
        total = enc + bb
        placed = {
            "vanilla": assign(total, DP, MICRO, mode="keep_order"),
            "backbone": assign(bb, DP, MICRO),
            "hybrid": assign(total, DP, MICRO),
        }
        per_rank = {}
        for name, (bucket, _mbin) in placed.items():
            if (bucket < 0).any():  # no capacity is set, so nothing may be deferred
                raise SystemExit(f"{name}: {int((bucket < 0).sum())} samples deferred")
            per_rank[name] = rank_costs(total, bucket, DP)
            out[name]["imbalance"].append(per_rank[name].max() / per_rank[name].mean())
            out[name]["step"].append(per_rank[name].max())
        bucket, mbin = placed["hybrid"]
        mb = np.bincount(bucket * MICRO + mbin, weights=total, minlength=DP * MICRO)
        mb_imb.append(mb.max() / mb.mean())
        mb_bound.append(max(total.max(), mb.mean()) / mb.mean())
        bound.append(max(total.max(), per_rank["hybrid"].mean()) / per_rank["hybrid"].mean())
        if example is None:
            example = per_rank
    res = {name: round(statistics.median(v["imbalance"]), 4) for name, v in out.items()}
    res["lower_bound"] = round(statistics.median(bound), 4)
    res["microbatch_imbalance_hybrid"] = round(statistics.median(mb_imb), 3)
    res["microbatch_lower_bound"] = round(statistics.median(mb_bound), 3)
    res["speedup_hybrid_vs_vanilla"] = round(sum(out["vanilla"]["step"]) / sum(out["hybrid"]["step"]), 3)
    res["speedup_backbone_vs_vanilla"] = round(sum(out["vanilla"]["step"]) / sum(out["backbone"]["step"]), 3)
    return {"summary": res, "example": example}


def time_assign(dp: int, samples: int, steps: int, seed: int) -> float:
    """Median ms of `assign` (KK inter + refine + greedy intra) on navit 4k hybrid costs."""
    ms = []
    for step in range(steps + 1):
        rng = np.random.default_rng([seed, step, dp])
        enc, tokens = navit_samples(rng, samples, CONTEXTS["4k"])
        costs = enc + transformer_cost(tokens)
        t0 = time.perf_counter()
        assign(costs, dp, MICRO)
        if step:  # the first call warms caches and imports
            ms.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ms)


def time_planner_step(dp: int, samples: int, steps: int, seed: int) -> dict:
    """One whole Planner step (`PlannerCore.plan_step` with the shipped `vlm_hybrid`
    strategy: selection, DGraph costs, assign, exactly-once check, plan) plus encoding
    the plan, `steps` times after a warm-up step: p50 and p99 ms (wall, and this
    process's CPU time), the plan's bytes, and
    the imbalance (max / mean per-DP-rank cost, median over steps) of the plans made."""
    from overlord.config import Mesh
    from overlord.plan.core import PlannerCore
    from overlord.plan.meta import MetaChunk
    from overlord.plan.strategies import vlm_hybrid
    from overlord.plan.tree import ClientPlaceTree

    n_src = 8
    core = PlannerCore(
        streams=[f"s{i}.0" for i in range(n_src)],
        stream_source=list(range(n_src)),
        tree=ClientPlaceTree(Mesh(dp=dp)),
        weights=[1.0] * n_src,
        seed=seed,
        global_batch=samples,
        micro_batches=MICRO,
        finite=False,
        strategy=vlm_hybrid,
    )
    rng = np.random.default_rng([seed, dp])
    per_stream = samples * (steps + 2) // n_src * 2
    cost = []
    for i in range(n_src):
        enc, tokens = navit_samples(rng, per_stream, CONTEXTS["4k"])
        patches = np.sqrt(enc / encoder_cost(1)).astype(np.int64)  # a stand-in patch count per sample
        cost.append(transformer_cost(tokens) + encoder_cost(patches))  # what vlm_hybrid balances
        core.add(i, MetaChunk(0, np.arange(per_stream), tokens.astype(np.int64), patches, tokens.astype(np.int64) * 4))
    costs = np.stack(cost)
    ms, cpu_ms, imbalance, nbytes = [], [], [], []
    for step in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = core.plan_step()
        raw = plan.encode()
        if step:  # the first call warms caches and imports
            ms.append(1e3 * (time.perf_counter() - t0))
            cpu_ms.append(1e3 * (time.process_time() - c0))
        per_rank = np.bincount(plan.bucket_of_rows(), weights=costs[plan.items[:, 0], plan.items[:, 2]], minlength=dp)
        imbalance.append(per_rank.max() / per_rank.mean())
        nbytes.append(len(raw))
    return {
        "p50": round(float(np.percentile(ms, 50)), 2),
        "p99": round(float(np.percentile(ms, 99)), 2),
        "cpu_p50": round(float(np.percentile(cpu_ms, 50)), 2),
        "cpu_p99": round(float(np.percentile(cpu_ms, 99)), 2),
        "imbalance": round(statistics.median(imbalance), 5),
        "plan_bytes": int(statistics.median(nbytes)),
        "steps": steps,
    }


def plot(examples: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(examples), figsize=(5 * len(examples), 3.6), sharey=True)
    for ax, (label, ex) in zip(np.atleast_1d(axes), examples.items()):
        mean = ex["hybrid"].mean()
        x = np.arange(DP)
        ax.bar(x - 0.2, ex["vanilla"] / mean, width=0.4, color="tab:red", label="vanilla (round robin)")
        ax.bar(x + 0.2, ex["hybrid"] / mean, width=0.4, color="tab:blue", label="hybrid (balanced)")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(label)
        ax.set_xlabel("DP rank")
    np.atleast_1d(axes)[0].set_ylabel("rank step cost / mean")
    np.atleast_1d(axes)[0].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Per-rank cost of one step: {SAMPLES} samples, {DP} DP ranks x {MICRO} micro-batches")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5, help="simulated steps to take medians over")
    ap.add_argument("--planner-steps", type=int, default=60, help="Planner steps timed at 64 DP (a third at 512)")
    ap.add_argument("--png", default=str(REPO / "bench" / "out" / "balance.png"))
    args = ap.parse_args()
    tune_planner()  # as the Planner process does before its first step

    by_dist: dict[str, dict] = {"navit": {}, "text": {}}
    examples = {}
    for dist in by_dist:
        for label, ctx in CONTEXTS.items():
            sim = simulate(dist, ctx, args.steps, args.seed)
            by_dist[dist][label] = sim["summary"]
            if dist == "navit":
                examples[f"navit {label}"] = sim["example"]
    navit = by_dist["navit"]
    small = time_planner_step(DP, SAMPLES, args.planner_steps, args.seed)
    large = time_planner_step(512, 16 * SAMPLES, max(5, args.planner_steps // 3), args.seed)
    result = {
        "imbalance": max(v["hybrid"] for v in navit.values()),
        "imbalance_target": 1.02,
        "planner_ms": small["p50"],
        "planner_ms_p99": small["p99"],
        "planner_ms_target": 5,
        "planner_cpu_ms": small["cpu_p50"],
        "planner_cpu_ms_p99": small["cpu_p99"],
        "planner_imbalance": small["imbalance"],
        "planner_plan_bytes": small["plan_bytes"],
        "planner_ms_512dp": large["p50"],
        "planner_ms_512dp_p99": large["p99"],
        "planner_ms_512dp_target": 50,
        "planner_cpu_ms_512dp": large["cpu_p50"],
        "planner_cpu_ms_512dp_p99": large["cpu_p99"],
        "planner_imbalance_512dp": large["imbalance"],
        "planner_plan_bytes_512dp": large["plan_bytes"],
        "planner_steps": [small["steps"], large["steps"]],
        "assign_ms": round(time_assign(DP, SAMPLES, args.steps, args.seed), 2),
        "assign_ms_512dp": round(time_assign(512, 16 * SAMPLES, args.steps, args.seed), 2),
        "speedup_vs_vanilla": {k: v["speedup_hybrid_vs_vanilla"] for k, v in navit.items()},
        "paper_speedup": PAPER,
        "strategies": by_dist,
        "config": {
            "samples": SAMPLES,
            "dp": DP,
            "micro_batches": MICRO,
            "steps": args.steps,
            "seed": args.seed,
            "inter": "karmarkar_karp+swap_refine",
            "intra": "greedy",
        },
        "png": plot(examples, Path(args.png)),
    }
    if args.json:
        print(json.dumps(result, separators=(",", ":")))
        return
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
