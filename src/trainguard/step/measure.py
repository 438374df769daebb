"""This rank's numbers for a step: the one gradient pass and the row it agrees on.

After ``backward`` (and the scaler's unscale), once per ``check()`` and again for a rerun:
the buffers the forward changed are learned (``buffers.BufferKeeper.learn``), the
gradients' norms taken in one fused pass (``detect.grad_stats``), and the row built that
the step's all-reduce carries (``consensus.LocalReport``): the last and the checked loss,
the local gradient norm, the input column (``inputs.InputCheck``), the replica fingerprint
(``health.replicas``) in one ``stack``, and on the host the data state of the ``watch()``
stream and the rank's data and compute seconds (``health.timing``). No host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.health.replicas import ReplicaWatch
from trainguard.health.timing import StepTimer
from trainguard.step import amp
from trainguard.step.batch_stream import BatchStream, StreamSlot
from trainguard.step.detect import GradStats, grad_stats, is_sharded, loss_columns
from trainguard.step.evidence import StepEvidence
from trainguard.step.folded_row import FoldedRow, fold, foldable_losses
from trainguard.step.hyperparams import row_lr
from trainguard.step.inputs import InputCheck, max_abs
from trainguard.step.losses import StepLosses
from trainguard.step.no_gradients import NoGradientsCheck
from trainguard.step.step_start import StepStart
from trainguard.step.types import USUAL_CALL, LocalReport, StepCall


@dataclass
class MeasureParts:
    """What the measure reads of the guard (handed over explicitly, as ``SyncFreeParts``)."""

    params: list[tuple[str, nn.Parameter]]
    device: torch.device
    """Where the row lives (``Consensus.device``)."""
    start: StepStart
    losses: StepLosses
    no_grads: NoGradientsCheck
    inputs: InputCheck
    replicas: ReplicaWatch
    timer: StepTimer | None
    evidence: StepEvidence
    stream: StreamSlot
    """The ``watch()`` stream of the loop (set at ``watch()``), None without one."""
    optimizer: torch.optim.Optimizer
    """Read for the row's ``lr`` column: the rules see the LR agreed, never this rank's."""
    fold: bool = False
    """A world of one: a row read back at once (``check()``, not the sync-free step) may be
    folded on the host (``folded_row``)."""
    scaler: Any = None
    """Its scale goes into the row's ``loss_scale`` column (on the device)."""


class StepMeasure:
    """``measure(loss)``: this rank's gradient stats, report row and whether it is sharded."""

    def __init__(self, parts: MeasureParts) -> None:
        self._parts = parts
        self._is_sharded: bool | None = None
        self._mixed_grads = False  # sparse/float64 gradients seen: grad_stats' mixed pass

    def __call__(
        self, loss: Tensor, step: int, readback: bool = False, call: StepCall = USUAL_CALL
    ) -> tuple[GradStats, LocalReport, bool]:
        """Learn the buffers, take the one gradient pass, build this rank's report of
        ``step``. ``readback``: the report is read back at once (``Consensus.agree``), never
        reduced on the device (the sync-free step's ``Consensus.reduce``); ``call``: how the
        loop handed the step over (its ``dropped`` column, whether a backward ran)."""
        parts = self._parts
        parts.start.buffers.learn(step)
        sharded = self._sharded()
        folding = self._fold_pieces(step, loss) if readback and parts.fold and not sharded else None
        inputs = folding[1] if folding is not None else None
        stats = grad_stats(parts.params, parts.device, sharded, self._mixed_grads, inputs)
        self._mixed_grads = stats.mixed  # stays True once seen
        parts.no_grads.seen(stats, step, call.backward_ran)  # check() before backward()
        if folding is not None:
            return stats, self._folded(stats, *folding, call), sharded
        return stats, self._report(stats, loss, step, call), sharded

    def _sharded(self) -> bool:
        """Whether the gradients are FSDP2 shards; looked up once, at the first gradients."""
        if self._is_sharded is None:
            params = [p for _, p in self._parts.params]
            if not any(p.grad is not None for p in params):
                return False
            self._is_sharded = is_sharded(params)
        return self._is_sharded

    def _report(self, stats: GradStats, loss: Tensor, step: int, call: StepCall) -> LocalReport:
        parts = self._parts
        device = parts.device
        checked = parts.losses.checked(loss)  # ends with the loss, detached (or its twin)
        reported, check = loss_columns(checked, device)
        stream = parts.stream.current
        batches = parts.evidence.batches_of(step)
        inputs = parts.inputs.value(step, batches, device)
        fingerprint = parts.replicas.fingerprint(step, device)
        values = torch.stack([reported, check, stats.norm, inputs, fingerprint])  # one kernel
        return self._host_fields(values, stream, None, call)

    def _fold_pieces(self, step: int, loss: Tensor) -> tuple[list[Tensor], list[Tensor]] | None:
        """The step's losses and input tensors for a folded row ([] inputs: unchecked), or
        None when they do not fold (then ``_report``)."""
        parts = self._parts
        checked = parts.losses.checked(loss)  # ends with the loss, detached (or its twin)
        if not foldable_losses(checked, parts.device):
            return None
        batches = parts.evidence.batches_of(step)
        inputs = parts.inputs.foldable(step, batches, parts.device)
        return None if inputs is None else (checked, inputs)

    def _folded(
        self, stats: GradStats, losses: list[Tensor], inputs: list[Tensor], call: StepCall
    ) -> LocalReport:
        """The row of a world of one, its reductions left to the host (``folded_row``)."""
        device = self._parts.device

        def confirm() -> float:
            return float(max_abs(inputs, device))

        values, layout = fold(losses, stats.per_param, stats.input_norms, confirm)
        return self._host_fields(values, self._parts.stream.current, layout, call)

    def _host_fields(
        self, values: Tensor, stream: BatchStream | None, layout: FoldedRow | None, call: StepCall
    ) -> LocalReport:
        timer = self._parts.timer
        data_time, compute_time = timer.take() if timer is not None else (0.0, 0.0)
        return LocalReport(
            values,
            exhausted=stream.exhausted if stream is not None else False,
            batches=stream.batches_seen if stream is not None else 0,
            data_time=data_time,
            compute_time=compute_time,
            layout=layout,
            dropped=call.dropped,
            lr=row_lr(self._parts.optimizer),
            loss_scale=amp.scale_tensor(self._parts.scaler),
            leaving=call.leaving,
            loss_known=call.loss_known,
        )
