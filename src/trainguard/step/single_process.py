"""The usual step of a process alone, checked, recorded and applied in few calls.

``check()``'s full path (``StepMeasure`` -> ``Consensus.agree`` -> ``policy.decide`` ->
``StepHistory.record`` -> ``DecisionApply.apply``) is built for every case: other ranks, a
GradScaler, accumulated losses, sharded, sparse or float64 gradients, inputs on other
devices, a non-finite value to locate, a spike to skip. In a world of one most steps are
none of these, and there the layers are what the guard costs: on a model whose step takes a
few hundred microseconds, each Python call between two training steps costs several times
what it costs in a loop of its own (the step's kernels evict the guard's code and data from
the caches), so the count of distinct calls set the fixed cost (``git show
3c1ebd7:docs/benchmarks.md``, "Round 6"; "Round 7" counts what is left: the default
features' own work).

``LoneStep.take(loss, loss_known)`` takes such a step whole:

- the measure: the gradients' and the step inputs' norms in one fused ``_foreach_norm``,
  read with the step's losses (those recorded with ``record_loss`` and ``check()``'s,
  ``StepLosses.checked``) in one go: on the CPU, where a read is no device sync, value by
  value (``Tensor.item``: a ``stack`` costs more than a few reads), elsewhere one ``stack``
  and one read. These are the values the folded row of the full path holds
  (``folded_row``), the gradient norm taken by the same ``total_norm``;
- the outcome, as the full path records and applies a good step (the same calls, without
  the ``Agreement`` the full path builds for the ranks): the buffers learned, the stream
  told that no rank ran out, the spike rule's verdict (``DecisionApply.judge_spike``), the
  step's record (ring and metrics log), then the full path's own
  ``DecisionApply.apply_good`` (the counters, recovery's note of a good step, clipping), the
  step's batches released.

It returns what ``check()`` returns (True; False when a spike is skipped), or None when the
step is not the usual one, having changed nothing the full path does not set again (the
step's losses, ``StepLosses.checked``); the full path then measures and decides it as
always:

- a value is not finite (a loss, a gradient norm or an input norm; or their sum
  overflows): the full path locates, confirms and captures it;
- a loss of the step is not a float32 0-d tensor on the guard's device
  (``folded_row.foldable_losses``, the full path's own test);
- the step's start was not recorded by the forward hook (the full path looks for it);
- the ``watch()`` stream ran out (the data state must be agreed);
- an input the fused pass does not take (``InputCheck.foldable``);
- no gradient at all (the full path warns), or gradients the fused pass refuses (sparse,
  float64, on several devices) or FSDP2 shards: then it stops trying for the run.

A spike the rule skips (``on_spike="skip"``/``"rollback"``) is handed to the full path's
``DecisionApply.apply_spike`` with the agreement and gradient stats the full path would
have built. The guard builds ``LoneStep`` for a world of one only, and uses it without a
GradScaler (``Guard.check``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainguard.hang.progress import Progress
from trainguard.health.timing import StepTimer
from trainguard.step.batch_stream import BatchStream
from trainguard.step.consensus import alone_agreement
from trainguard.step.detect import GradStats, is_sharded, local_grads
from trainguard.step.evidence import StepEvidence
from trainguard.step.folded_row import foldable_losses, reduce_row, total_norm
from trainguard.step.history import StepHistory, learning_rate
from trainguard.step.hyperparams import group_lrs, row_lr
from trainguard.step.inputs import InputCheck
from trainguard.step.losses import StepLosses
from trainguard.step.state import GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.types import Agreement, Decision

ITEM_READS = 24
"""On the CPU a value is read without a device sync: up to this many values are read one by
one (``Tensor.item``, about 0.3 us each), which costs less than ``stack`` and one read; past
it, and on every other device, one ``stack`` and one read."""


@dataclass
class LoneParts:
    """What the usual step uses of the guard (handed over explicitly, as ``ApplyParts``)."""

    params: list[tuple[str, nn.Parameter]]
    device: torch.device
    """Where the losses must be (``Consensus.device``)."""
    state: GuardState
    progress: Progress
    start: StepStart
    losses: StepLosses
    inputs: InputCheck
    evidence: StepEvidence
    timer: StepTimer | None
    history: StepHistory
    optimizer: torch.optim.Optimizer
    judge_spike: Callable[[int, float, float, float | None], Decision | None]
    """``DecisionApply.judge_spike``: the spike rule's verdict, before the step is recorded."""
    apply_good: Callable[[int, float, float, list[Tensor]], bool]
    """``DecisionApply.apply_good``: what a good step does (counters, recovery, clipping),
    as on the full path."""
    apply_spike: Callable[[Decision, Agreement, GradStats, int], bool]
    """``DecisionApply.apply_spike``: a spike the rule skips or escalates."""


def _unused() -> float:
    raise AssertionError("a usual step's input norms are finite: nothing to confirm")


class LoneStep:
    """``take(loss, loss_known)``: ``check()``'s answer when the step is the usual one (then
    it is decided, recorded and applied), else None (the full path takes it)."""

    def __init__(self, parts: LoneParts) -> None:
        self._parts = parts
        self._params = [p for _, p in parts.params]
        self._reads_items = parts.device.type == "cpu"
        self.stream: BatchStream | None = None
        """The ``watch()`` stream of the loop (``Guard.watch`` sets it), None without one."""
        self.active = True
        """False once the gradients were found to be shards or refused by the fused pass."""
        self._sharded_checked = False

    def take(self, loss: Tensor, loss_known: bool = True) -> bool | None:
        """Decide, record and apply the step when it is the usual one (the module
        docstring) and return ``check()``'s answer, else None. ``loss_known`` False: the
        record holds no loss (``Guard.check_gradients``)."""
        parts = self._parts
        step = parts.state.step
        if not self.active or parts.start.step != step:
            return None
        losses = parts.losses.checked(loss)  # detached; the full path sets the same again
        if not foldable_losses(losses, parts.device):
            return None
        stream = self.stream
        if stream is not None and stream.exhausted:
            return None
        batches = parts.evidence.batches_of(step)
        inputs = parts.inputs.foldable(step, batches, parts.device, keep=False)
        if inputs is None or not (self._sharded_checked or self._first_gradients_plain()):
            return None
        grads = [grad for p in self._params if (grad := p.grad) is not None]
        if not grads:
            return None
        read = self._read(losses, grads, inputs)
        if read is None or not math.isfinite(sum(read[0])):  # NaN/Inf anywhere, or overflow
            return None
        lr = row_lr(parts.optimizer)  # a world of one: its row is the agreed record
        if lr != lr:  # a hyper-parameter is not finite: the full path decides it
            return None
        values, norms = read
        count, cut = len(losses), len(losses) + len(grads)
        norm = total_norm(values[count:cut])
        reported = values[0] if count == 1 else sum(values[:count]) / count  # the mean
        return self._commit(step, reported, norm, loss_known, lr, (values, norms, grads))

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
            self.active = False  # the full path's mixed pass, from now on
            return None
        return values, list(norms)

    def _commit(
        self,
        step: int,
        loss: float,
        norm: float,
        loss_known: bool,
        own_lr: float,
        measured: tuple[list[float], list[Tensor], list[Tensor]],
    ) -> bool:
        """The usual step is good: what ``check()`` does after the full path's measure and
        agreement, for a good step, in the same order (``own_lr``: the row's learning rate,
        ``hyperparams.row_lr``)."""
        parts = self._parts
        parts.start.buffers.learn(step)
        data_time, compute_time = parts.timer.take() if parts.timer is not None else (0.0, 0.0)
        stream = self.stream
        if stream is not None:
            stream.agreed_running()
        spike = parts.judge_spike(step, loss, norm, own_lr or None)
        lr, lrs = learning_rate(parts.optimizer), group_lrs(parts.optimizer)
        losses = [loss] if loss_known else []
        decision = "ok" if spike is None else spike.value
        parts.history.add(step, losses, norm, decision, lr, [data_time], [compute_time], lrs)
        parts.state.step = step + 1
        try:
            if spike is not None:
                return self._spiked(spike, step, measured, (data_time, compute_time))
            return parts.apply_good(step, loss, norm, measured[2])
        finally:
            parts.losses.clear()
            parts.evidence.taken(step)
            parts.progress.enter("step", step + 1)

    def _spiked(
        self,
        spike: Decision,
        step: int,
        measured: tuple[list[float], list[Tensor], list[Tensor]],
        times: tuple[float, float],
    ) -> bool:
        """A spike the rule skips or escalates: the full path's ``apply_spike``, with the
        agreement and gradient stats the full path would have built."""
        parts = self._parts
        values, norms, grads = measured
        names, _ = local_grads(parts.params, sharded=False)
        count, cut = len(values) - len(norms), len(grads)
        stream = self.stream
        agreement = alone_agreement(
            reduce_row(values, count, cut, _unused),
            exhausted=False,
            batches=stream.batches_seen if stream is not None else 0,
            data_time=times[0],
            compute_time=times[1],
        )
        stats = GradStats(names, norms[:cut], grads, parts.device, input_norms=norms[cut:])
        return parts.apply_spike(spike, agreement, stats, step)
