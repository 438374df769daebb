"""Models whose forward writes buffers, and the loops that train them with and without a bad
batch: a skipped step must leave the model bit-identical to a run that never saw that batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

import trainguard as tg


class EmaNorm(nn.Module):
    """A hand-written normaliser (RL, audio): the forward updates its statistics and a step
    counter, then normalises with them. One NaN sample poisons every later step unless the
    skipped step's writes are put back."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.count += 1
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.var.mul_(0.9).add_(0.1 * x.var(0, unbiased=False))
        return (x - self.mean) / (self.var + 1e-5).sqrt()


class BufferNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> EmaNorm -> Linear."""

    def __init__(self, dim: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.norm = EmaNorm(hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.norm(torch.relu(self.bn(self.fc(x)))))
        return out


class ZeroStartScale(nn.Module):
    """Divides by a running scale that starts at zero and is updated *after* it is used: step
    0 divides by zero. A bundle holding the updated scale would replay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(()))
        self.fc = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(x / self.scale)
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * x.abs().mean())
        return out


def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)


def batches(n: int, seed: int = 0, bad: int | None = None, rank: int = 0) -> list[Any]:
    """``n`` batches of 8 samples; batch ``bad`` gets a NaN in its sample 3."""
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=gen)
        y = torch.randn(8, generator=gen)
        if i == bad:
            x[3, 1] = float("nan")
        out.append((x, y))
    return out


def state_of(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers (the module inside DDP), detached clones."""
    inner = model.module if hasattr(model, "module") else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def assert_identical(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: {a[key]} != {b[key]}"


def train_bare(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> None:
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()


def train_guarded(
    guard: tg.Guard, model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], fused: bool
) -> None:
    for batch in guard.watch(data):
        loss = loss_fn(model, batch)
        loss.backward()
        if fused:
            guard.step(loss)
            continue
        if guard.check(loss):
            opt.step()
        opt.zero_grad()


def prefetching_loop(
    guard: tg.Guard, model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], k: int
) -> None:
    """nanoGPT's structure: the next micro-batch is fetched before backward."""
    it: Iterator[Any] = iter(guard.watch(data))
    batch: Any = next(it)
    while batch is not None:
        for micro in range(k):
            loss = loss_fn(model, batch) / k
            if micro < k - 1:
                guard.record_loss(loss)  # check(loss) records the last one
            batch = next(it, None)  # prefetch: the next step's first batch, before backward
            loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad(set_to_none=True)
