"""A 2-rank DDP job with dropout and BatchNorm for the in-place rerun (``Guard(rerun=...)``):
a one-off fault (a forward hook that poisons one output once) and a persistent one (a NaN
sample), and the same job without the fault as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

STEPS = 8


class DropBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.drop(torch.relu(self.bn(self.fc(x)))))
        return out


def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def data(rank: int, bad: int | None = None) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(STEPS):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)
        if i == bad:
            x[5, 2] = float("nan")
        out.append((x, y))
    return out


class OneOff:
    """Poisons the module's output once at each of ``steps`` (its first call in that step;
    the rerun of the step is clean): a transient fault."""

    def __init__(self, module: nn.Module, steps: list[int]) -> None:
        self.pending = set(steps)
        self.guard: tg.Guard | None = None
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        step = self.guard.state.step if self.guard is not None else -1
        if step in self.pending:
            self.pending.discard(step)
            return output * float("nan")
        return None


class OneOffGradient:
    """Poisons the parameter's gradient once at each of ``steps``, before DDP all-reduces it
    (a tensor hook): every rank then sees a NaN gradient; only this rank made it."""

    def __init__(self, param: Tensor, steps: list[int]) -> None:
        self.pending = set(steps)
        self.guard: tg.Guard | None = None
        param.register_hook(self)

    def __call__(self, grad: Tensor) -> Tensor | None:
        step = self.guard.state.step if self.guard is not None else -1
        if step in self.pending:
            self.pending.discard(step)
            return grad * float("nan")
        return None


def train(
    rank: int,
    run_dir: Path,
    fault: str | None,
    fault_rank: int = 1,
    fault_steps: tuple[int, ...] = (3,),
    **guard_args: Any,
) -> dict[str, Any]:
    """``fault``: None, ``"transient"`` (a one-off NaN output at ``fault_steps``),
    ``"transient_grad"`` (a one-off NaN gradient, spread to every rank by DDP) or
    ``"persistent"`` (a NaN sample at the first of them). Returns the state and counters."""
    torch.manual_seed(0)
    model = DDP(DropBN())
    one_off: OneOff | OneOffGradient | None = None
    if fault == "transient":
        one_off = OneOff(model.module.head, list(fault_steps))
    elif fault == "transient_grad":
        one_off = OneOffGradient(model.module.head.weight, list(fault_steps))
    if one_off is not None and rank != fault_rank:
        one_off.pending.clear()
    bad = fault_steps[0] if fault == "persistent" and rank == fault_rank else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, **guard_args)
    guard = tg.Guard(model, opt, rerun=loss_fn, config=config)
    if one_off is not None:
        one_off.guard = guard
    with guard:
        for batch in guard.watch(data(rank, bad)):
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"state": state, "skipped": list(guard.state.nonfinite_steps), "rng": torch.rand(3)}
