"""Cross-rank agreement on a step: one small all-reduce that every rank reads the same way.

Each rank writes its own row of a ``world_size x COLUMNS`` float64 buffer (zeros elsewhere)
plus a shared slot for the sum of squared gradient norms (needed when gradients are FSDP2
shards); one SUM all-reduce then tells every rank what every rank saw. With torch.distributed
not initialized (or a world of one) no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

COLUMNS = ("loss_bad", "grad_bad", "has_next", "batches", "loss")
_NCOL = len(COLUMNS)


@dataclass(frozen=True)
class LocalReport:
    """What one rank saw during a step. Tensors may be on the device (no sync needed)."""

    loss_bad: Tensor
    grad_bad: Tensor
    loss: Tensor
    grad_sumsq: Tensor
    has_next: bool = True
    batches: int = 0


@dataclass(frozen=True)
class Agreement:
    """The step as every rank sees it after the all-reduce (identical on every rank)."""

    loss_ranks: list[int]
    grad_ranks: list[int]
    exhausted_ranks: list[int]
    batches: list[int]
    losses: list[float]
    grad_sumsq: float

    @property
    def bad(self) -> bool:
        return bool(self.loss_ranks or self.grad_ranks)

    @property
    def ranks(self) -> list[int]:
        """Ranks where the step went non-finite: the loss ranks when any, else the grad ranks."""
        return self.loss_ranks or self.grad_ranks

    @property
    def where(self) -> str:
        return "loss" if self.loss_ranks else "grad"

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)

    def grad_norm(self) -> float:
        return math.sqrt(self.grad_sumsq) if math.isfinite(self.grad_sumsq) else math.inf


class Consensus:
    """Runs the step's all-reduce over ``group`` (default: the default process group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.device = self._collective_device() if self.distributed else torch.device("cpu")

    def _collective_device(self) -> torch.device:
        backend = str(dist.get_backend(self.group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, report: LocalReport, sum_grad_norms: bool) -> Agreement:
        """One all-reduce, one host read. ``sum_grad_norms``: gradients are shards (FSDP2)."""
        buf = torch.zeros(self.world_size * _NCOL + 1, dtype=torch.float64, device=self.device)
        row = buf[self.rank * _NCOL : (self.rank + 1) * _NCOL]
        row[0].copy_(report.loss_bad, non_blocking=True)
        row[1].copy_(report.grad_bad, non_blocking=True)
        row[2].fill_(1.0 if report.has_next else 0.0)
        row[3].fill_(float(report.batches))
        row[4].copy_(report.loss.detach().reshape(()), non_blocking=True)
        if sum_grad_norms or self.rank == 0:  # replicated gradients: count rank 0's norm once
            buf[-1].copy_(report.grad_sumsq, non_blocking=True)
        if self.distributed and self.world_size > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return self._read(buf.tolist())

    def exchange_has_next(self, has_next: bool, batches: int) -> Agreement:
        """A standalone agreement on data availability (start of ``watch()``, or no check)."""
        zero = torch.zeros((), dtype=torch.float64)
        report = LocalReport(zero, zero, zero, zero, has_next=has_next, batches=batches)
        return self.agree(report, sum_grad_norms=False)

    def _read(self, values: list[float]) -> Agreement:
        rows = [values[r * _NCOL : (r + 1) * _NCOL] for r in range(self.world_size)]
        return Agreement(
            loss_ranks=[r for r, row in enumerate(rows) if row[0] > 0.5],
            grad_ranks=[r for r, row in enumerate(rows) if row[1] > 0.5],
            exhausted_ranks=[r for r, row in enumerate(rows) if row[2] < 0.5],
            batches=[int(row[3]) for row in rows],
            losses=[row[4] for row in rows],
            grad_sumsq=values[-1],
        )
