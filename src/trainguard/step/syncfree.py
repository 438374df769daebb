"""The sync-free ``guard.step()``: the pipeline's stages split across two steps.

The mechanism (``found_inf``, the host stager, the pending step) is in ``deferred.py``. This
mode runs the pipeline's measure and agree stages now, on the device (the all-reduce
started, never read: the agreed "bad somewhere" flag goes to the fused optimizer as
``found_inf``, a spike the rule skips folded in on the device, the clip by the agreed norm
on the device), and its decide, record and apply stages a step later, when the host reads
the agreed flags (``resolve``): the same stages as ``check()`` (``step/pipeline.py``), so
the same events, state, history, capture and errors, one step late.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch
from torch import Tensor

from trainguard.step.deferred import (
    FoundInf,
    HostStager,
    PendingStep,
    StepOutcome,
    set_found_inf,
)
from trainguard.step.detect import GradStats, clip_on_device_
from trainguard.step.pipeline import StepPipeline
from trainguard.step.policy import decide
from trainguard.step.spikewatch import Staged, staged_verdict
from trainguard.step.state import GuardState
from trainguard.step.types import Agreement, Decision, Reduced


class SyncFreeStep:
    """``guard.step()`` for a fused optimizer without a GradScaler: no host sync per step."""

    def __init__(self, pipeline: StepPipeline) -> None:
        self._pipeline = pipeline
        self.pending: PendingStep | None = None
        """The last step, decided on the device and not yet read on the host."""
        self._stager = HostStager()
        self._found_inf = FoundInf()

    def step(self, loss: Tensor) -> StepOutcome:
        """Measure, agree, clip and step on the device; read the step before this one."""
        pipeline = self._pipeline
        step = pipeline.state.step
        pipeline.progress.enter("check", step)
        stats, report, sharded = pipeline.measure(loss, step)
        reduced = pipeline.consensus.reduce(report, sharded)
        found_inf = self._found_inf.of(reduced.buf, self._optimizer_device(stats))
        if pipeline.consensus.world_size == 1 and report.lr != report.lr:
            # a hyper-parameter is not finite: a world of one's row is its agreement, and its
            # device buffer holds no host column (with other ranks the reduced buffer carries
            # the NaN, and found_inf has it on every rank): skipped on the device, no sync
            found_inf.fill_(1.0)
        spike = pipeline.spikes.on_device(pipeline.consensus, reduced, found_inf)
        if pipeline.config.grad_clip is not None:
            norm = pipeline.consensus.global_grad_norm(reduced)
            clip_on_device_(stats.grads, norm, pipeline.config.grad_clip)
        pipeline.start.buffers.restore_where(found_inf, step)  # a skipped step's forward undone
        pending = self._pending_step(step, stats, reduced, spike)
        pipeline.state.step = step + 1
        try:
            self.resolve()  # the step before, ahead of this update: weights still pre-update
        except BaseException:
            # the run stops before this step's update: its forward's buffer writes are put
            # back and it is not counted, as check() leaves the step after one it raised at
            pipeline.start.buffers.restore(step)
            pipeline.state.step = step
            raise
        optimizer = pipeline.optimizer
        set_found_inf(optimizer, found_inf)
        try:
            optimizer.step()
        finally:
            set_found_inf(optimizer, None)
        optimizer.zero_grad(set_to_none=True)
        self.pending = pending
        pipeline.progress.enter("step", step + 1)
        return StepOutcome(read=lambda: self._read_outcome(pending))

    def _pending_step(
        self, step: int, stats: GradStats, reduced: Reduced, spike: Staged | None
    ) -> PendingStep:
        """The step's staged flags and evidence (batches, RNG, losses: references only)."""
        pipeline = self._pipeline
        host_values, ready = self._stager.stage(reduced.buf)
        draws = pipeline.evidence.sampler_draws(step)  # read only if the step is bad
        batches, rng = pipeline.evidence.step_batches_taken(step)
        start = pipeline.start
        return PendingStep(
            step,
            host_values,
            ready,
            dataclasses.replace(stats, grads=[]),  # keep no reference to the gradients
            reduced,
            batches=batches,
            rng=rng,
            losses=pipeline.losses.take(),
            spike=spike,
            autocast=start.autocast if start.started(step) else None,
            forward_inputs=start.forward_inputs(step),
            forward_batches=None if batches else start.forward_batches(step),
            sampler_draws=draws,
        )

    def _optimizer_device(self, stats: GradStats) -> torch.device:
        return stats.grads[0].device if stats.grads else self._pipeline.consensus.device

    def _read_outcome(self, pending: PendingStep) -> bool:
        if pending.ok is None:
            self.resolve()
        return bool(pending.ok)

    def resolve(self, raise_errors: bool = True) -> None:
        """Read the last sync-free step's flags on the host and run the pipeline's decide,
        record and apply stages on them.

        Called only where every rank calls it (``step()``, ``check()``, ``close()``, the
        outcome), since acting may capture (a collective) or raise. ``raise_errors`` False
        (the run unwinds): no capture, no error."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pipeline = self._pipeline
        agreement = pipeline.consensus.read(pending.values(), pending.reduced)
        steps_ago = pipeline.state.step - 1 - pending.step
        if raise_errors and self._mask_learned(agreement, pending, steps_ago):
            return
        verdict = staged_verdict(pending.spike) if pending.spike is not None else None
        decision, spike = pipeline.decide(agreement, pending.step, verdict)
        pipeline.record(pending.step, agreement, spike or decision, steps_ago=steps_ago)
        pending.ok = decision is Decision.OK and spike is None
        pipeline.apply(
            decision,
            spike,
            agreement,
            pending.stats,
            pending.step,
            late=pending,
            raise_errors=raise_errors,
        )

    def _mask_learned(self, agreement: Agreement, pending: PendingStep, steps_ago: int) -> bool:
        """A step whose only fault was an additive mask in its inputs (``allow_masks``): the
        device had left its update out already (its input column is not finite); the mask is
        learned now, so the next steps are not skipped for it, and the step recorded as a
        skip for that reason, not as a bad step."""
        if not agreement.input_ranks:
            return False
        pipeline = self._pipeline
        consensus = pipeline.consensus
        forgiven = pipeline.inputs.forgive_masks(agreement, pending.step, consensus.any_rank)
        if forgiven.input_ranks:
            return False
        pipeline.record(pending.step, forgiven, Decision.SKIP, steps_ago=steps_ago)
        if pipeline.health is not None:
            pipeline.health.observe(pending.step, forgiven)
        pending.ok = False
        pipeline.events.write("skip", pending.step, reason="input_mask")
        return True

    def settled_state(self) -> tuple[dict[str, Any], int | None]:
        """The guard's counters as they will be once the pending step is read, and that step
        when reading it will stop the run (None: it will not). Nothing is acted on and no
        rank waits for another: this rank's copy of the agreed flags is read (a host wait
        for that copy only), so ``state_dict()`` may still be called on rank 0 alone."""
        pipeline = self._pipeline
        state = pipeline.state
        counters = state.state_dict()
        pending = self.pending
        if pending is None:
            return counters, None
        agreement = pipeline.consensus.read(pending.values(), pending.reduced)
        decision = decide(agreement, pipeline.config, state.consecutive_nonfinite)
        settled = GuardState(nonfinite_steps=deque(maxlen=state.nonfinite_steps.maxlen))
        settled.load_state_dict(counters)
        if decision is Decision.OK and pending.spike is None:
            settled.record_good(pending.step, agreement.mean_loss)
        elif decision is not Decision.OK:
            settled.record_bad(pending.step)
        stops = decision in (Decision.RAISE, Decision.ESCALATE)
        return {**counters, **settled.state_dict()}, pending.step if stops else None
