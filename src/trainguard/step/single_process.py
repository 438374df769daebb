"""The measure and agreement of a process alone, for its usual step: one fused pass, one read.

The pipeline (``step/pipeline.py``) runs the same stages for every step. With other ranks the
measure builds a row on the device and the agreement all-reduces it; a process alone has no
one to agree with, so its agreement is its own row. For its usual step (every value finite,
nothing special) ``AloneMeasure.take`` measures and agrees in few calls: on a model whose
step takes a few hundred microseconds each Python call between two training steps costs
several times what it costs in a loop of its own (the step's kernels evict the guard's code
and data from the caches), so the count of distinct calls sets the fixed cost (``git show
3c1ebd7:docs/benchmarks.md``, "Round 6").

``take`` reads the gradients' and the step inputs' norms in one fused ``_foreach_norm``, with
the step's losses (those recorded with ``record_loss`` and ``check()``'s,
``StepLosses.checked``) in one go: on the CPU, where a read is no device sync, value by value
(``Tensor.item``: a ``stack`` costs more than a few reads), elsewhere one ``stack`` and one
read. These are the values the folded row of the full measure holds (``folded_row``),
reduced as ``reduce_row`` reduces a finite row, into the agreement ``Consensus`` builds for a
world of one (``alone_agreement``; ``tests/unit/step/test_lone.py`` runs a loop both ways and
compares every record). The pipeline then decides, records and applies it like any other
step.

It returns None, having changed nothing the full measure does not set again (the step's
losses, ``StepLosses.checked``), when the step is not the usual one; the full measure
(``StepMeasure``, ``Consensus.agree``) then takes it:

- a value is not finite (a loss, a gradient norm, an input norm or a scalar
  hyper-parameter; or their sum overflows): the full measure locates and confirms it;
- a loss of the step is not a float32 0-d tensor on the guard's device
  (``folded_row.foldable_losses``, the full measure's own test);
- the step's start was not recorded by the forward hook (the full measure looks for it);
- the ``watch()`` stream ran out (the data state must be agreed);
- an input the fused pass does not take (``InputCheck.foldable``);
- no gradient at all (the full measure warns), or gradients the fused pass refuses (sparse,
  float64, on several devices) or FSDP2 shards: then it stops trying for the run.

The pipeline uses it in a world of one without a GradScaler (the scaler unscales first).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from trainguard.health.timing import StepTimer
from trainguard.step.batch_stream import BatchStream
from trainguard.step.detect import GradStats, is_sharded, local_grads
from trainguard.step.evidence import StepEvidence
from trainguard.step.folded_row import foldable_losses, total_norm
from trainguard.step.hyperparams import row_lr
from trainguard.step.inputs import InputCheck
from trainguard.step.losses import StepLosses
from trainguard.step.step_start import StepStart
from trainguard.step.types import Agreement

ITEM_READS = 24
"""On the CPU a value is read without a device sync: up to this many values are read one by
one (``Tensor.item``, about 0.3 us each), which costs less than ``stack`` and one read; past
it, and on every other device, one ``stack`` and one read."""


class AloneMeasure:
    """``take(loss, step, dropped)``: the usual step's agreement and gradient stats, else
    None (the full measure takes the step)."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        device: torch.device,
        start: StepStart,
        losses: StepLosses,
        inputs: InputCheck,
        evidence: StepEvidence,
        timer: StepTimer | None,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self._named = params
        self._params = [p for _, p in params]
        self._names = [name for name, _ in params]
        self._device = device
        self._start = start
        self._losses = losses
        self._inputs = inputs
        self._evidence = evidence
        self._timer = timer
        self._optimizer = optimizer
        self._reads_items = device.type == "cpu"
        self.stream: BatchStream | None = None
        """The ``watch()`` stream of the loop (``Guard.watch`` sets it), None without one."""
        self.active = True
        """False once the gradients were found to be shards or refused by the fused pass."""
        self._sharded_checked = False

    def take(
        self, loss: Tensor, step: int, dropped: float = 0.0, loss_known: bool = True
    ) -> tuple[Agreement, GradStats] | None:
        """The agreement of the usual step (the module docstring) and its gradient stats,
        else None. ``dropped``, ``loss_known``: the row's ``dropped`` and ``loss_unknown``
        columns (``StepCall``)."""
        if not self.active or self._start.step != step:
            return None
        losses = self._losses.checked(loss)  # detached; the full measure sets the same again
        device = self._device
        if not foldable_losses(losses, device):
            return None
        stream = self.stream
        if stream is not None and stream.exhausted:
            return None
        batches = self._evidence.batches_of(step)
        inputs = self._inputs.foldable(step, batches, device, keep=False)
        if inputs is None or not (self._sharded_checked or self._first_gradients_plain()):
            return None
        grads = [grad for p in self._params if (grad := p.grad) is not None]
        if not grads:
            return None
        read = self._read(losses, grads, inputs)
        if read is None or not math.isfinite(sum(read[0])):  # NaN/Inf anywhere, or overflow
            return None
        lr = row_lr(self._optimizer)  # a world of one: its row is the agreed record
        if lr != lr:  # a hyper-parameter is not finite: the full measure names it
            return None
        self._start.buffers.learn(step)
        values, norms = read
        count, cut = len(losses), len(grads)
        data_time, compute_time = self._timer.take() if self._timer is not None else (0.0, 0.0)
        # ``folded_row.reduce_row`` of a row read finite: the check is the losses' sum, the
        # reported loss their mean, the input column's finiteness is known (0: checked)
        check = values[0] if count == 1 else sum(values[:count])
        agreement = Agreement(
            loss_ranks=[],
            grad_ranks=[],
            exhausted_ranks=[],
            batches=[stream.batches_seen if stream is not None else 0],
            losses=[check if count == 1 else check / count],
            global_grad_norm=total_norm(values[count : count + cut]),
            input_ranks=[],
            data_times=[data_time],
            compute_times=[compute_time],
            fingerprints=[0.0],
            drops=[dropped] if dropped else [],
            lrs=[lr],
            loss_scales=[0.0],
            unknown_loss_ranks=[] if loss_known else [0],
        )  # ``consensus.alone_agreement`` of those values, built here: a call less a step
        names = self._names if cut == len(self._names) else local_grads(self._named, False)[0]
        return agreement, GradStats(names, norms[:cut], grads, device, input_norms=norms[cut:])

    def _first_gradients_plain(self) -> bool:
        """False (for good) when the gradients are FSDP2 shards: looked up once, at the first
        step with gradients (``take`` skips it from then on)."""
        params = self._params
        if not any(p.grad is not None for p in params):
            return True
        self._sharded_checked = True
        self.active = not is_sharded(params)
        return self.active

    def _read(
        self, losses: list[Tensor], grads: list[Tensor], inputs: list[Tensor]
    ) -> tuple[list[float], list[Tensor]] | None:
        """The folded row ``[losses..., gradient norms..., input norms...]`` read on the host
        (``folded_row``), and the norms."""
        try:
            norms = torch._foreach_norm(grads + inputs, 2.0, dtype=torch.float32)
            pieces = [*losses, *norms]
            if self._reads_items and len(pieces) <= ITEM_READS:
                values: list[float] = list(map(Tensor.item, pieces))
            else:
                values = torch.stack(pieces).tolist()
        except (RuntimeError, TypeError):  # sparse/float64 gradients, several devices
            self.active = False  # the full measure's mixed pass, from now on
            return None
        return values, list(norms)
