"""Train a tiny VLM on the demo corpus with `overlord.torch.DataLoader`: a small
patch-embedding ViT turns each image into a few tokens that are prepended to its
caption's text tokens. Checkpoints and resumes like train_gpt.py.

    # CPU (gloo) or one GPU per rank (nccl), from the repository root:
    torchrun --standalone --nproc_per_node 2 examples/train_vlm.py --steps 30
    # preempted, then resumed from the last checkpoint (every --ckpt-every steps):
    torchrun --standalone --nproc_per_node 2 examples/train_vlm.py --steps 30 --out demo-data/vlm-b --stop-after 15
    torchrun --standalone --nproc_per_node 2 examples/train_vlm.py --steps 30 --out demo-data/vlm-b --resume

The job mixes the image-text source (`images`: JPEGs decoded by its Source Loader into
16x16 patches) with the three text sources. Micro-batches are padded, not packed: one
document per row (`attention_mask`), so an image's tokens go in front of its row. The
batch carries the images' patches concatenated (`pixel_values`, uint8 [patches, 768]),
each image's patch grid (`image_grid`, [images, 2]) and the row it belongs to
(`image_doc`); a micro-batch may hold no image at all, and then has none of the three.
"""

from __future__ import annotations

import torch
from common import Block, demo_job, parse_args, setup_distributed, train
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from overlord.transforms import MAX_SIDE, PATCH, VOCAB_SIZE

CONTEXT = 128  # text tokens per row
IMAGE_TOKENS = 8  # tokens per image handed to the language model
WEIGHTS = {"images": 0.5, "web": 0.2, "code": 0.15, "books": 0.15}


class ImageEncoder(nn.Module):
    """Patches -> linear embedding + 2-D position -> one transformer block over each
    image's patches -> `IMAGE_TOKENS` learned queries attend to them (a resampler)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH * PATCH * 3, d)
        self.row, self.col = nn.Embedding(MAX_SIDE // PATCH, d), nn.Embedding(MAX_SIDE // PATCH, d)
        self.block = Block(d, heads)
        self.queries = nn.Parameter(torch.randn(IMAGE_TOKENS, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, pixel_values: torch.Tensor, image_grid: torch.Tensor) -> torch.Tensor:
        grid = image_grid.tolist()
        dev = pixel_values.device
        rows = torch.cat([torch.arange(h, device=dev).repeat_interleave(w) for h, w in grid])
        cols = torch.cat([torch.arange(w, device=dev).repeat(h) for h, w in grid])
        x = self.patch(pixel_values.float() / 127.5 - 1) + self.row(rows) + self.col(cols)
        counts = [h * w for h, w in grid]
        x = pad_sequence(x.split(counts), batch_first=True)  # [images, most patches, d]
        valid = pad_sequence([torch.ones(n, dtype=torch.bool, device=dev) for n in counts], batch_first=True)
        x = self.block(x, valid[:, None, None, :])  # every patch sees every patch of its image
        out, _ = self.pool(self.queries.expand(len(grid), -1, -1), x, x, key_padding_mask=~valid)
        return out  # [images, IMAGE_TOKENS, d]


class VLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.encoder = ImageEncoder(d, heads)
        self.tok = nn.Embedding(VOCAB_SIZE, d)
        self.pos = nn.Embedding(IMAGE_TOKENS + CONTEXT, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits over the text positions of every row, [rows, T, vocab]."""
        B, T = b["input_ids"].shape
        K, dev = IMAGE_TOKENS, b["input_ids"].device
        image = torch.zeros(B, K, self.tok.embedding_dim, device=dev)
        has_image = torch.zeros(B, dtype=torch.bool, device=dev)
        if "pixel_values" in b:
            rows = b["image_doc"].long()  # one image per document in this corpus
            image = image.index_put((rows,), self.encoder(b["pixel_values"], b["image_grid"]))
            has_image = has_image.index_fill(0, rows, True)
        else:  # a text-only micro-batch: run the encoder on a blank patch so that DDP sees
            # every parameter used on every rank; the result counts for nothing
            blank = self.encoder(torch.zeros(1, PATCH * PATCH * 3, device=dev), torch.ones(1, 2, dtype=torch.long))
            image = image + 0 * blank.sum()
        x = torch.cat([image, self.tok(b["input_ids"])], 1) + self.pos(torch.arange(K + T, device=dev))
        keys = torch.cat([has_image[:, None].expand(B, K), b["attention_mask"].bool()], 1)
        # causal over [image tokens, text]; slots of a row without image (and padding) are
        # nobody's keys; the diagonal keeps every query's softmax defined
        eye = torch.eye(K + T, dtype=torch.bool, device=dev)
        mask = torch.ones_like(eye).tril() & (keys[:, None, :] | eye)
        for block in self.blocks:
            x = block(x, mask[:, None])
        return self.ln(x[:, K:]) @ self.tok.weight.T


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], out="demo-data/vlm", steps=30)
    d = setup_distributed()
    args.out.mkdir(parents=True, exist_ok=True)
    job = demo_job(
        args, "vlm", WEIGHTS, d.world, global_batch=8 * d.world, micro_batches=2, context_length=CONTEXT, packing=False
    )
    torch.manual_seed(0)
    train(
        args,
        d,
        job,
        VLM().to(d.device),
        forward=lambda ddp, b: ddp(b),
        count=lambda batch: len(batch.get("image_grid", ())),
        unit="images",
    )


if __name__ == "__main__":
    main()
