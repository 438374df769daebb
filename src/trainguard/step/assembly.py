"""How a ``Guard`` is put together: its parts, and what each part is handed of the others.

``GuardAssembly`` builds the parts in the order they need each other (the agreement's group
and the run's event log, the per-step path, the health rules, then the decision's parts and
the services that start the run) and hands each part an explicit view of the others (the
``*Parts`` dataclasses: ``MeasureParts``, ``ApplyParts``, ``EvidenceParts``, ...), and
composes the per-step ones into the one pipeline (``StepPipeline``). The views hold parts,
never a callback into the guard: the current ``watch()`` stream is a ``StreamSlot`` the guard
fills, the capture's phase is ``phases.marked_phase`` over the progress and the event log,
the reruns' suspect-host exit is an exception the guard closes itself on. ``Guard``
(``step/guard.py``) is the loop's API on top: ``watch``, ``check``, ``step``, ``phase``, the
state and the lifecycle.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.config import GuardConfig
from trainguard.distributed.elastic import agree_attempt
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.hang.busy import BusyProbe
from trainguard.hang.progress import Progress
from trainguard.hang.saves import SAVES, SaveMarking
from trainguard.hang.watchdog import Watchdog
from trainguard.hang.watchdog_start import start_watchdog
from trainguard.health.learning_rates import LrAgreement
from trainguard.health.replicas import ReplicaWatch
from trainguard.health.stragglers import StragglerWatch
from trainguard.health.timing import StepTimer
from trainguard.recovery import TrainingObjects, build_recovery, recovery_enabled
from trainguard.runs.dirs import claim as claim_run_dir
from trainguard.runs.identity import RunIdentity, identify_run
from trainguard.step import unclosed
from trainguard.step.apply import ApplyParts, DecisionApply
from trainguard.step.batch_stream import StreamSlot
from trainguard.step.capturer import Capturer
from trainguard.step.consensus import Consensus
from trainguard.step.deferred import uses_fused
from trainguard.step.detect import named_parameters
from trainguard.step.evidence import EvidenceParts, StepEvidence
from trainguard.step.history import StepHistory
from trainguard.step.inputs import InputCheck
from trainguard.step.losses import StepLosses
from trainguard.step.measure import MeasureParts, StepMeasure
from trainguard.step.metrics_log import MetricsLog, metrics_path
from trainguard.step.metrics_view import Dashboard
from trainguard.step.no_gradients import NoGradientsCheck
from trainguard.step.pipeline import HealthRules, StepPipeline
from trainguard.step.recorded_batches import RecordedBatches, report_overwritten
from trainguard.step.rerun import LossFn, StepRerun
from trainguard.step.sampler import SamplerEpochs
from trainguard.step.single_process import AloneMeasure
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.state import RECORDED_STEPS, GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.syncfree import SyncFreeStep
from trainguard.step.transient import RerunParts, TransientFaults
from trainguard.step.unclosed import UnclosedParts, error_text
from trainguard.step.update_drop import UpdateDrop
from trainguard.user_hooks import eager_module


class GuardAssembly:
    """Builds the guard's parts and the views they get of each other (``Guard`` runs them)."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any

    def _join(self, model: nn.Module, process_group: dist.ProcessGroup | None) -> RunIdentity:
        """The agreement's group, this rank, the run it writes and its event log."""
        self._params = named_parameters(model)
        local_device = next((p.device for _, p in self._params), torch.device("cpu"))
        self._consensus = Consensus(process_group, local_device)
        self.rank = self._consensus.rank
        self.world_size = self._consensus.world_size
        self.run_dir = Path(self.config.run_dir)
        agree_attempt(self._consensus.group, self._consensus.device)  # torchrun counts per node
        resume = self.config.recovery.resume
        identity = identify_run(self.run_dir, resume, self.config.run, self._consensus)
        self.events = EventLog(self.run_dir, self.rank, identity)  # every event names its run
        self._run_dir_claim = claim_run_dir(self, self.run_dir, identity.id)  # runs/dirs.py
        return identity

    def _build_step_path(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """State, progress and the per-step parts: step start, losses, inputs, spikes, history."""
        self.state = GuardState(nonfinite_steps=deque(maxlen=RECORDED_STEPS))
        self.progress = Progress()
        self._streams = StreamSlot()  # watch() puts its stream here
        # record_batch(): loops without watch() (a refilled input buffer: step/recorded_batches.py)
        self._recorded = RecordedBatches(report_overwritten(self.events, self.rank))
        state = self.state  # not the guard: the hooks' closures must not keep it alive
        self._start = StepStart(
            model, lambda: state.step, restore_buffers=self.config.restore_buffers
        )
        self._start.on_evaluation = self.progress.beat  # evaluating is not being stuck
        self._losses = StepLosses()  # record_loss() and check()'s loss: step/losses.py
        self._no_grads = NoGradientsCheck(self._params, self.events, self.rank)
        self._drop_update = UpdateDrop(
            optimizer, self._params, self._start, self.events, self.rank
        )  # a step not applied: gradients cleared, buffers put back (step/update_drop.py)
        self._capturer = Capturer(self.run_dir, self._consensus, self.events)
        self.spikes = SpikeWatch(self.config.spikes, self.events, self.rank)
        self.state.spikes = self.spikes  # saved and restored with the counters
        self._inputs = InputCheck(
            self.config.inputs.check,
            self.events,
            self.rank,
            self.config.inputs.ignore,
            allow_masks=self.config.inputs.allow_masks,
        )
        self._sampler_epochs = SamplerEpochs(self.events, self.rank)
        metrics = (
            MetricsLog(
                metrics_path(self.run_dir),
                max_lines_per_second=self.config.history.metrics_lines_per_second,
            )
            if self.rank == 0
            else None
        )
        self.history = StepHistory(self.config.history.steps, metrics)
        self._dashboard = Dashboard(self)  # metrics(): reads the parts when called
        self._timer = (
            StepTimer(eager_module(model), forward_hooks=self.world_size > 1)
            if self.config.health.detect_stragglers
            else None
        )

    def _build_health(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        """The cross-rank health rules: stragglers and replica agreement."""
        self.stragglers = StragglerWatch(self.config.health, self.events, self.rank)
        self._lrs = LrAgreement(self.events, self.rank)
        self.replicas = ReplicaWatch(
            model,
            optimizer,
            self.config.health,
            self.events,
            self.rank,
            self.world_size,
            process_group,
        )

    def _build_decision(
        self,
        objects: TrainingObjects,
        rerun: LossFn | None,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        """Evidence, the measure, recovery, acting on the decision, the sync-free step, rerun
        (``objects``: what recovery saves and restores)."""
        scaler, optimizer = self.scaler, objects.optimizer
        self._transient: TransientFaults | None = None  # rerun=: step/transient.py
        self._evidence = StepEvidence(self._evidence_parts())
        self._measure = StepMeasure(self._measure_parts())  # this rank's row: step/measure.py
        self.recovery = build_recovery(
            self.config,
            objects,
            self.state,
            self.events,
            process_group,
            self._consensus.device,
            self.rank,
        )
        if self.recovery is not None:  # snapshots at the step's first forward (step/step_start.py)
            self._start.on_begin = self.recovery.step_boundary
            self.replicas.on_resync = self.recovery.replicas_resynced  # a snapshot before it
            self.recovery.resync_replicas = self.replicas.resync_from  # holds diverged weights
            self.history.lr_factor = self.recovery.lr_factor  # the LR in force, recorded
        self._pipeline = self._step_pipeline()  # measure -> agree -> decide -> record -> apply
        recovery = self.recovery
        failure = recovery.failure if recovery is not None else None
        if recovery is not None and failure is not None:  # states at a failure (recovery/failure)
            self._pipeline.boundary = failure.boundary
            failure.start_buffers(self._start.buffers)
            self._start.on_recorded = recovery.step_recorded
        # Recovery restores at step boundaries: it needs the decision before the update.
        sync_free = uses_fused(optimizer) and scaler is None
        sync_free = sync_free and not recovery_enabled(self.config) and rerun is None
        self._sync_free = SyncFreeStep(self._pipeline) if sync_free else None
        self._transient = self._pipeline.transient = self._transient_part(rerun, scaler)

    def _start_run(self, identity: RunIdentity, process_group: dist.ProcessGroup | None) -> None:
        """The run's start event, then the hang watchdog."""
        fields = self.config.start_fields() | {"torch": torch.__version__} | identity.start_fields()
        self.events.write("start", self.state.step, world_size=self.world_size, **fields)
        self._watchdog: Watchdog | None = start_watchdog(
            self.progress, self.events, self.config.hang.timeout, self.run_dir, process_group
        )
        if self._watchdog is not None:  # a hang exits with os._exit: keep the metrics
            self._watchdog.before_exit(self.history.flush)
            if self.recovery is not None and self.recovery.failure is not None:
                self._watchdog.before_exit(self.recovery.failure.save_for_exit)
            self._watchdog.on_tick.append(self.history.flush_if_stale)  # and before a kill
        self._saves: SaveMarking | None = None  # torch.save here: a "save" phase (saves.py)
        if self._watchdog is not None and self.config.hang.mark_saves:
            self._saves = SAVES.watch(self.progress)
        self._busy: BusyProbe | None = None  # another module's forwards: progress (busy.py)
        if self._watchdog is not None:
            self._busy = BusyProbe(self.progress, self.model)
            self._watchdog.on_stall.append(self._busy.arm)
        failure = self.recovery.failure if self.recovery is not None else None
        closers = [
            c
            for c in (self._watchdog, self._start, self._timer, self._saves, self._busy, failure)
            if c is not None
        ]
        parts = UnclosedParts(self.progress, self.state, self.events, self.history, closers)
        self._unclosed = unclosed.watch(self, parts)  # dropped or never closed: step/unclosed.py

    # -- the views each part gets of the others -------------------------------------------

    def _transient_part(self, rerun: LossFn | None, scaler: Any) -> TransientFaults | None:
        if rerun is None:
            return None
        if not callable(rerun):
            raise ConfigError("rerun", "expected loss_fn(model, batch) -> loss, a callable")
        if scaler is not None:
            raise ConfigError(
                "rerun",
                "not supported with a GradScaler yet (an fp16 overflow is the scaler's to "
                "handle); use rerun=None, or bf16 without a scaler",
            )
        parts = RerunParts(
            config=self.config,
            consensus=self._consensus,
            events=self.events,
            losses=self._losses,
            measure=self._measure,
            evidence=self._evidence,
        )
        transient = TransientFaults(StepRerun(rerun, self.model, self._start), parts)
        self._evidence.rerun = transient  # a capture records the last rerun's verdict
        return transient

    def _evidence_parts(self) -> EvidenceParts:
        """What ``StepEvidence`` (batches, RNG states, capture) reads of the guard."""
        return EvidenceParts(
            config=self.config,
            model=self.model,
            optimizer=self.optimizer,
            capturer=self._capturer,
            start=self._start,
            recorded=self._recorded,
            losses=self._losses,
            history=self.history,
            replicas=self.replicas,
            stream=self._streams,
            progress=self.progress,
            events=self.events,
            state=self.state,
        )

    def _measure_parts(self) -> MeasureParts:
        """What ``StepMeasure`` (the gradient pass and this rank's row) reads of the guard."""
        return MeasureParts(
            params=self._params,
            device=self._consensus.device,
            start=self._start,
            losses=self._losses,
            no_grads=self._no_grads,
            inputs=self._inputs,
            replicas=self.replicas,
            fold=self.world_size == 1,
            timer=self._timer,
            evidence=self._evidence,
            stream=self._streams,
            optimizer=self.optimizer,
            scaler=self.scaler,
        )

    def _step_pipeline(self) -> StepPipeline:
        """The one per-step path (``step/pipeline.py``), from the parts built so far."""
        device = self._consensus.device
        alone = None
        if self.world_size == 1:  # a world of one's usual step, in few calls
            alone = AloneMeasure(
                self._params,
                device,
                self._start,
                self._losses,
                self._inputs,
                self._evidence,
                self._timer,
                self.optimizer,
            )
        return StepPipeline(
            config=self.config,
            state=self.state,
            progress=self.progress,
            consensus=self._consensus,
            start=self._start,
            losses=self._losses,
            measure=self._measure,
            alone=alone,
            inputs=self._inputs,
            spikes=self.spikes,
            history=self.history,
            apply=DecisionApply(self._apply_parts()),  # acting on it: step/apply.py
            evidence=self._evidence,
            health=(
                HealthRules(self.stragglers, self._lrs, self.replicas)
                if self.world_size > 1
                else None  # no other rank: no straggler, no replica to compare
            ),
            events=self.events,
            optimizer=self.optimizer,
            scaler=self.scaler,
        )

    def _apply_parts(self) -> ApplyParts:
        """What ``DecisionApply`` (acting on the agreed decision) uses of the guard."""
        return ApplyParts(
            config=self.config,
            state=self.state,
            spikes=self.spikes,
            recovery=self.recovery,
            scaler=self.scaler,
            optimizer=self.optimizer,
            events=self.events,
            rank=self.rank,
            inputs=self._inputs,
            evidence=self._evidence,
            drop=self._drop_update,
        )

    # -- taking the parts down ------------------------------------------------------------

    def _stop_parts(self, ended_by: BaseException | None) -> None:
        """Stop what ``_start_run`` started and close what the parts hold open: the
        watchdog, the save marks and busy probe, the ``close`` event (``ended_by``: the
        exception that ended the run), the logs, the step timer, the held collective."""
        self.progress.enter("closed")
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.recovery is not None and self.recovery.failure is not None:
            self.recovery.failure.end(ended_by)  # after the watchdog's SIGTERM dump is off
        for part in (self._saves, self._busy):  # torch.save as it was; no probe
            if part is not None:
                part.close()
        error = {} if ended_by is None else {"error": error_text(ended_by)}
        self.events.write(
            "close", self.state.step, total_nonfinite=self.state.total_nonfinite, **error
        )
        self.events.close()
        self.history.close()
        self._start.close()
        if self._timer is not None:
            self._timer.close()
        self._consensus.work.retire()  # released here, not by gloo's thread
        self._run_dir_claim()

    def _abandon_build(self) -> None:
        """A build that raised (a refused option or resume): close what it opened so far."""
        for part in (getattr(self, "_start", None), getattr(self, "_timer", None)):
            if part is not None:
                part.close()
        recovery = getattr(self, "recovery", None)
        if recovery is not None and recovery.failure is not None:
            recovery.failure.abandon()


def check_pair(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must update some of the model's parameters: the guard checks the
    model's gradients before the optimizer's step (a swapped pair of a GAN would check one
    network and let the other one's update through)."""
    updated = {id(p) for group in optimizer.param_groups for p in group.get("params", [])}
    own = {id(p) for p in model.parameters()}
    if updated and own and not updated & own:
        raise ConfigError(
            "optimizer",
            f"the {type(optimizer).__name__} updates none of the parameters of the "
            f"{type(model).__name__} it was given with: the guard checks the model's gradients "
            "before that optimizer steps; pass the model the optimizer was built over (with "
            "two models and two optimizers, one Guard per pair, each with its own run_dir)",
        )
