"""Cross-rank agreement on a step: one small all-reduce that every rank reads the same way.

Each rank writes its own row of a ``world_size x COLUMNS`` float64 buffer (zeros elsewhere);
one SUM all-reduce then tells every rank what every rank saw, bit for bit (``x + 0 = x``, and
NaN/Inf survive the sum). A non-finite loss or gradient needs no flag of its own: the row
holds the loss and the gradient norm, which are non-finite exactly when some loss or
gradient is. So building the row is one ``stack`` on the device, and the device-side flag
for a fused optimizer one fused check of the buffer. With
torch.distributed not initialized (or a world of one) no collective runs and the buffer is
the local row's device part alone.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from trainguard.step.collective_work import HeldWork
from trainguard.step.types import Agreement, LocalReport, Reduced

COLUMNS = (
    "loss",
    "loss_check",
    "grad_norm",
    "input",
    "fingerprint",
    "exhausted",
    "batches",
    "data_time",
    "compute_time",
    "dropped",
    "lr",
    "loss_scale",
    "leaving",
    "loss_unknown",
)
DEVICE_COLUMNS = 5
"""The first columns come from the device (``LocalReport.values``); the rest from the host,
but for ``loss_scale``, copied on the device from the GradScaler's scale tensor, and
``leaving`` and ``loss_unknown``, filled only on a step where a rank's caller stops guarding
or did not see its loss."""
_NCOL = len(COLUMNS)
_NORM = COLUMNS.index("grad_norm")
_INPUT = COLUMNS.index("input")
_FINGERPRINT = COLUMNS.index("fingerprint")
_EXHAUSTED = COLUMNS.index("exhausted")
_BATCHES = COLUMNS.index("batches")
_DATA_TIME = COLUMNS.index("data_time")
_COMPUTE_TIME = COLUMNS.index("compute_time")
_DROPPED = COLUMNS.index("dropped")
_LR = COLUMNS.index("lr")
_SCALE = COLUMNS.index("loss_scale")
_LEAVING = COLUMNS.index("leaving")
_LOSS_UNKNOWN = COLUMNS.index("loss_unknown")


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
        self.device = buffer_device(group, local_device or torch.device("cpu"))
        self.work = HeldWork()
        """The latest all-reduce's work, released on this thread (see ``collective_work``)."""

    def reduce(self, report: LocalReport, sum_grad_norms: bool) -> Reduced:
        """Start the step's all-reduce; the buffer stays on ``device``, unread.

        ``sum_grad_norms``: the gradients are shards (FSDP2), so the squared norms add up.
        """
        if not self.distributed or self.world_size == 1:
            return Reduced(report.values, report, sum_grad_norms)
        buf = torch.zeros(self.world_size * _NCOL, dtype=torch.float64, device=self.device)
        row = buf[self.rank * _NCOL : (self.rank + 1) * _NCOL]
        row[:DEVICE_COLUMNS].copy_(report.values, non_blocking=True)
        for column, value in enumerate(_host_columns(report), start=DEVICE_COLUMNS):
            row[column].fill_(value)  # a scalar fill: no host-to-device copy
        if report.loss_scale is not None:  # a device-to-device copy: no host sync
            row[_SCALE].copy_(report.loss_scale.reshape(()), non_blocking=True)
        if report.leaving:
            row[_LEAVING].fill_(1.0)
        if not report.loss_known:
            row[_LOSS_UNKNOWN].fill_(1.0)
        # not synchronous: the work is kept, so gloo's thread never releases ``buf``
        self.work.wait(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        return Reduced(buf, report, sum_grad_norms)

    def agree(self, report: LocalReport, sum_grad_norms: bool) -> Agreement:
        """One all-reduce, one host read."""
        if not self.distributed or self.world_size == 1:  # nothing to reduce: read the row
            values = report.values.tolist()
            if report.layout is not None:
                values = report.layout.unfold(values)
            return _alone(values, report, sum_grad_norms)
        reduced = self.reduce(report, sum_grad_norms)
        return self.read(reduced.buf.tolist(), reduced)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on some rank: one more (one-value) all-reduce, for the rare
        step that needs a second word (``InputCheck.forgive_masks``)."""
        if not self.distributed or self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item() > 0.5)

    def exchange_data_state(self, exhausted: bool, batches: int) -> Agreement:
        """A standalone agreement on data availability (start of ``watch()``, or no check)."""
        zeros = torch.zeros(DEVICE_COLUMNS, dtype=torch.float64)
        report = LocalReport(zeros, exhausted=exhausted, batches=batches)
        return self.agree(report, sum_grad_norms=False)

    def global_grad_norm(self, reduced: Reduced) -> Tensor:
        """On the device: the norm of all gradients (the same on every rank); no sync."""
        buf = reduced.buf
        if buf.numel() <= DEVICE_COLUMNS:
            return buf[_NORM]  # one rank
        norms = buf.view(self.world_size, _NCOL)[:, _NORM]
        if reduced.sharded:
            norm: Tensor = torch.linalg.vector_norm(norms)
            return norm
        return norms[0] + 0.0 * norms.sum()  # replicated_norm, on the device

    def agreed_lr(self, reduced: Reduced) -> Tensor:
        """On the device: float64 0-d, ``Agreement.lr`` (the smallest rank's learning rate,
        0.0 when some rank's is unknown); no sync."""
        buf = reduced.buf
        if buf.numel() <= DEVICE_COLUMNS:  # a world of one: its own, filled (no copy)
            return torch.full((), reduced.report.lr, dtype=torch.float64, device=buf.device)
        lrs = buf.view(self.world_size, _NCOL)[:, _LR]
        return torch.where((lrs > 0).all(), lrs.min(), torch.zeros_like(lrs[0]))

    def agreed_metrics(self, reduced: Reduced) -> Tensor:
        """On the device: float64 ``[mean loss over ranks, global grad norm]``; no sync."""
        buf = reduced.buf
        if buf.numel() == DEVICE_COLUMNS:  # a world of one
            losses = buf[:1]
        else:
            losses = buf.view(self.world_size, _NCOL)[:, 0]
        return torch.stack([losses.mean(), self.global_grad_norm(reduced)])

    def read(self, values: list[float], reduced: Reduced) -> Agreement:
        """Turn the reduced buffer, read back as host values, into the agreement."""
        if len(values) == DEVICE_COLUMNS:  # a world of one: the host columns are local
            return _alone(values, reduced.report, reduced.sharded)
        rows = [values[r * _NCOL : (r + 1) * _NCOL] for r in range(self.world_size)]
        norms = [row[_NORM] for row in rows]
        return Agreement(
            loss_ranks=[r for r, row in enumerate(rows) if not math.isfinite(row[1])],
            grad_ranks=[r for r, row in enumerate(rows) if not math.isfinite(row[_NORM])],
            exhausted_ranks=[r for r, row in enumerate(rows) if row[_EXHAUSTED] > 0.5],
            batches=[int(row[_BATCHES]) for row in rows],
            losses=[row[0] for row in rows],
            global_grad_norm=math.hypot(*norms) if reduced.sharded else replicated_norm(norms),
            input_ranks=[r for r, row in enumerate(rows) if not math.isfinite(row[_INPUT])],
            data_times=[row[_DATA_TIME] for row in rows],
            compute_times=[row[_COMPUTE_TIME] for row in rows],
            fingerprints=[row[_FINGERPRINT] for row in rows],
            drops=[row[_DROPPED] for row in rows] if any(row[_DROPPED] for row in rows) else [],
            lrs=[row[_LR] for row in rows],
            loss_scales=[row[_SCALE] for row in rows],
            leaving_ranks=[r for r, row in enumerate(rows) if row[_LEAVING] > 0.5],
            unknown_loss_ranks=[r for r, row in enumerate(rows) if row[_LOSS_UNKNOWN] > 0.5],
        )


def buffer_device(group: dist.ProcessGroup | None, local_device: torch.device) -> torch.device:
    """Where a buffer of ``group``'s collectives lives: the collective's device, or (no process
    group) the model's ``local_device``, so the flags never cross between host and device
    before the decision is read."""
    if not (dist.is_available() and dist.is_initialized()):
        return local_device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replicated_norm(norms: list[float]) -> float:
    """The norm of replicated gradients (DDP: every rank holds them all) from every rank's:
    rank 0's, unless some rank's is not finite (a gradient changed on one rank after the
    all-reduce: a hook, a fault): then NaN when any is NaN, else Inf, not a finite norm for a
    step that is bad. (On the device, ``global_grad_norm``: NaN for both.)"""
    if math.isfinite(sum(norms)) or all(map(math.isfinite, norms)):  # or the sum overflowed
        return norms[0]
    return math.nan if any(map(math.isnan, norms)) else math.inf


def _alone(values: list[float], report: LocalReport, sharded: bool) -> Agreement:
    """``Consensus.read`` of a world of one, from its device columns and its own host fields
    (the same agreement, without building the rows)."""
    return alone_agreement(
        values,
        report.exhausted,
        report.batches,
        report.data_time,
        report.compute_time,
        sharded,
        report.dropped,
        report.lr,
        float(report.loss_scale) if report.loss_scale is not None else 0.0,
        report.leaving,
        report.loss_known,
    )


def alone_agreement(
    values: list[float],
    exhausted: bool,
    batches: int,
    data_time: float,
    compute_time: float,
    sharded: bool = False,
    dropped: float = 0.0,
    lr: float = 0.0,
    loss_scale: float = 0.0,
    leaving: bool = False,
    loss_known: bool = True,
) -> Agreement:
    """A world of one's agreement: its reduced device columns ``values`` (``COLUMNS`` order)
    and its host fields (also ``step/single_process.py``'s, for the usual step)."""
    loss, check, norm, inputs, fingerprint = values
    return Agreement(
        loss_ranks=[] if math.isfinite(check) else [0],
        grad_ranks=[] if math.isfinite(norm) else [0],
        exhausted_ranks=[0] if exhausted else [],
        batches=[int(float(batches))],
        losses=[loss],
        global_grad_norm=math.hypot(norm) if sharded else norm,
        input_ranks=[] if math.isfinite(inputs) else [0],
        data_times=[data_time],
        compute_times=[compute_time],
        fingerprints=[fingerprint],
        drops=[dropped] if dropped else [],
        lrs=[lr],
        loss_scales=[loss_scale],
        leaving_ranks=[0] if leaving else [],
        unknown_loss_ranks=[] if loss_known else [0],
    )


def _host_columns(report: LocalReport) -> list[float]:
    """The row's host part, in ``COLUMNS`` order after the device columns."""
    exhausted = 1.0 if report.exhausted else 0.0
    times = [report.data_time, report.compute_time]
    return [exhausted, float(report.batches), *times, report.dropped, report.lr]
