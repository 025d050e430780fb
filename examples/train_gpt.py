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

import torch
from common import Block, demo_job, parse_args, setup_distributed, train
from torch import nn

from overlord.transforms import VOCAB_SIZE

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
    job = demo_job(args, "gpt", WEIGHTS, d.world, global_batch=16 * d.world, micro_batches=2, context_length=CONTEXT)
    torch.manual_seed(0)
    train(
        args,
        d,
        job,
        GPT().to(d.device),
        forward=lambda ddp, b: ddp(b["input_ids"], b["position_ids"]),
        count=lambda batch: int(batch["loss_mask"].sum()),
        unit="tokens",
    )


if __name__ == "__main__":
    main()
