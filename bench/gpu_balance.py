"""GPU benchmark: real forward+backward time of balanced vs vanilla micro-batches.

The simulation in `bench/balance.py` prices samples with a cost model; this measures
it. A small decoder-only transformer (bf16, `--layers` x `--hidden`) trains on packed
micro-batches with variable-length causal attention: each document attends only to
itself (`torch.nn.attention.varlen.varlen_attn`, FlashAttention's varlen kernel with
cu_seqlens), the rest of the model runs on the packed tokens.

Each simulated step draws a global batch of coyo-like documents (~98% <= 64 tokens, a
Pareto tail capped at the context length) and places them on `--dp` ranks x `--micro`
micro-batches two ways, on the same samples:

- vanilla: arrival order, round robin (what per-rank DataLoaders do);
- balanced: Overlord's `assign` (Karmarkar-Karp + refinement over ranks, greedy over
  micro-batches) on `transformer_cost` (the FLOP model, quadratic attention included);
- calibrated: the same on a cost model fitted to this GPU first (least squares of
  measured micro-batch ms on tokens, sum of squared document lengths, documents).

The ranks run one after another on the one GPU; a rank's step time is the sum of its
micro-batches' measured fwd+bwd times, and the step time is the slowest rank's (it
gates the gradient all-reduce). Prints one JSON line: per context length, measured and
model-predicted step-time speedup of balanced over vanilla, and the measured
max/mean rank imbalance of each.

    python bench/gpu_balance.py --json [--contexts 4096,8192,16384] [--steps 6]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlord.plan.balance import assign  # noqa: E402
from overlord.plan.cost import transformer_cost  # noqa: E402


def doc_lengths(rng: np.random.Generator, n: int, ctx: int) -> np.ndarray:
    """coyo-like: 98% lognormal clipped to 64 tokens, 2% Pareto tail up to the context."""
    body = np.clip(rng.lognormal(np.log(16), 0.8, n), 2, 64)
    tail = np.minimum(65 + 64 * rng.pareto(1.1, n), ctx)
    return np.where(rng.random(n) < 0.98, body, tail).astype(np.int64)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, h // self.heads).unbind(1)
        o = _varlen_causal(q, k, v, offsets, max_len)
        x = x + self.out(o.reshape(t, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _varlen_causal(q, k, v, offsets, max_len):
    """Causal attention of each document to itself: FlashAttention's varlen kernel."""
    from torch.nn.attention.varlen import varlen_attn

    offsets = offsets.to(torch.int32)
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, offsets, offsets, max_len, max_len, window_size=(-1, 0))
    return varlen_attn(q, k, v, offsets, offsets, max_len, max_len, is_causal=True)


class Model(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int = 32000) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, offsets, max_len)
        return F.cross_entropy(self.head(x).float(), ids)


def micro_batch_ms(model: Model, lengths: np.ndarray, device: str) -> float:
    """Measured fwd+bwd milliseconds of one packed micro-batch of these documents."""
    if len(lengths) == 0:
        return 0.0
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device, dtype=torch.int64)
    ids = torch.randint(4, 32000, (int(lengths.sum()),), device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model(ids, offsets, int(lengths.max())).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def step_times(model, lengths, bucket, mbin, dp, micro, device) -> np.ndarray:
    ranks = np.zeros(dp)
    for d in range(dp):
        for m in range(micro):
            ranks[d] += micro_batch_ms(model, lengths[(bucket == d) & (mbin == m)], device)
    return ranks


def calibrate(model: Model, ctx: int, rng: np.random.Generator, device: str, n: int = 48) -> tuple[np.ndarray, float]:
    """Fit measured micro-batch ms = a*tokens + b*sum(L^2) + c*docs + d (least squares).

    Returns:
        (coefficients [a, b, c, d], R^2 of the fit).
    """
    X, y = [], []
    for _ in range(n):
        fill = rng.uniform(0.1, 1.0) * ctx
        lengths = doc_lengths(rng, 4 * ctx // 16, ctx)
        if rng.random() < 0.3:  # some micro-batches of few long documents
            lengths = np.minimum(rng.integers(ctx // 8, ctx, 8), ctx)
        lengths = lengths[np.cumsum(lengths) <= fill] if lengths[0] <= fill else lengths[:1]
        micro_batch_ms(model, lengths, device)
        y.append(micro_batch_ms(model, lengths, device))
        X.append([lengths.sum(), float((lengths.astype(np.float64) ** 2).sum()), len(lengths), 1.0])
    X, y = np.asarray(X), np.asarray(y)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    r2 = 1 - ((X @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    return coef, float(r2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda"
    torch.manual_seed(args.seed)
    model = Model(args.layers, args.hidden, args.heads).to(device=device, dtype=torch.bfloat16)
    result = {
        "device": torch.cuda.get_device_name(),
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads},
        "dp": args.dp,
        "micro_batches": args.micro,
        "steps": args.steps,
        "contexts": {},
    }
    started = time.time()
    for ctx in map(int, args.contexts.split(",")):
        # a global batch that fills about one context per micro-batch on average
        rng = np.random.default_rng([args.seed, ctx])
        mean_len = doc_lengths(rng, 200_000, ctx).mean()
        samples = int(args.dp * args.micro * ctx * 0.9 / mean_len) // (args.dp * args.micro) * args.dp * args.micro
        micro_batch_ms(model, doc_lengths(rng, samples // (args.dp * args.micro), ctx), device)  # warm-up
        coef, r2 = calibrate(model, ctx, rng, device)
        rows = {"vanilla": [], "balanced": [], "calibrated": []}
        for _ in range(args.steps + 1):
            lengths = doc_lengths(rng, samples, ctx)
            costs = transformer_cost(lengths, hidden=args.hidden, layers=args.layers)
            # the profiled cost of a document (the per-micro-batch constant is the same on every rank)
            profiled = coef[0] * lengths + coef[1] * lengths.astype(np.float64) ** 2 + coef[2]
            i = np.arange(samples)
            layouts = {
                "vanilla": (i % args.dp, (i // args.dp) % args.micro),
                "balanced": assign(costs, args.dp, args.micro),
                "calibrated": assign(np.maximum(profiled, 0.0), args.dp, args.micro),
            }
            for name, (bucket, mbin) in layouts.items():
                measured = step_times(model, lengths, bucket, mbin, args.dp, args.micro, device)
                predicted = np.bincount(bucket, weights=costs, minlength=args.dp)
                rows[name].append((measured.max(), measured.max() / measured.mean(), predicted.max()))
        rows = {k: v[1:] for k, v in rows.items()}  # the first step warms kernels for new shapes
        v, b, c = rows["vanilla"], rows["balanced"], rows["calibrated"]
        result["contexts"][str(ctx)] = {
            "samples_per_step": samples,
            "cost_fit": {
                "ms_per_token": coef[0],
                "ms_per_token2": coef[1],
                "ms_per_doc": coef[2],
                "ms_per_microbatch": coef[3],
                "r2": round(r2, 4),
            },
            "measured_speedup": round(sum(r[0] for r in v) / sum(r[0] for r in b), 3),
            "measured_speedup_calibrated": round(sum(r[0] for r in v) / sum(r[0] for r in c), 3),
            "calibrated_imbalance": round(statistics.median(r[1] for r in c), 3),
            "calibrated_step_ms": round(statistics.median(r[0] for r in c), 1),
            "predicted_speedup": round(sum(r[2] for r in v) / sum(r[2] for r in b), 3),
            "vanilla_imbalance": round(statistics.median(r[1] for r in v), 3),
            "balanced_imbalance": round(statistics.median(r[1] for r in b), 3),
            "vanilla_step_ms": round(statistics.median(r[0] for r in v), 1),
            "balanced_step_ms": round(statistics.median(r[0] for r in b), 1),
        }
    result["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
