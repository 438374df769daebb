"""Acting on the step's decision, the same on every rank (``policy.decide`` made it).

``OK``: the spike rule judged it first (the pipeline's decide stage, before the step is
recorded, so a spike it skips is recorded as one); a spike it skips or escalates goes to
``apply_spike`` (dropped like a non-finite step); else the counters learn a good step,
recovery notes it, the gradients are clipped by the agreed global norm. ``OVERFLOW`` (fp16
with a GradScaler): the scaler's skip, counted. ``DROPPED`` (``trainguard run``: a rank's
loop left the update out itself): the update dropped on every rank, not counted bad.
``SKIP`` / ``RAISE`` / ``ESCALATE``: the step is counted bad, logged (``nonfinite``), captured
on the first occurrence and on escalation (``evidence``), its update dropped (``drop``:
gradients cleared, buffers put back); ``RAISE``/``ESCALATE`` raise the stop error, unless
``on_escalation="rollback"`` rolls the run back and goes on. A sync-free step read a step
late (``late``) had its update left out on the device already: the same, minus the drop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainguard.config import GuardConfig
from trainguard.errors import NonFiniteError
from trainguard.events import EventLog
from trainguard.recovery import Recovery, record_final_stop
from trainguard.step import amp
from trainguard.step.deferred import PendingStep
from trainguard.step.detect import GradStats, clip_
from trainguard.step.evidence import StepEvidence
from trainguard.step.hyperparams import nonfinite_hyperparameters
from trainguard.step.inputs import InputCheck
from trainguard.step.nonfinite import log_nonfinite, stop_error
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.state import GuardState
from trainguard.step.types import Agreement, Decision
from trainguard.step.update_drop import UpdateDrop

logger = logging.getLogger(__name__)


@dataclass
class ApplyParts:
    """What acting on a decision uses of the guard (handed over explicitly)."""

    config: GuardConfig
    state: GuardState
    spikes: SpikeWatch
    recovery: Recovery | None
    scaler: Any
    optimizer: torch.optim.Optimizer
    events: EventLog
    rank: int
    inputs: InputCheck
    evidence: StepEvidence
    drop: UpdateDrop


class DecisionApply:
    """``apply(decision, ...)``: True when the optimizer may step."""

    def __init__(self, parts: ApplyParts) -> None:
        self._parts = parts

    def apply(
        self,
        decision: Decision,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        spike: Decision | None = None,
        loss_known: bool = True,
        late: PendingStep | None = None,
        raise_errors: bool = True,
    ) -> bool:
        """Act on the step's decision; ``spike``: the spike rule's verdict on an OK step.
        ``late``: a sync-free step read a step late: the device already left a bad step's
        update out (``found_inf``) and put its buffers back, and clipped a good one;
        ``raise_errors`` False (the run unwinds): such a step is neither captured nor raised
        at, as the other ranks may not join."""
        parts = self._parts
        if decision is Decision.OK:
            if spike is not None:
                return self.apply_spike(
                    spike, agreement, stats, step, loss_known, late, raise_errors
                )
            return self.apply_good(step, agreement.mean_loss, agreement.grad_norm, stats.grads)
        if decision is Decision.DROPPED:
            return self.apply_dropped(agreement, step)
        if parts.scaler is not None:
            amp.mark_overflow(parts.scaler, parts.optimizer)
        if decision is Decision.OVERFLOW:
            parts.state.overflow_steps += 1
            if not agreement.scaler_dropped:  # else every rank's scaler left it out already
                parts.drop(step)
            parts.events.write("overflow", step, ranks=agreement.grad_ranks)
            return False
        parts.state.record_bad(step)
        if parts.recovery is not None:
            parts.recovery.after_step(step, False, agreement.mean_loss)
        self.log_nonfinite(decision, agreement, stats, step, late)
        bundle = self._capture(decision, agreement, stats, step, loss_known, late, raise_errors)
        if decision is Decision.ESCALATE and self._rolled_back(step):
            return False
        if late is not None:
            return self._bad_late(decision, agreement, step, bundle, raise_errors)
        if decision is Decision.SKIP:
            restored = parts.drop(step)
            consecutive = parts.state.consecutive_nonfinite
            parts.events.write("skip", step, consecutive=consecutive, buffers_restored=restored)
        elif decision in (Decision.RAISE, Decision.ESCALATE):
            parts.drop(step)
            raise self.stop_error(decision, agreement, step, bundle)
        return False

    def _bad_late(
        self,
        decision: Decision,
        agreement: Agreement,
        step: int,
        bundle: Path | None,
        raise_errors: bool,
    ) -> bool:
        """A bad sync-free step read late: its update was left out on the device ("warn"
        too: ``found_inf`` skips it), so it is counted a skip, or the run stops."""
        parts = self._parts
        if decision in (Decision.SKIP, Decision.WARN):
            consecutive = parts.state.consecutive_nonfinite
            parts.events.write("skip", step, consecutive=consecutive)
        elif raise_errors:
            raise self.stop_error(decision, agreement, step, bundle)
        return False

    def _capture(
        self,
        decision: Decision,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        loss_known: bool,
        late: PendingStep | None,
        raise_errors: bool,
        spike: bool = False,
    ) -> Path | None:
        """The bundle, when one is due (``StepEvidence.capture``); none for a late step while
        the run unwinds."""
        if late is not None and not raise_errors:
            return None
        return self._parts.evidence.capture(
            decision, agreement, stats, step, late, spike=spike, loss_known=loss_known
        )

    def apply_good(self, step: int, loss: float, grad_norm: float, grads: list[Tensor]) -> bool:
        """A finite, agreed step the spike rule let through (the full path's and a world of
        one's usual step, ``step/single_process.py``): counted, noted by recovery, clipped.
        ``loss``/``grad_norm``: the agreed mean loss and global gradient norm."""
        parts = self._parts
        parts.state.record_good(step, loss)
        if parts.recovery is not None:
            parts.recovery.after_step(step, True, loss)
        if parts.config.grad_clip is not None:
            clip_(grads, grad_norm, parts.config.grad_clip)
        return True

    def apply_dropped(self, agreement: Agreement, step: int) -> bool:
        """A finite step some rank's loop left out itself (``Decision.DROPPED``). When every
        rank did, that is the loop's own choice, left as it made it (its buffers too); else
        the other ranks drop the update (buffers put back on every rank), so the replicas stay
        identical. Not counted bad."""
        parts = self._parts
        ranks = agreement.dropped_ranks
        if len(ranks) == len(agreement.drops):
            parts.events.write("dropped", step, ranks=ranks)
            return False
        restored = parts.drop(step)
        parts.events.write("dropped", step, ranks=ranks, buffers_restored=restored)
        if parts.rank == 0:
            logger.warning(
                "trainguard: step %d: rank(s) %s left the optimizer step out themselves "
                "(zero_grad after backward, no optimizer.step()); every rank leaves it out, "
                "so the replicas stay identical",
                step,
                ranks,
            )
        return False

    def apply_spike(
        self,
        decision: Decision,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        loss_known: bool = True,
        late: PendingStep | None = None,
        raise_errors: bool = True,
    ) -> bool:
        """A spike skipped (``SPIKE``) or escalated: no update, as for a non-finite step
        (``late``: left out on the device already, as ``apply``)."""
        parts = self._parts
        bundle = self._capture(
            decision, agreement, stats, step, loss_known, late, raise_errors, True
        )
        restored = {} if late is not None else {"buffers_restored": parts.drop(step)}
        if parts.recovery is not None:
            parts.recovery.after_step(step, False, agreement.mean_loss)
        if decision is Decision.ESCALATE:
            if self._rolled_back(step, parts.spikes.consecutive) or not raise_errors:
                return False
            error = parts.spikes.error(step, bundle)
            record_final_stop(parts.config, parts.rank, error, parts.recovery, "spike")
            raise error
        consecutive = parts.spikes.consecutive
        parts.events.write("skip", step, reason="spike", consecutive=consecutive, **restored)
        return False

    def _rolled_back(self, step: int, consecutive: int | None = None) -> bool:
        """On escalation with ``on_escalation="rollback"``: restore, skip data, go on."""
        parts = self._parts
        if parts.recovery is None or parts.config.recovery.on_escalation != "rollback":
            return False
        parts.drop(step)
        streak = parts.state.consecutive_nonfinite if consecutive is None else consecutive
        return parts.recovery.rollback(step, max(streak, 1))

    def log_nonfinite(
        self,
        decision: Decision,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        late: PendingStep | None = None,
    ) -> None:
        """The ``bad_input`` and non-finite events and log lines of a bad step (``late``: a
        sync-free step read late brings its own sampler indices)."""
        parts = self._parts
        draws = late.sampler_draws if late is not None else parts.evidence.sampler_draws(step)
        parts.inputs.report(agreement, step, draws)
        consecutive = parts.state.consecutive_nonfinite
        found = nonfinite_hyperparameters(parts.optimizer) if agreement.hyper_ranks else None
        log_nonfinite(
            parts.events, parts.rank, decision, agreement, stats, step, consecutive, found
        )

    def stop_error(
        self, decision: Decision, agreement: Agreement, step: int, bundle: Path | None = None
    ) -> NonFiniteError:
        """The error a stop raises; an escalation is recorded as the run's final stop."""
        parts = self._parts
        streak, config = parts.state.consecutive_nonfinite, parts.config
        error = stop_error(decision, agreement, step, bundle, config, streak, parts.events)
        if decision is Decision.ESCALATE:  # the final stop: a restart into it is refused
            record_final_stop(config, parts.rank, error, parts.recovery)
        return error
