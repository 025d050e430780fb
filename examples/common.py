"""What the training examples share: the distributed set-up, the Overlord job over the
demo corpus, the node's sidecar, the checkpoint (model + optimizer + loader together),
a per-batch record for checking resumption, the training loop, and a transformer block.

The checkpoint is the point of the examples: the loader's `state_dict()` (this rank's
position: step and micro-batch) is saved with the model and the optimizer, every rank's
in one file, and `load_state_dict()` on restart makes each rank continue at exactly its
next micro-batch with the bytes an uninterrupted run would have read. The sidecar is
started with `--resume` for that run: it continues from the Planner checkpoints its
embedded Redis keeps in the run directory (`<out>/overlord`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlord import BatchSpec, Job, Mesh, Source
from overlord.demo.corpus import IMAGE_TRANSFORM, TEXT_TRANSFORM, generate_corpus
from overlord.shm import list_segments
from overlord.sidecar.sidecar import sidecar_running
from overlord.torch import DataLoader, batch_digest


def parse_args(description: str, **defaults) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=Path(defaults["out"]), help="checkpoint, job config, run directory")
    p.add_argument("--data", type=Path, default=Path("demo-data/corpus"), help="demo corpus (made if missing)")
    p.add_argument("--steps", type=int, default=defaults["steps"], help="train until this many steps are done")
    p.add_argument("--ckpt-every", type=int, default=10, help="save a checkpoint every this many steps (0: never)")
    p.add_argument("--stop-after", type=int, default=0, help="exit after this many steps, as if preempted")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt if there is one")
    p.add_argument("--record", type=Path, help="append one JSON line per micro-batch to RECORD.rank<r>.jsonl")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--job-name", help="Overlord job name (default: derived from --out)")
    return p.parse_args()


# -- torch.distributed --------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def setup_distributed() -> Dist:
    """gloo on CPU, nccl on GPU; torchrun sets RANK, WORLD_SIZE and LOCAL_RANK."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        # one thread per rank and core: the same count every run keeps CPU kernels deterministic
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


# -- the Overlord job and its sidecar -------------------------------------------------------


def demo_job(args: argparse.Namespace, kind: str, weights: dict[str, float], world: int, **batch) -> Job:
    """The job over the demo corpus (`make demo`'s: three text sources and one image-text
    source), one data-parallel group per rank, reading the sources named in `weights`.
    Local rank 0 writes the corpus if it is missing."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        generate_corpus(args.data, seed=0, text_sources=3, image_sources=1)
    dist.barrier()
    corpus = generate_corpus(args.data, seed=0, text_sources=3, image_sources=1)  # complete now: just the paths
    out = args.out.resolve()
    sources = tuple(
        Source(
            name=name,
            paths=tuple(files),
            weight=weights[name],
            transform=IMAGE_TRANSFORM if name.startswith("images") else TEXT_TRANSFORM,
        )
        for name, files in corpus.items()
        if name in weights
    )
    return Job(
        # one name per output directory: two runs side by side get their own shm segments
        name=args.job_name or f"{kind}-{zlib.crc32(str(out).encode()):08x}",
        sources=sources,
        mesh=Mesh(dp=world),
        batch=BatchSpec(ring_bytes=4 << 20, **batch),
        seed=1234,
        run_dir=str(out / "overlord"),  # the embedded Redis keeps the Planner checkpoints here
        sample_ring_bytes=4 << 20,
        timeout_s=60.0,
    )


def start_sidecar(job: Job, out: Path, resume: bool) -> subprocess.Popen | None:
    """Local rank 0 starts this node's sidecar (as systemd would), the others wait for it.

    A DataLoader could spawn one by itself (`spawn_sidecar=True`); starting it here lets
    the run stop it and check that it cleaned up, and a resumed run never meets the last
    run's sidecar still on its way out. `--exit-when-idle` makes it leave by itself
    should the trainers die without stopping it. One node: the job declares no `nodes`.
    """
    proc = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        config = out / "job.json"
        config.write_text(job.to_json())
        with open(out / "sidecar.log", "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "overlord.cli",
                    "sidecar",
                    "--config",
                    str(config),
                    "--exit-when-idle",
                    *(["--resume"] if resume else []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + job.timeout_s
        while not sidecar_running(job):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start (exit code {proc.poll()}); see {out / 'sidecar.log'}")
            time.sleep(0.05)
    dist.barrier()
    return proc


def stop_sidecar(proc: subprocess.Popen | None, job: Job) -> None:
    """Stop the sidecar (it stops its roles and its redis-server) and check that no
    shared-memory segment of the job is left behind."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    left = list_segments(job.name)
    if left or code != 0:
        raise RuntimeError(f"sidecar exited with {code}; shared-memory segments left behind: {left}")
    print(f"sidecar stopped (exit code {code}); no shared-memory segment left", flush=True)


# -- checkpoint: model + optimizer + loader, together ---------------------------------------


def save_checkpoint(path: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loader) -> None:
    """Every rank's loader position goes into rank 0's file next to the model and optimizer."""
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())
    if dist.get_rank() == 0:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": states}, tmp
        )
        os.replace(tmp, path)  # a crash while saving keeps the previous checkpoint whole
    dist.barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader) -> int:
    """Restore the three before iterating; returns the number of steps already done."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    states = ckpt["loader"]
    # on another number of ranks any rank's state will do: it was taken at a step boundary
    loader.load_state_dict(states[dist.get_rank()] if len(states) == dist.get_world_size() else states[0])
    return int(ckpt["step"])


def check_position(loader, step: int, microbatch: int) -> None:
    """The loader's step numbering is the trainer's: a resumed run continues it."""
    got = (loader.last_meta["step"], loader.last_meta["microbatch"])
    if got != (step, microbatch):
        raise RuntimeError(f"expected step {step} micro-batch {microbatch}, the loader delivered {got}")


# -- a record of every batch, to compare runs ------------------------------------------------


class Recorder:
    """One JSON line per micro-batch: its position, a digest of its bytes (names, dtypes,
    shapes, data), its loss and how many images it held."""

    def __init__(self, path: Path | None, rank: int) -> None:
        self.fh = open(f"{path}.rank{rank}.jsonl", "a") if path else None  # a resumed run appends

    def __call__(self, step: int, microbatch: int, batch: dict[str, torch.Tensor], loss: float) -> None:
        if self.fh is None:
            return
        images = len(batch["image_grid"]) if "image_grid" in batch else 0
        self.fh.write(
            json.dumps(
                {"step": step, "microbatch": microbatch, "digest": batch_digest(batch), "loss": loss, "images": images}
            )
            + "\n"
        )
        self.fh.flush()


# -- model ----------------------------------------------------------------------------------


def train(args: argparse.Namespace, d: Dist, job: Job, model: nn.Module, forward, count, unit: str) -> None:
    """Train `model` on the job for args.steps steps, checkpointing model, optimizer and
    loader every args.ckpt_every steps, resuming from the checkpoint with --resume.

    Args:
        forward: (ddp model, micro-batch on the device) -> logits.
        count: micro-batch -> how many `unit`s it holds (for the rate printed).
    """
    ckpt_path = args.out / "checkpoint.pt"
    resume = args.resume and ckpt_path.exists()
    micro = job.batch.micro_batches
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ddp = DDP(model)
    sidecar = start_sidecar(job, args.out, resume)
    try:
        loader = DataLoader(job, spawn_sidecar=False, pin_memory=d.device.type == "cuda")
        start = load_checkpoint(ckpt_path, model, optimizer, loader) if resume else 0
        if d.rank == 0:
            print(
                f"job {job.name}: {d.world} ranks on {d.device.type}, steps {start}..{args.steps - 1}"
                + (" (resumed)" if resume else ""),
                flush=True,
            )
        record = Recorder(args.record, d.rank)
        batches = iter(loader)
        counted, started = 0, time.monotonic()
        for step in range(start, args.steps):
            for g in optimizer.param_groups:  # linear warm-up, a pure function of the step
                g["lr"] = args.lr * min(1.0, (step + 1) / 10)
            step_loss = torch.zeros((), device=d.device)
            for mb in range(micro):
                batch = next(batches)  # views into the ring: valid until the next one is read
                check_position(loader, step, mb)
                b = {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}
                # gradients are summed locally and all-reduced once, after the last micro-batch
                with ddp.no_sync() if mb < micro - 1 else contextlib.nullcontext():
                    logits = forward(ddp, b)
                    loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
                    (loss / micro).backward()
                record(step, mb, batch, loss.item())
                step_loss += loss.detach() / micro
                counted += count(batch)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                dist.all_reduce(step_loss)  # a sum: gloo has no average
                if d.rank == 0:
                    rate = counted / (time.monotonic() - started)
                    print(
                        f"step {done:4d}  loss {step_loss.item() / d.world:.4f}  {rate:,.1f} {unit}/s on rank 0",
                        flush=True,
                    )
            if args.ckpt_every and done % args.ckpt_every == 0:
                save_checkpoint(ckpt_path, done, model, optimizer, loader)
            if done == args.stop_after:
                if d.rank == 0:
                    print(f"stopping after step {done}, as if preempted", flush=True)
                break
        loader.close()
        dist.barrier()
    finally:
        stop_sidecar(sidecar, job)
        dist.destroy_process_group()


class Block(nn.Module):
    """A pre-norm transformer block; `mask` (bool, True = attend) broadcasts to [B, H, T, T]."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.ln2(x))
