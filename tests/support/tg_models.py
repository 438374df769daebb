"""Small deterministic models and data for the tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TinyNet(nn.Module):
    """Two named blocks so parameter names are readable (``encoder.fc.weight``...)."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential()
        self.encoder.add_module("fc", nn.Linear(d_in, hidden))
        self.encoder.add_module("act", nn.Tanh())
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(x))
        return out


def make_batches(n: int, seed: int, batch: int = 6, d_in: int = 8) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, d_in, generator=gen) for _ in range(n)]


def loss_fn(model: nn.Module, batch: Tensor) -> Tensor:
    out: Tensor = model(batch).pow(2).mean()
    return out


def flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
