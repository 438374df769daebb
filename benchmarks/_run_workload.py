"""The transformer workload of ``overhead_modes`` as a plain training script that knows
nothing of trainguard: what ``run_overhead.py`` runs bare and under ``trainguard run``.

One process, or DDP (gloo) under torchrun. Times each step (forward, backward, optimizer
step, zero_grad) after ``--warmup`` steps and writes rank 0's times as JSON to ``--out``.
The model mirrors ``overhead_modes.TinyGPT`` at its ``cpu`` sizes (copied: importing that
module would import trainguard into the bare run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

SIZES = {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq": 128, "batch": 8}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        out: Tensor = self.head(self.ln(self.blocks(self.tok(tokens) + self.pos(pos))))
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    s = SIZES
    net = TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(rank)
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        started = time.perf_counter()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    if rank == 0:
        result = {"step_s": times, "process_s": time.monotonic() - START, "loss": loss.item()}
        args.out.write_text(json.dumps(result))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
