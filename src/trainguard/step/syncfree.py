"""The sync-free ``guard.step()`` in the guard's lifecycle: act on the device now, read later.

The mechanism (``found_inf``, the host stager, the pending step) is in ``deferred.py``; this
part runs one step with it and, a step later, reads the agreed flags on the host and hands
them to the guard's policy: the same events, state, history, capture and errors as
``check()``, one step late. The guard owns the decision logic; this part owns the timing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trainguard.step.consensus import Agreement, Reduced
from trainguard.step.deferred import (
    FoundInf,
    HostStager,
    PendingStep,
    StepOutcome,
    set_found_inf,
)
from trainguard.step.detect import GradStats, clip_on_device_, grad_stats
from trainguard.step.policy import Decision

if TYPE_CHECKING:
    from trainguard.step.guard import Guard


class SyncFreeStep:
    """``guard.step()`` for a fused optimizer without a GradScaler: no host sync per step."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self.pending: PendingStep | None = None
        """The last step, decided on the device and not yet read on the host."""
        self._stager = HostStager()
        self._found_inf = FoundInf()

    def step(self, loss: Tensor) -> StepOutcome:
        """Check, agree, clip and step on the device; read the step before this one."""
        guard = self._guard
        step = guard.state.step
        guard.progress.enter("check", step)
        guard.record_loss(loss)
        sharded = guard._sharded()
        stats = grad_stats(guard._params, guard._consensus.device, sharded)
        reduced = guard._consensus.reduce(guard._report(stats, loss), sharded)
        found_inf = self._found_inf.of(reduced.buf, self._optimizer_device(stats))
        spike = guard.spikes.on_device(guard._consensus, reduced, guard.optimizer, found_inf)
        if guard.config.grad_clip is not None:
            norm = guard._consensus.global_grad_norm(reduced)
            clip_on_device_(stats.grads, norm, guard.config.grad_clip)
        pending = self._pending_step(step, stats, reduced, spike)
        guard.state.step = step + 1
        self.resolve()  # the step before, ahead of this update: weights still pre-update
        set_found_inf(guard.optimizer, found_inf)
        try:
            guard.optimizer.step()
        finally:
            set_found_inf(guard.optimizer, None)
        guard.optimizer.zero_grad(set_to_none=True)
        self.pending = pending
        guard.progress.enter("step", step + 1)
        return StepOutcome(read=lambda: self._read_outcome(pending))

    def _pending_step(
        self,
        step: int,
        stats: GradStats,
        reduced: Reduced,
        spike: tuple[Tensor, torch.cuda.Event | None] | None,
    ) -> PendingStep:
        """The step's staged flags and evidence (batches, RNG, losses: references only)."""
        guard = self._guard
        host_values, ready = self._stager.stage(reduced.buf)
        stream = guard._stream
        pending = PendingStep(
            step,
            host_values,
            ready,
            dataclasses.replace(stats, grads=[]),  # keep no reference to the gradients
            reduced,
            batches=list(stream.current) if stream is not None else [],
            rng=stream.current_rng if stream is not None else None,
            losses=guard._micro_losses,
            spike=spike,
        )
        guard._micro_losses = []
        return pending

    def _optimizer_device(self, stats: GradStats) -> torch.device:
        return stats.grads[0].device if stats.grads else self._guard._consensus.device

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
        guard = self._guard
        agreement = guard._consensus.read(pending.values(), pending.reduced)
        if guard._stream is not None:
            guard._stream.agreed(agreement, steps_ago=guard.state.step - 1 - pending.step)
        decision = guard._decide(agreement)
        guard.history.record(pending.step, agreement, decision, guard.optimizer)
        pending.ok = decision is Decision.OK
        if pending.ok:
            guard.state.record_good(pending.step, agreement.mean_loss)
            spike = self._late_spike(agreement, pending)
            if spike is not None:
                pending.ok = False  # skipped on the device (found_inf)
                self._resolve_spike(spike, agreement, pending, raise_errors)
            return
        guard.state.record_bad(pending.step)
        guard._log_nonfinite(decision, agreement, pending.stats, pending.step)
        bundle = None  # capture: weights and moments are as before the skipped step
        if raise_errors:  # not while unwinding: other ranks may not join the capture
            bundle = guard._capture(decision, agreement, pending.stats, pending.step, pending)
        if decision in (Decision.SKIP, Decision.WARN):
            consecutive = guard.state.consecutive_nonfinite
            guard.events.write("skip", pending.step, consecutive=consecutive)
        elif raise_errors:
            raise guard._stop_error(decision, agreement, pending.step, bundle)

    def _late_spike(self, agreement: Agreement, pending: PendingStep) -> Decision | None:
        """The spike verdict: judged on the device when a spike must skip the update
        (``found_inf``), else judged now on the host from the agreed values."""
        spikes = self._guard.spikes
        if pending.spike is not None:
            return spikes.read_staged(pending.spike, pending.step)
        spikes.judge(agreement, self._guard.optimizer, pending.step)  # "warn": events only
        return None

    def _resolve_spike(
        self, decision: Decision, agreement: Agreement, pending: PendingStep, raise_errors: bool
    ) -> None:
        """A spike the step skipped on the device, read a step late."""
        guard = self._guard
        bundle = None
        if raise_errors:  # weights and moments are as before the skipped step
            bundle = guard._capture(
                decision, agreement, pending.stats, pending.step, pending, spike=True
            )
        if decision is Decision.ESCALATE:
            if raise_errors:
                raise guard.spikes.error(pending.step, bundle)
            return
        consecutive = guard.spikes.consecutive
        guard.events.write("skip", pending.step, reason="spike", consecutive=consecutive)
