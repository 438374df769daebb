"""The one per-step path: measure -> agree -> decide -> record -> apply.

Every way a step reaches the guard runs it: ``check()`` (and ``check_gradients()``, the
framework callbacks, ``trainguard run``) runs the five stages in turn; the sync-free
``step()`` (``step/syncfree.py``) runs the first two at once and the other three a step
later, when the host reads the agreed flags. A process alone is a mode of the same stages,
not a copy of them: its agreement is its own row, and its usual step is measured in one
fused pass read straight back (``single_process.AloneMeasure``).

- **measure**: this rank's row (``StepMeasure``): the losses, the gradient norms, the input
  column, the replica fingerprint, the data state, the timings, the learning rate, the loss
  scale.
- **agree**: one all-reduce of the rows (``Consensus``; none with one rank), the masks
  forgiven (``InputCheck.forgive_masks``), a bad step rerun and agreed again
  (``TransientFaults``).
- **decide**: from the ``Agreement`` and the guard's replicated state only (its count of bad
  steps in a row, the spike rule's statistics): ``policy.decide``, then the spike rule. No
  optimizer, rank or clock reaches it: what a rule needs of a rank rides the row.
- **record**: the stream told the agreed data state, the step's record (``StepHistory``).
- **apply**: ``DecisionApply`` (counters, recovery, clipping, dropping, capture, raising),
  then the cross-rank health rules (``HealthRules``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from trainguard.config import GuardConfig
from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.health.learning_rates import LrAgreement
from trainguard.health.replicas import ReplicaWatch
from trainguard.health.stragglers import StragglerWatch
from trainguard.recovery.failure.boundary import StepBoundary
from trainguard.step import amp
from trainguard.step.apply import DecisionApply
from trainguard.step.batch_stream import BatchStream
from trainguard.step.consensus import Consensus
from trainguard.step.deferred import PendingStep
from trainguard.step.detect import GradStats
from trainguard.step.evidence import StepEvidence
from trainguard.step.history import StepHistory
from trainguard.step.inputs import InputCheck
from trainguard.step.losses import StepLosses
from trainguard.step.measure import StepMeasure
from trainguard.step.policy import decide
from trainguard.step.single_process import AloneMeasure
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.state import GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.transient import TransientFaults
from trainguard.step.types import USUAL_CALL, Agreement, Decision, StepCall

logger = logging.getLogger(__name__)


class StepPipeline:
    """The stages of a step, and ``check()``, the driver that runs them in turn."""

    def __init__(
        self,
        config: GuardConfig,
        state: GuardState,
        progress: Progress,
        consensus: Consensus,
        start: StepStart,
        losses: StepLosses,
        measure: StepMeasure,
        alone: AloneMeasure | None,
        inputs: InputCheck,
        spikes: SpikeWatch,
        history: StepHistory,
        apply: DecisionApply,
        evidence: StepEvidence,
        health: HealthRules | None,
        events: EventLog,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
    ) -> None:
        self.config = config
        self.state = state
        self.progress = progress
        self.consensus = consensus
        self.start = start
        self.losses = losses
        self.measure = measure
        self.alone = alone
        """A world of one's measure of its usual step (None with other ranks)."""
        self.inputs = inputs
        self.spikes = spikes
        self.history = history
        self.evidence = evidence
        self.optimizer = optimizer
        self.events = events
        self.health = health
        """The cross-rank health rules; None with one rank (no other rank to compare)."""
        self._apply = apply
        self._scaler = scaler
        self._unscaled: Any = None
        """The scaler's state of the step this guard unscaled last (``amp.unscale``)."""
        self._told_not_updated = False
        self.transient: TransientFaults | None = None
        """``rerun=``: the agree stage reruns a bad step (``step/transient.py``)."""
        self.stream: BatchStream | None = None
        """The ``watch()`` stream of the loop (``Guard.watch`` sets it), None without one."""
        self.boundary: StepBoundary | None = None
        """Recovery's step boundary (states at a failure): closed when a decision begins."""

    def watching(self, stream: BatchStream) -> None:
        """The loop's ``watch()`` stream from now on (its data state rides the row)."""
        self.stream = stream
        if self.alone is not None:
            self.alone.stream = stream

    # -- the driver of check() -------------------------------------------------------------

    def check(self, loss: Tensor, call: StepCall = USUAL_CALL) -> bool:
        """The five stages on the step in progress: ``check()``'s answer (True: the optimizer
        may step, the same on every rank)."""
        step = self.state.step
        alone, measured = self.alone, None
        if alone is not None and self._scaler is None and not call.leaving:  # a scaler unscales
            # first, and the fast row has no leaving column: agree()
            measured = alone.take(loss, step, call.dropped, call.loss_known)
        agreement, stats = measured if measured is not None else self.agree(loss, step, call)
        if self.boundary is not None:  # the guard's state changes from here
            self.boundary.deciding(step)
        decision, spike = self.decide(agreement, step)
        self.record(step, agreement, spike or decision)
        self.state.step = step + 1
        try:
            return self.apply(decision, spike, agreement, stats, step)
        finally:
            transient = self.transient
            if transient is not None and not transient.looked:  # rerun=: the first step
                transient.first_step(step)
            self.losses.clear()
            self.evidence.taken(step)
            self.progress.enter("step", step + 1)

    # -- the stages --------------------------------------------------------------------------

    def agree(self, loss: Tensor, step: int, call: StepCall) -> tuple[Agreement, GradStats]:
        """Measure this rank's row and agree on it: the ``Agreement`` every rank reads the same,
        and this rank's gradient stats (the norms, for clipping and for naming parameters)."""
        self.progress.enter("check", step)  # a collective may run: a hang is reported here
        if self.start.step != step:
            self.start.missed(step)
        if self._scaler is not None:
            self._unscaled, stale = amp.unscale(self._scaler, self.optimizer, self._unscaled)
            if stale:
                self._say_scaler_not_updated()
        stats, report, sharded = self.measure(loss, step, readback=True, call=call)
        agreement = self.consensus.agree(report, sharded)
        agreement = self.inputs.forgive_masks(agreement, step, self.consensus.any_rank)
        if agreement.bad and self.transient is not None:
            agreement, stats = self.transient.rerun(step, agreement, stats)
        return agreement, stats

    def _say_scaler_not_updated(self) -> None:
        """Once, from rank 0: the loop did not update the scaler after the step before."""
        if self._told_not_updated or self.consensus.rank != 0:
            return
        self._told_not_updated = True
        logger.warning(
            "trainguard: the GradScaler was not updated after the step before (the guard "
            "unscaled this step anew, and backed the scale off if that step overflowed): "
            "call scaler.update() at every step, left out or not; with accelerate under fp16 "
            "call optimizer.step() at every step (its scaler leaves out a step the guard "
            "found bad, then updates itself): docs/guard.md#accelerate"
        )

    def decide(
        self, agreement: Agreement, step: int, device_verdict: list[list[float]] | None = None
    ) -> tuple[Decision, Decision | None]:
        """The step's decision and, on an OK step, the spike rule's verdict (None: no spike
        to act on). From the agreement and the guard's replicated state only.
        ``device_verdict``: the sync-free step's device spike rule, judged on the agreed
        values on the device and read on the host (``spikewatch.staged_verdict``)."""
        decision = decide(agreement, self.config, self.state.consecutive_nonfinite)
        if decision is not Decision.OK:
            return decision, None
        if device_verdict is not None:
            return decision, self.spikes.read(device_verdict, step)
        return decision, self.spikes.judge(agreement, step)

    def record(
        self,
        step: int,
        agreement: Agreement,
        decision: Decision,
        steps_ago: int = 0,
    ) -> None:
        """The stream learns the agreed data state; the step's record is written
        (``steps_ago``: how far behind the step in progress ``step`` is)."""
        stream = self.stream
        if stream is not None:
            stream.agreed(agreement, steps_ago)
        if agreement.leaving_ranks:  # a caller stops guarding: every rank learns it here
            self.state.leaving_ranks = agreement.leaving_ranks
        self.history.record(step, agreement, decision, self.optimizer, agreement.loss_known)

    def apply(
        self,
        decision: Decision,
        spike: Decision | None,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        late: PendingStep | None = None,
        raise_errors: bool = True,
    ) -> bool:
        """Act on the decision (``DecisionApply``), then the cross-rank health rules.
        ``late``: a sync-free step read a step late (its update already decided on the
        device); ``raise_errors`` False: no capture, no error (the run is unwinding)."""
        applied = self._apply.apply(
            decision, agreement, stats, step, spike, agreement.loss_known, late, raise_errors
        )
        if self.health is not None:  # after a skip's restore: a resync stays
            self.health.observe(step, agreement)
        return applied


class HealthRules:
    """The cross-rank health rules on a step's agreement (the same numbers on every rank):
    stragglers, the ranks' learning rates, the replicas' fingerprints."""

    def __init__(
        self, stragglers: StragglerWatch, lrs: LrAgreement, replicas: ReplicaWatch
    ) -> None:
        self._stragglers = stragglers
        self._lrs = lrs
        self._replicas = replicas

    def observe(self, step: int, agreement: Agreement) -> None:
        self._stragglers.observe(step, agreement.data_times, agreement.compute_times)
        self._lrs.observe(step, agreement.lrs, agreement.lrs_differ)
        self._replicas.observe(step, agreement.fingerprints)
