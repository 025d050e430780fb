"""Train a tiny GPT on the demo corpus with `overlord.torch.DataLoader`, checkpoint the
model, the optimizer and the loader together, and resume at exactly the next batch.

    # CPU (gloo) or one GPU per rank (nccl), from the repository root:
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 40
    # preempted after 25 steps (the last checkpoint is at step 20) ...
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 40 --out demo-data/gpt-b --stop-after 25
    # ... and resumed: steps 20..39 read the same bytes as the uninterrupted run above
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 40 --out demo-data/gpt-b --resume

Each rank is one data-parallel group. A micro-batch is packed: several documents laid
end to end in rows of `context_length` tokens, `position_ids` restarting at each
document; attention stays inside a document (a block-diagonal causal mask built from
`position_ids`), and `labels` are -100 across document ends and padding. A training step
is the loader's step: `micro_batches` micro-batches, gradients accumulated, one
optimizer step. Local rank 0 starts the node's sidecar (`overlord sidecar`) and stops it
at the end; `--resume` starts it with `--resume` (see common.py).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (Block, Recorder, check_position, demo_job, load_checkpoint, parse_args, save_checkpoint,
                    setup_distributed, start_sidecar, stop_sidecar)
from overlord.transforms import VOCAB_SIZE
from overlord.torch import DataLoader

CONTEXT = 256
WEIGHTS = {"web": 0.4, "code": 0.3, "books": 0.3}  # the text sources only


class GPT(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, d)
        self.pos = nn.Embedding(CONTEXT, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # a new document starts where position_ids is 0: attend within it, causally
        doc = (position_ids == 0).cumsum(-1)
        T = input_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln(x) @ self.tok.weight.T  # tied input and output embeddings


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], out="demo-data/gpt", steps=40)
    d = setup_distributed()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "checkpoint.pt"
    resume = args.resume and ckpt_path.exists()
    job = demo_job(args, "gpt", WEIGHTS, d.world, global_batch=16 * d.world, micro_batches=2, context_length=CONTEXT)
    micro = job.batch.micro_batches

    torch.manual_seed(0)
    model = GPT().to(d.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ddp = DDP(model)
    sidecar = start_sidecar(job, args.out, resume)
    try:
        loader = DataLoader(job, spawn_sidecar=False, pin_memory=d.device.type == "cuda")
        start = load_checkpoint(ckpt_path, model, optimizer, loader) if resume else 0
        if d.rank == 0:
            print(f"job {job.name}: {d.world} ranks on {d.device.type}, steps {start}..{args.steps - 1}"
                  + (" (resumed)" if resume else ""), flush=True)
        record = Recorder(args.record, d.rank)
        batches = iter(loader)
        tokens, started = 0, time.monotonic()
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
                    logits = ddp(b["input_ids"], b["position_ids"])
                    loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
                    (loss / micro).backward()
                record(step, mb, batch, loss.item())
                step_loss += loss.detach() / micro
                tokens += int(batch["loss_mask"].sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                dist.all_reduce(step_loss)  # a sum: gloo has no average
                step_loss /= d.world
                if d.rank == 0:
                    rate = tokens * d.world / (time.monotonic() - started)  # rank 0's count x ranks
                    print(f"step {done:4d}  loss {step_loss.item():.4f}  {rate:,.0f} tokens/s", flush=True)
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


if __name__ == "__main__":
    main()
