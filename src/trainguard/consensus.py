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

COLUMNS = ("loss_bad", "grad_bad", "exhausted", "batches", "loss")
_NCOL = len(COLUMNS)


@dataclass(frozen=True)
class LocalReport:
    """What one rank saw during a step. Tensors may be on the device (no sync needed)."""

    loss_bad: Tensor
    grad_bad: Tensor
    loss: Tensor
    grad_sumsq: Tensor
    exhausted: bool = False
    """This rank's data iterator is used up (``batches`` is then its exact total)."""
    batches: int = 0
    """Batches this rank has fetched so far."""


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

    def steps_available(self, accumulation_steps: int) -> float:
        """How many optimizer steps the data allows: set by the ranks whose data ran out."""
        totals = [self.batches[r] // accumulation_steps for r in self.exhausted_ranks]
        return min(totals) if totals else math.inf

    def grad_norm(self) -> float:
        return math.sqrt(self.grad_sumsq) if math.isfinite(self.grad_sumsq) else math.inf


class Consensus:
    """Runs the step's all-reduce over ``group`` (default: the default process group)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        local_device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.device = self._buffer_device(local_device or torch.device("cpu"))

    def _buffer_device(self, local_device: torch.device) -> torch.device:
        """Where the buffer lives: the collective's device, or (one process) the model's, so
        the flags never cross between host and device before the decision is read."""
        if not self.distributed:
            return local_device
        backend = str(dist.get_backend(self.group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def reduce(self, report: LocalReport, sum_grad_norms: bool) -> Tensor:
        """Start the step's all-reduce; returns the buffer on ``device`` without reading it.

        ``sum_grad_norms``: the gradients are shards (FSDP2), so the squared norms add up.
        """
        buf = torch.zeros(self.world_size * _NCOL + 1, dtype=torch.float64, device=self.device)
        row = buf[self.rank * _NCOL : (self.rank + 1) * _NCOL]
        row[0].copy_(report.loss_bad, non_blocking=True)
        row[1].copy_(report.grad_bad, non_blocking=True)
        row[2].fill_(1.0 if report.exhausted else 0.0)
        row[3].fill_(float(report.batches))
        row[4].copy_(report.loss.detach().reshape(()), non_blocking=True)
        if sum_grad_norms or self.rank == 0:  # replicated gradients: count rank 0's norm once
            buf[-1].copy_(report.grad_sumsq, non_blocking=True)
        if self.distributed and self.world_size > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf

    def agree(self, report: LocalReport, sum_grad_norms: bool) -> Agreement:
        """One all-reduce, one host read."""
        return self.read(self.reduce(report, sum_grad_norms).tolist())

    def exchange_data_state(self, exhausted: bool, batches: int) -> Agreement:
        """A standalone agreement on data availability (start of ``watch()``, or no check)."""
        zero = torch.zeros((), dtype=torch.float64)
        report = LocalReport(zero, zero, zero, zero, exhausted=exhausted, batches=batches)
        return self.agree(report, sum_grad_norms=False)

    def bad_flag(self, buf: Tensor, device: torch.device) -> Tensor:
        """On the device: 1.0 when any rank saw a bad loss or gradient, else 0.0 (no sync).

        The 0-d float32 tensor fused optimizers take as ``found_inf``.
        """
        flags = buf[:-1].view(self.world_size, _NCOL)[:, :2]
        return (flags.sum() > 0.5).to(device=device, dtype=torch.float32, non_blocking=True)

    def read(self, values: list[float]) -> Agreement:
        """Turn the reduced buffer, read back as host values, into the agreement."""
        rows = [values[r * _NCOL : (r + 1) * _NCOL] for r in range(self.world_size)]
        return Agreement(
            loss_ranks=[r for r, row in enumerate(rows) if row[0] > 0.5],
            grad_ranks=[r for r, row in enumerate(rows) if row[1] > 0.5],
            exhausted_ranks=[r for r, row in enumerate(rows) if row[2] > 0.5],
            batches=[int(row[3]) for row in rows],
            losses=[row[4] for row in rows],
            grad_sumsq=values[-1],
        )
