"""A step's evidence: its batches and RNG states as the guard saw them, and its capture.

The batches of the step being decided come from ``watch()`` (``batch_stream.BatchStream``'s
unchecked steps) or from ``guard.record_batch`` (``recorded_batches.RecordedBatches``); the RNG
states from the step's first forward (``step_start.StepStart``), else from when its first batch
was handed out. On the first non-finite step, the first spike and on escalation every rank
writes its part of the replay bundle (``capturer.Capturer``, collectively, before the
gradients are cleared), starting from the step's real start: its buffers as before its
first forward, the RNG and autocast state of that forward, and whether that forward got a
non-finite input the batches did not hold (``capture/forward_inputs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainguard.capture.forward_inputs import forward_findings, warn_made_in_loop
from trainguard.capture.rng import RngSnapshot, states_of
from trainguard.config import GuardConfig
from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.health.replicas import ReplicaWatch
from trainguard.step.bad_step import bad_step_of
from trainguard.step.batch_stream import StreamSlot
from trainguard.step.capturer import Capturer
from trainguard.step.deferred import PendingStep
from trainguard.step.detect import GradStats
from trainguard.step.history import StepHistory
from trainguard.step.hyperparams import nonfinite_hyperparameters
from trainguard.step.losses import StepLosses
from trainguard.step.phases import marked_phase
from trainguard.step.recorded_batches import RecordedBatches
from trainguard.step.state import GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.types import Agreement, Decision, SamplerDraws


class Reruns(Protocol):
    """The reruns of ``Guard(rerun=...)`` (``transient.TransientFaults``), as a capture reads
    them."""

    @property
    def verdict(self) -> str | None: ...


Rng = RngSnapshot | dict[str, Any] | None


@dataclass
class EvidenceParts:
    """What the evidence reads of the guard (handed over explicitly)."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    capturer: Capturer
    start: StepStart
    recorded: RecordedBatches
    losses: StepLosses
    history: StepHistory
    replicas: ReplicaWatch
    stream: StreamSlot
    """The current ``watch()`` stream (a new one at every ``watch()`` call)."""
    progress: Progress
    events: EventLog
    state: GuardState
    """The capture runs as a ``capture`` phase (``phases.marked_phase``)."""


class StepEvidence:
    """A step's batches and RNG states, and the capture of a bad step."""

    def __init__(self, parts: EvidenceParts) -> None:
        self._parts = parts
        self.rerun: Reruns | None = None
        """With ``Guard(rerun=...)``: the reruns, whose last verdict a capture records."""
        self.loss_source: str | None = None
        """What computed the loss the loop checks, when that is not the model's own forward
        and a replay's ``loss_fn`` may well not compute it (the HF Trainer's overriding
        ``compute_loss``): a bundle's ``meta.json`` says so (``loss_source``) and a replay
        that stays finite names it rather than suspecting a device."""

    def batches_of(self, step: int) -> list[Any]:
        """The micro-batches of ``step`` (being decided), without its RNG states."""
        parts = self._parts
        stream = parts.stream.current
        if parts.recorded.used or stream is None:
            return parts.recorded.of(step)
        return stream.unchecked.step()

    def sampler_draws(self, step: int) -> SamplerDraws | None:
        """What gives, per micro-batch of ``step`` (being decided), the dataset indices a
        ``DataLoader``'s sampler drew for it (``BatchStream.step_draws``; None: no such
        loader). Called when wanted: a bad step's capture or input report. Without the
        stream: those ``trainguard run`` followed for the model's calls
        (``StepStart.forward_draws``)."""
        parts = self._parts
        stream = parts.stream.current
        if parts.recorded.used or stream is None:
            return parts.start.forward_draws(step)
        return stream.step_draws()

    def step_batches(self, step: int) -> tuple[list[Any], dict[str, Any] | None]:
        """The micro-batches of ``step`` and its RNG states: taken at its first forward,
        else when its first batch was handed out."""
        batches, rng = self.step_batches_lazy(step)
        return batches, states_of(rng)

    def step_batches_lazy(self, step: int) -> tuple[list[Any], Rng]:
        """``step_batches`` with the RNG states as taken (turned into a dict when read)."""
        parts = self._parts
        stream = parts.stream.current
        rng: Rng = None
        if parts.start.started(step):
            rng = parts.start.rng_snapshot
        elif not parts.recorded.used and stream is not None:
            rng = stream.unchecked.step_rng_snapshot()
        return self.batches_of(step), rng

    def step_batches_taken(self, step: int) -> tuple[list[Any], Rng]:
        """``step_batches_lazy``, and the step's batches leave the stream (sync-free step)."""
        found = self.step_batches_lazy(step)
        self.taken(step)
        return found

    def taken(self, step: int) -> None:
        """``step`` is decided: its batches leave the stream."""
        parts = self._parts
        stream = parts.stream.current
        if stream is not None:
            stream.start_at_yield = not parts.start.seen
            if not parts.recorded.used:
                stream.unchecked.taken(step)

    def capture(
        self,
        decision: Decision,
        agreement: Agreement,
        stats: GradStats,
        step: int,
        pending: PendingStep | None = None,
        spike: bool = False,
        loss_known: bool = True,
    ) -> Path | None:
        """Every rank writes its part of the bundle when one is due; never raises; the same
        path on every rank. ``pending``: a sync-free step read late brings its own batches,
        RNG and losses; ``loss_known`` False: the step's loss was not seen
        (``check_gradients``)."""
        parts = self._parts
        if not parts.config.capture or not parts.capturer.due(decision, spike):
            return None
        if pending is not None:
            batches, rng, losses = pending.batches, states_of(pending.rng), pending.losses
            autocast, forward_args = pending.autocast, pending.forward_inputs
            draws = pending.sampler_draws
        else:
            draws = self.sampler_draws(step)
            batches, rng = self.step_batches(step)
            losses = parts.losses.step_losses()
            autocast = parts.start.autocast if parts.start.started(step) else None
            forward_args = parts.start.forward_inputs(step)
        forward = forward_findings(forward_args, batches)  # the fetched batches, if any
        overwritten = parts.recorded.overwritten_of(step)
        if not batches:  # no watch(), no record_batch(): the model's call arguments
            called = pending.forward_batches if pending else parts.start.forward_batches(step)
            if called is not None:
                batches, overwritten = called.batches, called.overwritten
        evidence = bad_step_of(step, decision, agreement, stats, batches, rng, losses)
        evidence.sampler_indices = draws() if draws is not None else None
        if not loss_known:
            evidence.extra.update(loss=None, loss_finite=None, micro_losses=[])
        if self.loss_source is not None:
            evidence.extra["loss_source"] = self.loss_source
        if agreement.hyper_ranks:  # this rank's non-finite hyper-parameters, if any
            evidence.extra["hyperparameters"] = nonfinite_hyperparameters(parts.optimizer)
        if forward is not None:
            evidence.extra["forward_inputs"] = forward
            warn_made_in_loop(forward, step, parts.capturer.rank)
        if overwritten:  # the loop refilled one input buffer: these hold a later one's data
            evidence.extra["overwritten_micro_batches"] = overwritten
        evidence.history = parts.history.bundle_history()
        evidence.factory_config = dict(parts.config.factory_config)
        evidence.buffers = parts.start.buffers.pre_step(step)
        evidence.extra["autocast"] = autocast
        evidence.extra["pre_step_buffers"] = sorted(evidence.buffers)
        if parts.replicas.diverged_at is not None:  # the replicas disagreed before this step
            evidence.extra["replica_divergence"] = parts.replicas.diverged_at
        if self.rerun is not None and pending is None:  # "persistent": reproduced
            evidence.extra["rerun"] = self.rerun.verdict
        with marked_phase(parts.progress, parts.events, parts.state, "capture"):
            return parts.capturer.capture(parts.model, parts.optimizer, evidence, spike)
