"""Fault injection for testing a guarded training loop (yours or ours).

Plan faults up front and apply them in the loop::

    from trainguard.testing import Fault, FaultPlan

    plan = FaultPlan([Fault(step=3, rank=1, where="loss"),
                      Fault(step=7, where="grad", param="fc.weight", value=float("inf"))])
    for batch in guard.watch(loader):
        loss = plan.loss(model(batch).mean(), guard.state.step)
        loss.backward()
        plan.grads(model, guard.state.step)
        if guard.check(loss):
            optimizer.step()
        optimizer.zero_grad()

A loss fault multiplies the loss by NaN (or Inf), so backward spreads it into the gradients as
a real bad batch would (``spread=False`` adds it instead: only the loss is non-finite). A grad
fault writes the value into one element of one parameter's gradient after backward (after
DDP's all-reduce), so only that rank sees it; into a sparse gradient's stored values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.errors import ConfigError
from trainguard.numerics import is_sparse
from trainguard.step.detect import local_grad, named_parameters


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def poison_loss(loss: Tensor, value: float = float("nan"), spread: bool = True) -> Tensor:
    """A non-finite loss. ``spread=True`` multiplies the loss by ``value`` (NaN by default), so
    backward carries it into every gradient as a real bad batch does; ``spread=False`` adds it,
    so only the loss is non-finite and the gradients stay finite."""
    return loss * value if spread else loss + value


def poison_grad(model: nn.Module, param: str | None = None, value: float = float("nan")) -> str:
    """Write ``value`` into the first element of a parameter's gradient; returns its name.

    ``param`` names the parameter as the guard names it, without wrapper prefixes such as
    DDP's ``module.`` (default: the first one that has a gradient). Under FSDP2
    the rank's local shard is written (a rank whose shard is empty gets nothing).
    """
    for name, p in named_parameters(model):
        if (param is None or name == param) and p.grad is not None:
            grad = local_grad(p)
            values = _flat_values(grad) if grad is not None else None
            if values is not None and values.numel() > 0:
                with torch.no_grad():
                    values[0] = value
            return name
    raise ConfigError("param", f"no parameter named {param!r} with a gradient in the model")


def _flat_values(grad: Tensor) -> Tensor:
    """The gradient's stored values as a flat view (writes reach the gradient): a sparse
    gradient's specified values (uncoalesced ones too: a NaN there is NaN once summed)."""
    if grad.layout == torch.sparse_coo:
        return grad._values().view(-1)
    return grad.values().view(-1) if is_sparse(grad) else grad.view(-1)


@dataclass(frozen=True)
class Fault:
    """One injected fault: at optimizer ``step``, on ``rank`` (None: every rank)."""

    step: int
    where: Literal["loss", "grad"] = "loss"
    rank: int | None = None
    value: float = float("nan")
    param: str | None = None
    spread: bool = True
    """Loss faults: carry the value into the gradients (see ``poison_loss``)."""

    def __post_init__(self) -> None:
        if self.where not in ("loss", "grad"):
            raise ConfigError("where", f"got {self.where!r}; use 'loss' or 'grad'")

    def due(self, step: int) -> bool:
        return self.step == step and (self.rank is None or self.rank == _rank())


class FaultPlan:
    """A list of faults applied by step and rank."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = list(faults)

    def loss(self, loss: Tensor, step: int) -> Tensor:
        for fault in self.faults:
            if fault.where == "loss" and fault.due(step):
                loss = poison_loss(loss, fault.value, fault.spread)
        return loss

    def grads(self, model: nn.Module, step: int) -> None:
        for fault in self.faults:
            if fault.where == "grad" and fault.due(step):
                poison_grad(model, fault.param, fault.value)
