"""The model of ``examples/fast_loop.py``: a tiny GPT (nanoGPT's shape, about 250K
parameters, CPU-friendly) and the replay factory.

This module trains nothing when imported, so ``trainguard replay`` can import it:

    trainguard replay runs/fast_loop/captures/step-00000005 \\
        --factory examples/fast_loop_model.py:make_replay
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GRADIENT_ACCUMULATION_STEPS = 2
"""Micro-batches per optimizer step in the example loop (the loss of each is divided by it)."""


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 96
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: Tensor = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.c_proj(F.gelu(self.c_fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """nanoGPT's GPT, small: ``model(idx, targets) -> (logits, loss)``; targets of -1 are
    ignored, as in nanoGPT."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        _, t = idx.shape
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
        )  # the mean over the targets that are not -1: 0/0 = NaN when every one is -1
        return logits, loss


def loss_fn(model: nn.Module, batch: Any) -> Tensor:
    """One micro-batch's loss exactly as the loop backpropagates it (divided by the
    accumulation count): what replay (and ``Guard(rerun=...)``) runs."""
    x, y = batch
    _, loss = model(x, y)
    assert loss is not None  # targets given
    out: Tensor = loss / GRADIENT_ACCUMULATION_STEPS
    return out


def make_replay() -> tuple[nn.Module, Any]:
    """The replay factory: the plain (not DDP-wrapped) model and the loss; the bundle's
    weights are loaded into it."""
    return GPT(GPTConfig()), loss_fn
