"""How a ``Guard`` is put together: its parts, and what each part is handed of the others.

``GuardParts`` builds the parts in the order they need each other (the agreement's group
and the run's event log, the per-step path, the health rules, then the decision's parts and
the services that start the run) from plain arguments (the config, the training objects,
``rerun``, the process group) and hands each part an explicit view of the others (the
``*Parts`` dataclasses: ``MeasureParts``, ``ApplyParts``, ``EvidenceParts``, ...), and
composes the per-step ones into the one pipeline (``StepPipeline``). The views hold parts,
never a callback into the guard: the current ``watch()`` stream is a ``StreamSlot`` the guard
fills, the capture's phase is ``phases.marked_phase`` over the progress and the event log,
the reruns' suspect-host exit is an exception the guard closes itself on. ``Guard``
(``step/guard.py``) holds one ``GuardParts`` and is the loop's API on top: ``watch``,
``check``, ``step``, ``phase``, the state and the lifecycle. Nothing here knows the guard.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)


class GuardParts:
    """Every part of one guard, built and wired to each other (``Guard`` runs them).

    ``objects``: the model, optimizer, scheduler, scaler and extra state (what recovery
    saves and restores); ``rerun``: the rerun's loss function; ``process_group``: the group
    of the per-step agreement. A build that raises closes what it opened so far."""

    def __init__(
        self,
        config: GuardConfig,
        objects: TrainingObjects,
        rerun: LossFn | None,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.config = config
        self.model = model = objects.model
        self.optimizer = optimizer = objects.optimizer
        self.scaler = objects.scaler
        identity = self._join(model, process_group)
        try:
            self._build_step_path(model, optimizer)
            self._build_health(model, optimizer, process_group)
            self._build_decision(objects, rerun, process_group)
            if objects.extra and self.recovery is None and self.rank == 0:
                logger.warning(
                    "trainguard: extra_state (%s) is saved and restored by recovery only "
                    "(on_escalation='rollback', checkpoint_every or resume); with none of "
                    "them it is not used",
                    ", ".join(objects.extra),
                )
        except BaseException:  # a refused option or resume: the model keeps no hook of ours
            self._abandon_build()
            raise
        self._start_run(identity, process_group)

    def _join(self, model: nn.Module, process_group: dist.ProcessGroup | None) -> RunIdentity:
        """The agreement's group, this rank, the run it writes and its event log."""
        self.params = named_parameters(model)
        local_device = next((p.device for _, p in self.params), torch.device("cpu"))
        self.consensus = Consensus(process_group, local_device)
        self.rank = self.consensus.rank
        self.world_size = self.consensus.world_size
        self.run_dir = Path(self.config.run_dir)
        agree_attempt(self.consensus.group, self.consensus.device)  # torchrun counts per node
        resume = self.config.recovery.resume
        identity = identify_run(self.run_dir, resume, self.config.run, self.consensus)
        self.events = EventLog(self.run_dir, self.rank, identity)  # every event names its run
        self.release_run_dir = claim_run_dir(self, self.run_dir, identity.id)  # runs/dirs.py
        return identity

    def _build_step_path(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """State, progress and the per-step parts: step start, losses, inputs, spikes, history."""
        self.state = GuardState(nonfinite_steps=deque(maxlen=RECORDED_STEPS))
        self.progress = Progress()
        self.streams = StreamSlot()  # watch() puts its stream here
        # record_batch(): loops without watch() (a refilled input buffer: step/recorded_batches.py)
        self.recorded = RecordedBatches(report_overwritten(self.events, self.rank))
        state = self.state  # not the guard: the hooks' closures must not keep it alive
        self.step_start = StepStart(
            model, lambda: state.step, restore_buffers=self.config.restore_buffers
        )
        self.step_start.on_evaluation = self.progress.beat  # evaluating is not being stuck
        self.losses = StepLosses()  # record_loss() and check()'s loss: step/losses.py
        self.no_grads = NoGradientsCheck(self.params, self.events, self.rank)
        self.drop_update = UpdateDrop(
            optimizer, self.params, self.step_start, self.events, self.rank
        )  # a step not applied: gradients cleared, buffers put back (step/update_drop.py)
        self.capturer = Capturer(self.run_dir, self.consensus, self.events)
        self.spikes = SpikeWatch(self.config.spikes, self.events, self.rank)
        self.state.spikes = self.spikes  # saved and restored with the counters
        self.inputs = InputCheck(
            self.config.inputs.check,
            self.events,
            self.rank,
            self.config.inputs.ignore,
            allow_masks=self.config.inputs.allow_masks,
        )
        self.sampler_epochs = SamplerEpochs(self.events, self.rank)
        metrics = (
            MetricsLog(
                metrics_path(self.run_dir),
                max_lines_per_second=self.config.history.metrics_lines_per_second,
            )
            if self.rank == 0
            else None
        )
        self.history = StepHistory(self.config.history.steps, metrics)
        self.timer = (
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
        self.lrs = LrAgreement(self.events, self.rank)
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
        self.transient: TransientFaults | None = None  # rerun=: step/transient.py
        self.evidence = StepEvidence(self._evidence_parts())
        self.measure = StepMeasure(self._measure_parts())  # this rank's row: step/measure.py
        self.recovery = build_recovery(
            self.config,
            objects,
            self.state,
            self.events,
            process_group,
            self.consensus.device,
            self.rank,
        )
        if self.recovery is not None:  # snapshots at the step's first forward (step/step_start.py)
            self.step_start.on_begin = self.recovery.step_boundary
            self.replicas.on_resync = self.recovery.replicas_resynced  # a snapshot before it
            self.recovery.resync_replicas = self.replicas.resync_from  # holds diverged weights
            self.history.lr_factor = self.recovery.lr_factor  # the LR in force, recorded
        self.pipeline = self._step_pipeline()  # measure -> agree -> decide -> record -> apply
        recovery = self.recovery
        failure = recovery.failure if recovery is not None else None
        if recovery is not None and failure is not None:  # states at a failure (recovery/failure)
            self.pipeline.boundary = failure.boundary
            failure.start_buffers(self.step_start.buffers)
            self.step_start.on_recorded = recovery.step_recorded
        # Recovery restores at step boundaries: it needs the decision before the update.
        sync_free = uses_fused(optimizer) and scaler is None
        sync_free = sync_free and not recovery_enabled(self.config) and rerun is None
        self.sync_free = SyncFreeStep(self.pipeline) if sync_free else None
        self.transient = self.pipeline.transient = self._transient_part(rerun, scaler)

    def _start_run(self, identity: RunIdentity, process_group: dist.ProcessGroup | None) -> None:
        """The run's start event, then the hang watchdog."""
        fields = self.config.start_fields() | {"torch": torch.__version__} | identity.start_fields()
        self.events.write("start", self.state.step, world_size=self.world_size, **fields)
        self.watchdog: Watchdog | None = start_watchdog(
            self.progress, self.events, self.config.hang.timeout, self.run_dir, process_group
        )
        if self.watchdog is not None:  # a hang exits with os._exit: keep the metrics
            self.watchdog.before_exit(self.history.flush)
            if self.recovery is not None and self.recovery.failure is not None:
                self.watchdog.before_exit(self.recovery.failure.save_for_exit)
            self.watchdog.on_tick.append(self.history.flush_if_stale)  # and before a kill
        self.saves: SaveMarking | None = None  # torch.save here: a "save" phase (saves.py)
        if self.watchdog is not None and self.config.hang.mark_saves:
            self.saves = SAVES.watch(self.progress)
        self.busy: BusyProbe | None = None  # another module's forwards: progress (busy.py)
        if self.watchdog is not None:
            self.busy = BusyProbe(self.progress, self.model)
            self.watchdog.on_stall.append(self.busy.arm)
        failure = self.recovery.failure if self.recovery is not None else None
        lr = self.recovery.lr if self.recovery is not None else None  # its optimizer hooks
        closers = [
            c
            for c in (
                self.watchdog,
                self.step_start,
                self.timer,
                self.saves,
                self.busy,
                failure,
                lr,
            )
            if c is not None
        ]
        # what a guard dropped or never closed releases (the guard watches: step/unclosed.py)
        self.unclosed = UnclosedParts(self.progress, self.state, self.events, self.history, closers)

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
            consensus=self.consensus,
            events=self.events,
            losses=self.losses,
            measure=self.measure,
            evidence=self.evidence,
        )
        transient = TransientFaults(StepRerun(rerun, self.model, self.step_start), parts)
        self.evidence.rerun = transient  # a capture records the last rerun's verdict
        return transient

    def _evidence_parts(self) -> EvidenceParts:
        """What ``StepEvidence`` (batches, RNG states, capture) reads of the guard."""
        return EvidenceParts(
            config=self.config,
            model=self.model,
            optimizer=self.optimizer,
            capturer=self.capturer,
            start=self.step_start,
            recorded=self.recorded,
            losses=self.losses,
            history=self.history,
            replicas=self.replicas,
            stream=self.streams,
            progress=self.progress,
            events=self.events,
            state=self.state,
        )

    def _measure_parts(self) -> MeasureParts:
        """What ``StepMeasure`` (the gradient pass and this rank's row) reads of the guard."""
        return MeasureParts(
            params=self.params,
            device=self.consensus.device,
            start=self.step_start,
            losses=self.losses,
            no_grads=self.no_grads,
            inputs=self.inputs,
            replicas=self.replicas,
            fold=self.world_size == 1,
            timer=self.timer,
            evidence=self.evidence,
            stream=self.streams,
            optimizer=self.optimizer,
            scaler=self.scaler,
        )

    def _step_pipeline(self) -> StepPipeline:
        """The one per-step path (``step/pipeline.py``), from the parts built so far."""
        device = self.consensus.device
        alone = None
        if self.world_size == 1:  # a world of one's usual step, in few calls
            alone = AloneMeasure(
                self.params,
                device,
                self.step_start,
                self.losses,
                self.inputs,
                self.evidence,
                self.timer,
                self.optimizer,
            )
        return StepPipeline(
            config=self.config,
            state=self.state,
            progress=self.progress,
            consensus=self.consensus,
            start=self.step_start,
            losses=self.losses,
            measure=self.measure,
            alone=alone,
            inputs=self.inputs,
            spikes=self.spikes,
            history=self.history,
            apply=DecisionApply(self._apply_parts()),  # acting on it: step/apply.py
            evidence=self.evidence,
            health=(
                HealthRules(self.stragglers, self.lrs, self.replicas)
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
            inputs=self.inputs,
            evidence=self.evidence,
            drop=self.drop_update,
        )

    # -- taking the parts down ------------------------------------------------------------

    def stop(self, ended_by: BaseException | None) -> None:
        """Stop what ``_start_run`` started and close what the parts hold open: the
        watchdog, the save marks and busy probe, the ``close`` event (``ended_by``: the
        exception that ended the run), the logs, the step timer, the held collective."""
        self.progress.enter("closed")
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.recovery is not None:
            if self.recovery.failure is not None:
                self.recovery.failure.end(ended_by)  # after the watchdog's SIGTERM dump is off
            self.recovery.lr.close()  # the optimizer's step hooks: the user's own again
        for part in (self.saves, self.busy):  # torch.save as it was; no probe
            if part is not None:
                part.close()
        error = {} if ended_by is None else {"error": error_text(ended_by)}
        self.events.write(
            "close", self.state.step, total_nonfinite=self.state.total_nonfinite, **error
        )
        self.events.close()
        self.history.close()
        self.step_start.close()
        if self.timer is not None:
            self.timer.close()
        self.consensus.work.retire()  # released here, not by gloo's thread
        self.release_run_dir()

    def _abandon_build(self) -> None:
        """A build that raised (a refused option or resume): close what it opened so far."""
        for part in (getattr(self, "step_start", None), getattr(self, "timer", None)):
            if part is not None:
                part.close()
        recovery = getattr(self, "recovery", None)
        if recovery is not None:
            recovery.abandon()


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
