"""Guard: the loop's API. It composes the parts; each part lives in its own module (built
and wired to each other by ``assembly.GuardParts``, which the guard holds).

``watch()`` (batch_stream.BatchStream) -> user forward/backward -> ``check()`` or ``step()``:
the one per-step pipeline (``step/pipeline.py``): measure -> agree -> decide -> record ->
apply, the same stages for every entry point; the sync-free ``step()`` runs the last three a
step later (``step/syncfree.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.config import (
    DivergenceAction,
    EscalationAction,
    GuardConfig,
    NonFiniteAction,
    SpikeAction,
    config_of,
)
from trainguard.errors import ConfigError
from trainguard.recovery.snapshot import TrainingObjects, stateful_objects
from trainguard.step import unclosed
from trainguard.step.assembly import GuardParts, check_pair
from trainguard.step.batch_stream import BatchStream
from trainguard.step.deferred import StepOutcome
from trainguard.step.guard_state_dict import guard_state_dict, load_guard_state
from trainguard.step.internals import GuardInternals
from trainguard.step.join import join_error, shadowed_in_join
from trainguard.step.losses import LossLike
from trainguard.step.metrics_view import Dashboard
from trainguard.step.phases import marked_phase
from trainguard.step.rerun import LossFn
from trainguard.step.transient import SuspectHostExit
from trainguard.step.types import DROPPED_BY_LOOP, DROPPED_WITH_SCALER, USUAL_CALL, StepCall

logger = logging.getLogger(__name__)


class Guard:
    """Guards a training loop: same decision on every rank, evidence when a step goes bad.

    See ``GuardConfig`` for the options. ``process_group`` (default: the default group)
    carries the per-step agreement.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        run_dir: Path | str = "runs/trainguard",
        on_nonfinite: NonFiniteAction = "skip",
        max_consecutive: int = 5,
        capture: bool = True,
        grad_clip: float | None = None,
        scaler: Any = None,
        hang_timeout: float | None = None,
        *,
        accumulation_steps: int = 1,
        min_loss_scale: float = 1.0,
        on_escalation: EscalationAction = "raise",
        checkpoint_every: int = 0,
        keep_checkpoints: int = 3,
        scheduler: Any = None,
        extra_state: Mapping[str, Any] | None = None,
        resume: bool = False,
        on_spike: SpikeAction = "warn",
        replica_check_every: int = 5,
        on_divergence: DivergenceAction = "warn",
        rerun: LossFn | None = None,
        run: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        config: GuardConfig | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "optimizer", f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        check_pair(model, optimizer)
        self.config = config_of(
            config,
            dict(
                run_dir=run_dir,
                on_nonfinite=on_nonfinite,
                max_consecutive=max_consecutive,
                capture=capture,
                grad_clip=grad_clip,
                hang_timeout=hang_timeout,
                accumulation_steps=accumulation_steps,
                min_loss_scale=min_loss_scale,
                on_escalation=on_escalation,
                checkpoint_every=checkpoint_every,
                keep_checkpoints=keep_checkpoints,
                resume=resume,
                on_spike=on_spike,
                replica_check_every=replica_check_every,
                on_divergence=on_divergence,
                run=run,
                **options,  # sections and any option by name (trainguard.config)
            ),
            _KEYWORD_DEFAULTS,
        )
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self._closed = False
        objects = TrainingObjects(
            model, optimizer, scheduler, scaler, stateful_objects(extra_state)
        )
        parts = self._parts = GuardParts(self.config, objects, rerun, process_group)
        self.rank, self.world_size, self.run_dir = parts.rank, parts.world_size, parts.run_dir
        self.events, self.state, self.progress = parts.events, parts.state, parts.progress
        self.history, self.spikes, self.recovery = parts.history, parts.spikes, parts.recovery
        self.stragglers, self.replicas = parts.stragglers, parts.replicas
        self._dashboard = Dashboard(parts)  # metrics(): reads the parts when called
        self._unclosed = unclosed.watch(self, parts.unclosed)  # dropped or never closed

    # -- the loop -------------------------------------------------------------------------

    def watch(self, iterable: Iterable[Any], epoch: int | None = None) -> Iterator[Any]:
        """Yield the batches; every rank ends at the same step when any rank runs out.

        ``epoch``: with recovery, which epoch this pass is (default: the DistributedSampler's
        ``epoch``, else a count of ``watch()`` calls); a resumed run skips what it consumed.

        It fetches one step ahead, before your loop body runs: that is how every rank knows
        at ``check()`` that all ranks hold another step, with no collective of its own. There
        is no ``lookahead=0``: without the fetched step, running out would be found only
        after another rank had started its forward (a hang), or at the cost of a second
        all-reduce per step. So a batch function that draws from the global RNG
        (``torch.randint`` in ``get_batch``) draws in another order than in the unguarded
        loop; give it its own ``torch.Generator`` seeded per rank and the guarded loop sees
        the unguarded loop's batches bit for bit (docs/guard.md, "Your own batch RNG")."""
        recovery = self.recovery
        resumed = recovery.stream_start(iterable, epoch) if recovery is not None else None
        if resumed is not None:
            iterable = resumed.iterable  # empty for an epoch the resumed run already finished
        self._parts.sampler_epochs.starting(iterable, self.state.step)
        state = self.state  # not the guard: recovery keeps the stream, and the unclosed
        # guard's release (step/unclosed.py) keeps recovery: a dropped guard must go
        stream = self._parts.streams.current = BatchStream(
            iterable,
            self.config.accumulation_steps,
            self._parts.consensus,
            self.progress,
            self.events,
            step_of=lambda: state.step,
            lookahead=2 if self._deferred else 1,  # the sync-free step reads a step late
            clock=self._parts.timer,
            **(resumed.stream_args() if resumed is not None else {}),
        )
        if recovery is not None and resumed is not None:
            recovery.watch(stream, iterable, resumed.epoch)
        self._parts.pipeline.watching(stream)
        return self._watched(iter(stream))

    def _watched(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loop is ``done`` once it ends (the watchdog then stops looking for hangs)."""
        try:
            yield from batches
        finally:
            self.progress.enter("done")

    def record_loss(self, loss: LossLike) -> None:
        """Record a micro-batch's loss (gradient accumulation); no host sync. Each loss is
        kept once: ``check()`` does not add its loss again when it is the one last recorded
        (``step/losses.py``, docs/guard.md)."""
        self._parts.losses.record(loss, self._parts.consensus.device)

    def record_batch(self, batch: Any) -> None:
        """For loops that do not iterate ``watch()``: hand each micro-batch over before its
        forward, so that a bad step's capture holds its batches and RNG (references only).
        Without it (and without ``watch()``) the capture holds the guarded model's call
        arguments of each training forward (``StepStart.forward_batches``)."""
        self._parts.step_start.begin(self.state.step)
        self._parts.recorded.record(batch, self.state.step)

    def check_gradients(self, *, backward_ran: bool = True) -> bool:
        """``check()`` where the loss is not at hand (``trainguard run`` where it found no
        loss): the gradients alone decide. The agreement's loss columns carry 0.0 and its
        ``loss_unknown`` column says so: the step's record (history, metrics log,
        ``metrics()``) holds no loss on any rank, and the spike rule reads none: unknown, not
        zero, even where other ranks checked the step with their loss.
        ``backward_ran=False``: the step ran no backward by design (a Lightning
        ``training_step`` that returned None): it has no gradient, and the warning of a
        ``check()`` called before ``backward()`` does not apply."""
        return self._checked(torch.zeros(()), StepCall(loss_known=False, backward_ran=backward_ran))

    def _check_dropped(self, scaled: bool) -> bool:
        """``check_gradients()`` of a step this rank's loop left out itself, its row saying
        so (``trainguard run``: ``attach/drops.py``). Returns False."""
        dropped = DROPPED_WITH_SCALER if scaled else DROPPED_BY_LOOP
        self._checked(torch.zeros(()), StepCall(loss_known=False, dropped=dropped))
        return False

    def _check_leaving(self, loss: Tensor | None) -> bool:
        """``check(loss)`` (``check_gradients()`` when None) of this rank's last guarded step:
        its row says that this rank's caller stops guarding after it, and every rank learns
        so from the agreement (``GuardState.leaving_ranks``)."""
        call = StepCall(loss_known=loss is not None, leaving=True)
        return self._checked(torch.zeros(()) if loss is None else loss, call)

    def check(self, loss: LossLike | None = None) -> bool:
        """After backward, before the optimizer step. True only when the loss and every
        gradient are finite on every rank; every rank gets the same answer. ``loss``: a
        tensor, or a Python float/int (``loss.item()``); omitted, the losses given to
        ``record_loss()`` in this step (``step/losses.py``)."""
        if loss is None:
            loss = self._parts.losses.last_recorded()
        return self._checked(loss, USUAL_CALL)

    def _checked(self, loss: LossLike, call: StepCall) -> bool:
        """The pipeline on the step in progress (``call``: how the loop handed it over)."""
        if not isinstance(loss, Tensor) or not loss.numel():  # a tensor: no call (as_loss)
            loss = self._parts.losses.tensor(loss, self._parts.consensus.device)
        if self.world_size > 1:
            self._refuse_join()
        if self._parts.sync_free is not None:
            self._parts.sync_free.resolve()
        try:
            return self._parts.pipeline.check(loss, call)
        except SuspectHostExit:  # every rank: the reruns blame this host (step/transient.py)
            if self.recovery is not None:
                self.recovery.close()  # a checkpoint being written completes first
            self._close(raise_errors=False)
            raise

    @property
    def _stream(self) -> BatchStream | None:
        """The loop's current ``watch()`` stream (None: no ``watch()`` yet)."""
        return self._parts.streams.current

    def step(self, loss: LossLike | None = None) -> StepOutcome:
        """``check()``, then the optimizer step (when good) and ``zero_grad`` in one call
        (``loss`` omitted: the losses given to ``record_loss()`` in this step, as ``check()``).

        With a fused optimizer (and no GradScaler) the step is sync-free: the agreed flag goes
        to the optimizer as ``found_inf`` and a bad step is skipped on the device. Events,
        state, capture and the policy follow when the host reads the flag: at the next
        ``step()``/``check()``/``close()``, or when the returned outcome is tested. So a
        "raise" or an escalation surfaces one step later; the skipped update does not.
        """
        if loss is None:
            loss = self._parts.losses.last_recorded()
        loss = self._parts.losses.tensor(loss, self._parts.consensus.device)
        if self._parts.sync_free is not None:
            self._refuse_join()
            return self._parts.sync_free.step(loss)
        ok = self.check(loss)
        scaler = self.scaler
        if scaler is not None and getattr(self.optimizer, "scaler", None) is scaler:
            # accelerate's optimizer steps through its scaler and updates it; a bad step's
            # overflow is marked (check()), so the scaler leaves it out
            self.optimizer.step()
        elif scaler is not None:
            if ok:
                scaler.step(self.optimizer)
            scaler.update()
        elif ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(ok)

    def _refuse_join(self) -> None:
        """Raise (every rank, before the all-reduce) in a DDP ``Join`` that would shadow the
        guard's collectives out of step: a loop not fed by ``watch()`` (``step/join.py``)."""
        if self._stream is None and self.world_size > 1 and shadowed_in_join(self.model):
            raise join_error()

    @property
    def _deferred(self) -> bool:
        """Whether ``step()`` is sync-free (fused optimizer, no GradScaler, no recovery)."""
        return self._parts.sync_free is not None

    def _resolve_pending(self, raise_errors: bool = True) -> None:
        """Read the last sync-free step on the host and act on it (see ``SyncFreeStep``)."""
        if self._parts.sync_free is not None:
            self._parts.sync_free.resolve(raise_errors)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark long non-training work (eval, checkpointing) so it is not taken for a hang."""
        with marked_phase(self.progress, self.events, self.state, name):
            yield

    # -- lifecycle ------------------------------------------------------------------------

    def metrics(self) -> dict[str, float | int]:
        """The per-step numbers as a flat dict for any logger (``trainguard/...`` keys, the same
        on every rank; no collective, no device sync; the keys: ``step/metrics_view.py``)."""
        return self._dashboard.read()

    def state_dict(self) -> dict[str, Any]:
        """The guard's counters, to save with a checkpoint.

        Safe to call on some ranks only (e.g. rank 0): no collective; it reads from the device
        only the spike statistics of the sync-free step's device rule (six numbers). Under
        the sync-free ``step()`` the last step's outcome is read here from this rank's copy
        of its agreed flags (no other rank waits) and counted in the dict, not acted on: a
        step that will stop the run when read is saved as ``stopped_at``, and loading the
        dict raises ``NonFiniteError`` for it, as the run it came from stops there."""
        recovery = self.recovery.state if self.recovery is not None else None
        sync_free = self._parts.sync_free
        counters, stopped_at = (
            sync_free.settled_state() if sync_free is not None else (self.state.state_dict(), None)
        )
        return guard_state_dict(
            counters, recovery, stopped_at
        )  # step/guard_state_dict.py: what it holds

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s counters, step, spike state and LR backoff; or, from a
        checkpoint saved before the guard was added, ``{"step": iter_num}``: the guard's step
        goes on from the loop's (its counters as at a start)."""
        self._load_state(state)
        self.events.write("state_loaded", self.state.step)  # the report: where the run began

    def _load_state(self, state: dict[str, Any]) -> None:
        """``load_state_dict`` without its event: a guard taking over from another one in the
        same run (``attach/replace.py``), whose steps go on rather than begin there."""
        load_guard_state(state, self.state, self.recovery.state if self.recovery else None)
        self.progress.enter(self.progress.phase, self.state.step)

    @property
    def internals(self) -> GuardInternals:
        """The explicitly internal interface trainguard's own wrappers (``trainguard run``,
        the integrations) drive the guard through (``step/internals.py``): not public API."""
        return GuardInternals(self)

    @property
    def global_step(self) -> int:
        """The guard's step count (calls of ``check()``): moved back by a rollback, restored
        by ``resume`` and ``load_state_dict()``. Drive a hand-written LR schedule with it."""
        return self.state.step

    @property
    def lr_factor(self) -> float:
        """The LR backoff factor for optimizer step ``global_step`` (1.0: none). The guard's
        optimizer hook already multiplies the LR by it: read it to log the LR in force,
        never multiply your LR by it (docs/guard.md, "Hand-written LR schedules")."""
        return self.recovery.lr_factor(self.state.step) if self.recovery is not None else 1.0

    def close(self) -> None:
        """Read the last sync-free step (its policy may still raise), then close the logs.

        Called in a ``finally`` (or ``except``) block while an exception is handled, it
        publishes that exception to the other ranks first, as ``with Guard(...)`` does."""
        failing = sys.exc_info()[1]
        if failing is not None and self._parts.watchdog is not None and not self._closed:
            self._parts.watchdog.publish_failure(failing)
        self._close(raise_errors=True, ended_by=failing)

    def _close(self, raise_errors: bool, ended_by: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._unclosed.detach()
        try:
            self._resolve_pending(raise_errors=raise_errors)
            if raise_errors and self.recovery is not None:
                self.recovery.close()  # every rank: a background checkpoint write completes
        finally:
            self._parts.stop(ended_by)

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self._parts.watchdog is not None:
            self._parts.watchdog.publish_failure(exc)  # tell the other ranks (not NonFiniteError)
        self._close(raise_errors=exc is None, ended_by=exc)


_KEYWORD_DEFAULTS: dict[str, object] = {
    name: param.default
    for name, param in inspect.signature(Guard.__init__).parameters.items()
    if param.default is not inspect.Parameter.empty
}
"""``Guard``'s keyword defaults (``config_of`` compares the options given beside ``config``)."""
