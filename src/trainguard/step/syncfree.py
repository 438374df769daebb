"""The sync-free ``guard.step()`` in the guard's lifecycle: act on the device now, read later.

The mechanism (``found_inf``, the host stager, the pending step) is in ``deferred.py``; this
part runs one step with it and, a step later, reads the agreed flags on the host and hands
them to the guard's policy: the same events, state, history, capture and errors as
``check()``, one step late. The guard lends the parts this needs (``SyncFreeParts``): the
shared objects, and its own actions as callables; this module never sees the Guard.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainguard.capture.rng import RngSnapshot
from trainguard.config import GuardConfig
from trainguard.errors import NonFiniteError
from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.step.consensus import Consensus
from trainguard.step.deferred import (
    FoundInf,
    HostStager,
    PendingStep,
    StepOutcome,
    set_found_inf,
)
from trainguard.step.detect import GradStats, clip_on_device_
from trainguard.step.history import StepHistory
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.state import GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.types import Agreement, Decision, LocalReport, Reduced

Measure = Callable[[Tensor], tuple[GradStats, LocalReport, bool]]
"""Record the loss, take the gradient pass: ``(stats, this rank's report, sharded)``."""


@dataclass
class SyncFreeParts:
    """What the guard lends the sync-free step."""

    config: GuardConfig
    state: GuardState
    progress: Progress
    consensus: Consensus
    spikes: SpikeWatch
    history: StepHistory
    events: EventLog
    optimizer: torch.optim.Optimizer
    start: StepStart
    measure: Measure
    take_losses: Callable[[], list[Tensor]]
    """Hand over the step's recorded micro-losses (the guard starts a new list)."""
    step_batches: Callable[[int], tuple[list[Any], RngSnapshot | dict[str, Any] | None]]
    """The step's micro-batches and the RNG states taken when its first was handed out."""
    agreed: Callable[[Agreement, int], None]
    """Tell the batch stream a step's agreement (``steps_ago``)."""
    decide: Callable[[Agreement], Decision]
    forgive_masks: Callable[[Agreement, int], Agreement]
    """``InputCheck.forgive_masks`` (every rank, one more all-reduce on such a step only)."""
    health: Callable[[int, Agreement], None]
    """The cross-rank health rules (stragglers, replicas) on a step's agreement."""
    log_nonfinite: Callable[[Decision, Agreement, GradStats, int], None]
    capture: Callable[[Decision, Agreement, GradStats, int, PendingStep, bool], Path | None]
    stop_error: Callable[[Decision, Agreement, int, Path | None], NonFiniteError]


class SyncFreeStep:
    """``guard.step()`` for a fused optimizer without a GradScaler: no host sync per step."""

    def __init__(self, parts: SyncFreeParts) -> None:
        self._parts = parts
        self.pending: PendingStep | None = None
        """The last step, decided on the device and not yet read on the host."""
        self._stager = HostStager()
        self._found_inf = FoundInf()

    def step(self, loss: Tensor) -> StepOutcome:
        """Check, agree, clip and step on the device; read the step before this one."""
        parts = self._parts
        step = parts.state.step
        parts.progress.enter("check", step)
        stats, report, sharded = parts.measure(loss)
        reduced = parts.consensus.reduce(report, sharded)
        found_inf = self._found_inf.of(reduced.buf, self._optimizer_device(stats))
        if report.lr != report.lr:  # a hyper-parameter is not finite (a world of one's row
            found_inf.fill_(1.0)  # holds no host column): skipped on the device, no sync
        spike = parts.spikes.on_device(parts.consensus, reduced, found_inf)
        if parts.config.grad_clip is not None:
            norm = parts.consensus.global_grad_norm(reduced)
            clip_on_device_(stats.grads, norm, parts.config.grad_clip)
        parts.start.buffers.restore_where(found_inf, step)  # a skipped step's forward undone
        pending = self._pending_step(step, stats, reduced, spike)
        parts.state.step = step + 1
        try:
            self.resolve()  # the step before, ahead of this update: weights still pre-update
        except BaseException:
            # the run stops before this step's update: its forward's buffer writes are put
            # back and it is not counted, as check() leaves the step after one it raised at
            parts.start.buffers.restore(step)
            parts.state.step = step
            raise
        set_found_inf(parts.optimizer, found_inf)
        try:
            parts.optimizer.step()
        finally:
            set_found_inf(parts.optimizer, None)
        parts.optimizer.zero_grad(set_to_none=True)
        self.pending = pending
        parts.progress.enter("step", step + 1)
        return StepOutcome(read=lambda: self._read_outcome(pending))

    def _pending_step(
        self,
        step: int,
        stats: GradStats,
        reduced: Reduced,
        spike: tuple[Tensor, torch.cuda.Event | None] | None,
    ) -> PendingStep:
        """The step's staged flags and evidence (batches, RNG, losses: references only)."""
        parts = self._parts
        host_values, ready = self._stager.stage(reduced.buf)
        batches, rng = parts.step_batches(step)
        return PendingStep(
            step,
            host_values,
            ready,
            dataclasses.replace(stats, grads=[]),  # keep no reference to the gradients
            reduced,
            batches=batches,
            rng=rng,
            losses=parts.take_losses(),
            spike=spike,
            autocast=parts.start.autocast if parts.start.started(step) else None,
            forward_inputs=parts.start.forward_inputs(step),
        )

    def _optimizer_device(self, stats: GradStats) -> torch.device:
        return stats.grads[0].device if stats.grads else self._parts.consensus.device

    def _read_outcome(self, pending: PendingStep) -> bool:
        if pending.ok is None:
            self.resolve()
        return bool(pending.ok)

    def resolve(self, raise_errors: bool = True) -> None:
        """Read the last sync-free step's flags on the host and act on them.

        Called only where every rank calls it (``step()``, ``check()``, ``close()``, the
        outcome), since acting may capture (a collective) or raise."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        parts = self._parts
        agreement = parts.consensus.read(pending.values(), pending.reduced)
        parts.agreed(agreement, parts.state.step - 1 - pending.step)
        if raise_errors and self._mask_learned(agreement, pending):
            return
        decision = parts.decide(agreement)
        spike = self._late_spike(agreement, pending) if decision is Decision.OK else None
        parts.history.record(pending.step, agreement, spike or decision, parts.optimizer)
        parts.health(pending.step, agreement)
        pending.ok = decision is Decision.OK and spike is None
        if spike is not None:  # skipped on the device (found_inf)
            self._resolve_spike(spike, agreement, pending, raise_errors)
            return
        if pending.ok:
            parts.state.record_good(pending.step, agreement.mean_loss)
            return
        parts.state.record_bad(pending.step)
        parts.log_nonfinite(decision, agreement, pending.stats, pending.step)
        bundle = None  # capture: weights and moments are as before the skipped step
        if raise_errors:  # not while unwinding: other ranks may not join the capture
            bundle = parts.capture(decision, agreement, pending.stats, pending.step, pending, False)
        if decision in (Decision.SKIP, Decision.WARN):
            consecutive = parts.state.consecutive_nonfinite
            parts.events.write("skip", pending.step, consecutive=consecutive)
        elif raise_errors:
            raise parts.stop_error(decision, agreement, pending.step, bundle)

    def _mask_learned(self, agreement: Agreement, pending: PendingStep) -> bool:
        """A step whose only fault was an additive mask in its inputs (``allow_masks``): the
        device had left its update out already (its input column is not finite); the mask is
        learned now, so the next steps are not skipped for it, and the step recorded as a
        skip for that reason, not as a bad step."""
        if not agreement.input_ranks:
            return False
        parts = self._parts
        forgiven = parts.forgive_masks(agreement, pending.step)
        if forgiven.input_ranks:
            return False
        parts.history.record(pending.step, forgiven, Decision.SKIP, parts.optimizer)
        parts.health(pending.step, forgiven)
        pending.ok = False
        parts.events.write("skip", pending.step, reason="input_mask")
        return True

    def settled_state(self) -> tuple[dict[str, Any], int | None]:
        """The guard's counters as they will be once the pending step is read, and that step
        when reading it will stop the run (None: it will not). Nothing is acted on and no
        rank waits for another: this rank's copy of the agreed flags is read (a host wait
        for that copy only), so ``state_dict()`` may still be called on rank 0 alone."""
        parts = self._parts
        counters = parts.state.state_dict()
        pending = self.pending
        if pending is None:
            return counters, None
        agreement = parts.consensus.read(pending.values(), pending.reduced)
        decision = parts.decide(agreement)
        settled = GuardState(nonfinite_steps=deque(maxlen=parts.state.nonfinite_steps.maxlen))
        settled.load_state_dict(counters)
        if decision is Decision.OK and pending.spike is None:
            settled.record_good(pending.step, agreement.mean_loss)
        elif decision is not Decision.OK:
            settled.record_bad(pending.step)
        stops = decision in (Decision.RAISE, Decision.ESCALATE)
        return {**counters, **settled.state_dict()}, pending.step if stops else None

    def _late_spike(self, agreement: Agreement, pending: PendingStep) -> Decision | None:
        """The spike verdict: judged on the device when a spike must skip the update
        (``found_inf``), else judged now on the host from the agreed values."""
        spikes = self._parts.spikes
        if pending.spike is not None:
            return spikes.read_staged(pending.spike, pending.step)
        spikes.judge(agreement, pending.step)  # "warn": events only
        return None

    def _resolve_spike(
        self, decision: Decision, agreement: Agreement, pending: PendingStep, raise_errors: bool
    ) -> None:
        """A spike the step skipped on the device, read a step late."""
        parts = self._parts
        bundle = None
        if raise_errors:  # weights and moments are as before the skipped step
            bundle = parts.capture(decision, agreement, pending.stats, pending.step, pending, True)
        if decision is Decision.ESCALATE:
            if raise_errors:
                raise parts.spikes.error(pending.step, bundle)
            return
        consecutive = parts.spikes.consecutive
        parts.events.write("skip", pending.step, reason="spike", consecutive=consecutive)
