"""The small GPT-style transformer of the benchmarks: plain torch, no trainguard import (the
unmodified script ``_run_workload.py`` imports it too, and must stay trainguard-free)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

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
    """Token + position embeddings, ``layers`` blocks, final norm, untied LM head."""

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
