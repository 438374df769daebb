"""The usual step of a process alone, measured and agreed in few calls.

``check()``'s full path (``StepMeasure`` -> ``Consensus.agree`` -> ``policy.decide``) is
built for every case: other ranks, a GradScaler, accumulated losses, sharded, sparse or
float64 gradients, inputs on other devices, a non-finite value to locate. In a world of one
most steps are none of these, and there the layers are what the guard costs: on a model
whose step takes a few hundred microseconds, each Python call between two training steps
costs several times what it costs in a loop of its own (the step's kernels evict the guard's
code and data from the caches), so the count of distinct calls sets the fixed cost
(docs/benchmarks.md, "Round 6").

``LoneStep.measure(loss, step)`` takes such a step in one pass: the gradients' and the step
inputs' norms in one fused ``_foreach_norm``, one ``stack`` with the step's losses (those
recorded with ``record_loss`` and ``check()``'s, ``StepLosses.checked``), one read, the
values the folded row of the full path holds (``local_row``), reduced by the same
``reduce_row`` (``FoldedRow.unfold``) into the same ``Agreement``
(``consensus.alone_agreement``). The guard then decides and records the step exactly as
after the full path (``Guard.check``): the history, the metrics line, the counters, the
spike rule, recovery and clipping are the same code. It returns None when the step is not
the usual one, having changed nothing the full path does not set again (the step's losses,
``StepLosses.checked``), and the full path measures it as always:

- a value is not finite (the loss, a gradient norm or an input norm): the full path locates,
  confirms and captures it;
- a loss of the step is not a float32 0-d tensor on the guard's device
  (``local_row.foldable_losses``, the full path's own test);
- the step's start was not recorded by the forward hook (the full path looks for it);
- the ``watch()`` stream ran out (the data state must be agreed);
- an input the fused pass does not take (``InputCheck.foldable``);
- no gradient at all (the full path warns), or gradients the fused pass refuses (sparse,
  float64, on several devices) or FSDP2 shards: then it stops trying for the run.

The guard builds it for a world of one only, and uses it without a GradScaler (``check()``
tests that each step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainguard.health.timing import StepTimer
from trainguard.step.consensus import Agreement, alone_agreement
from trainguard.step.data import BatchStream
from trainguard.step.detect import GradStats, is_sharded, local_grads
from trainguard.step.evidence import StepEvidence
from trainguard.step.inputs import InputCheck
from trainguard.step.local_row import foldable_losses, reduce_row
from trainguard.step.losses import StepLosses
from trainguard.step.start import StepStart


@dataclass
class LoneParts:
    """What the usual step reads of the guard (handed over explicitly, as ``MeasureParts``)."""

    params: list[tuple[str, nn.Parameter]]
    device: torch.device
    """Where the loss must be (``Consensus.device``)."""
    start: StepStart
    losses: StepLosses
    inputs: InputCheck
    evidence: StepEvidence
    timer: StepTimer | None
    stream: Callable[[], BatchStream | None]


def _unused() -> float:
    raise AssertionError("a usual step's input norms are finite: nothing to confirm")


class LoneStep:
    """``measure(loss, step)``: the usual step's gradient stats and agreement, or None."""

    def __init__(self, parts: LoneParts) -> None:
        self._parts = parts
        self.active = True
        """False once the gradients were found to be shards or refused by the fused pass."""
        self._sharded_checked = False

    def measure(self, loss: Tensor, step: int) -> tuple[GradStats, Agreement] | None:
        """The step's gradient stats and agreement when it is the usual step (every value
        finite, nothing special: the module docstring), else None (then the full path)."""
        parts = self._parts
        if not self.active or parts.start.step != step:
            return None
        device = parts.device
        losses = parts.losses.checked(loss)  # detached; the full path sets the same again
        if not foldable_losses(losses, device):
            return None
        stream = parts.stream()
        if stream is not None and stream.exhausted:
            return None
        batches = parts.evidence.batches_of(step) if stream is not None else []
        inputs = parts.inputs.foldable(step, batches, device, keep=False)
        if inputs is None or not self._plain_gradients():
            return None
        names, grads = local_grads(parts.params, sharded=False)
        if not grads:
            return None
        row = self._row(losses, grads, inputs)
        if row is None or not all(map(math.isfinite, row[0])):
            return None
        values, norms = row
        return self._commit(step, stream, len(losses), values, names, grads, norms)

    def _plain_gradients(self) -> bool:
        """False (for good) when the gradients are FSDP2 shards: looked up once, at the first
        gradients."""
        if not self._sharded_checked:
            params = [p for _, p in self._parts.params]
            if not any(p.grad is not None for p in params):
                return True
            self._sharded_checked = True
            self.active = not is_sharded(params)
        return self.active

    def _row(
        self, losses: list[Tensor], grads: list[Tensor], inputs: list[Tensor]
    ) -> tuple[list[float], list[Tensor]] | None:
        """The folded row ``[losses..., gradient norms..., input norms...]`` read on the host
        (``local_row``), and the norms."""
        try:
            norms = torch._foreach_norm(grads + inputs, 2.0, dtype=torch.float32)
            values: list[float] = torch.stack([*losses, *norms]).tolist()
        except (RuntimeError, TypeError):  # sparse/float64 gradients, several devices
            self.active = False  # the full path's mixed pass, from now on
            return None
        return values, list(norms)

    def _commit(
        self,
        step: int,
        stream: BatchStream | None,
        losses: int,
        values: list[float],
        names: list[str],
        grads: list[Tensor],
        norms: list[Tensor],
    ) -> tuple[GradStats, Agreement]:
        """The step is the usual one: what the full path's measure leaves, and the agreement."""
        parts = self._parts
        parts.start.buffers.learn(step)
        data_time, compute_time = parts.timer.take() if parts.timer is not None else (0.0, 0.0)
        cut = len(grads)
        columns = reduce_row(values, losses, cut, _unused)
        agreement = alone_agreement(
            columns,
            exhausted=False,
            batches=stream.batches_seen if stream is not None else 0,
            data_time=data_time,
            compute_time=compute_time,
        )
        stats = GradStats(names, norms[:cut], grads, parts.device, input_norms=norms[cut:])
        return stats, agreement
