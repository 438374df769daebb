"""Recovery: composes snapshots, checkpoints, the LR factor, the ladder and the skip ledger.

The guard calls it at four points, all reached by every rank at the same step with agreed
data: ``step_boundary`` (before a step's first batch), ``after_step`` (the step's agreed
outcome), ``rollback`` (on escalation) and ``watch`` (a new epoch's stream). At its final
stop the guard calls ``record_final_stop`` (``stop.py``); the first ``watch()`` of a resumed
run checks that record (``restart.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.capture.optim_state import clear_optimizer_state
from trainguard.capture.rng import RngSnapshot, set_rng_state
from trainguard.config import GuardConfig
from trainguard.distributed.world import world_size
from trainguard.events import EventLog
from trainguard.recovery import snapshot as snap
from trainguard.recovery import target as targets
from trainguard.recovery.agree import same_on_every_rank
from trainguard.recovery.backoff import Backoff, LrFactor
from trainguard.recovery.disk_checkpoints import DiskCheckpoints
from trainguard.recovery.failure.batch_digest import check_resumed_batch
from trainguard.recovery.failure.part import FailureState
from trainguard.recovery.first_loss import FirstLossCheck
from trainguard.recovery.ladder import Rung, rung_for
from trainguard.recovery.ledger import SkipEntry, SkipLedger, SkippedPositions
from trainguard.recovery.loader import LoaderStates, is_stateful
from trainguard.recovery.restart import RestartCheck
from trainguard.recovery.resume import resume_freshest
from trainguard.recovery.scheduler_lead import unknown_scheduler, warn_scheduler_lead
from trainguard.recovery.stop import relative_checkpoint
from trainguard.recovery.types import (
    DataPoint,
    RecoveryState,
    Stateful,
    Stream,
    StreamStart,
    StreamView,
    epoch_of,
)
from trainguard.recovery.undone import (
    EndedStream,
    EndedStreams,
    earlier_batches,
    rollback_entries,
    sampler_epoch,
)

logger = logging.getLogger(__name__)

ZERO_LR_STEPS = 5
"""Steps at LR 0 after the optimizer moments are reset (the ladder's last rung)."""
LOSS_TOLERANCE = 0.5
"""Relative difference between the first loss after a rollback or resume and the one recorded
with the snapshot above which a ``loss_mismatch`` event is written."""

_CUMULATIVE = (
    "total_nonfinite",
    "nonfinite_steps",
    "overflow_steps",
    "last_streak",
    "total_spikes",
)


class Recovery:
    def __init__(
        self,
        config: GuardConfig,
        objects: snap.TrainingObjects,
        guard_state: Stateful,
        events: EventLog,
        group: dist.ProcessGroup | None,
        device: torch.device,
        rank: int,
    ) -> None:
        self.config = config
        self.objects = objects
        self.guard_state = guard_state
        self.events = events
        self.group = group
        self.device = device
        self.rank = rank
        self.state = RecoveryState()
        options = config.recovery
        self.snapshots = snap.SnapshotKeeper(options.snapshot_every, options.good_after)
        self.failure = (
            FailureState(
                config, objects, guard_state, self.state, events, rank, world_size(group), group
            )
            if options.resume and options.save_at_failure
            else None
        )
        """States at a failure (``failure/``): with ``resume=True`` only."""
        self.lr = LrFactor(objects.optimizer, self.failure.boundary if self.failure else None)
        self.ledger = SkipLedger(Path(config.run_dir), rank)
        self.stream: Stream | None = None
        self._streams = 0
        self._ended = EndedStreams()
        self._skipped = SkippedPositions()
        self._dropped_at_start: frozenset[int] = frozenset()
        """The ledger positions the pass ``watch()`` starts next drops (a resume)."""
        """The ``watch()`` passes that ended: a rollback into one skips the rest of it."""
        self.resync_replicas: Callable[[int], None] | None = None
        """``ReplicaWatch.resync_from``: every rank takes one rank's state (collective)."""
        self._resynced: tuple[int, int] | None = None
        """The last replica resync: its step and reference rank."""
        self._optimizer_steps = 0
        """Optimizer steps taken in this process, rolled back or not (``state.applied``
        counts those the weights hold): a scheduler the guard does not know follows it."""
        self._loader: LoaderStates | None = None  # for the stream ``watch()`` starts next
        self.first_loss = FirstLossCheck(events, LOSS_TOLERANCE)
        self.resume_point: DataPoint | None = None
        """Where a resumed run's data continues (set by ``resume()``)."""
        self.resumed_from: str | None = None
        """The checkpoint ``resume()`` loaded, relative to ``run_dir`` (None: a fresh start)."""
        self.watched: Any = None
        """The iterable last given to ``watch()`` (its identity goes into the stop record)."""
        self._restart_checked = False
        self._said_no_watch = False
        self._resume_digest: tuple[int, str] | None = None
        """A resumed step and the digest of its first batch on this rank, from a state at a
        failure or a checkpoint (``failure/batch_digest.py``): checked at its boundary."""
        self._resume_rng: tuple[int, dict[str, Any], str] | None = None
        """A resumed step's RNG states and the moment to put them back (``Boundary.at``)."""
        self.checkpoints = DiskCheckpoints(config, objects, events, group, rank)

    # -- hooks the guard calls ---------------------------------------------------------------

    def stream_start(self, iterable: Any, epoch: int | None) -> StreamStart:
        self.watched = iterable
        if self.config.recovery.resume and not self._restart_checked:
            self._restart_checked = True  # collective: every rank's first watch() is here
            self._check_restart(iterable)
        epoch = epoch_of(iterable, epoch, self._streams)
        start, first, source = 0, 0, iterable
        point = self.resume_point
        if point is not None and epoch < point.epoch:
            source = ()  # finished before the checkpoint: nothing left to feed
        elif point is not None and epoch == point.epoch:
            start = point.position
            if point.loader_state is not None and is_stateful(iterable):
                iterable.load_state_dict(point.loader_state)  # it continues at ``start`` itself
                first = start
        stateful = self.config.recovery.checkpoint_every > 0 and is_stateful(source)
        self._loader = LoaderStates(source) if stateful else None
        skip = self._ledger_positions(epoch) if point is not None else frozenset()
        self._dropped_at_start = skip
        if point is not None and epoch == point.epoch:
            self.first_loss.stream_started(point.position not in skip)
        handout = self.handout if self.failure is not None else None
        return StreamStart(
            source, epoch, start, skip, self.step_boundary, first, self._loader, handout
        )

    def _ledger_positions(self, epoch: int) -> frozenset[int]:
        """What this run skipped of ``epoch`` before the restart it resumes from."""
        run = self.events.run
        return self.ledger.positions(epoch, run.id if run is not None else None)

    def _check_restart(self, iterable: Any) -> None:
        """A restart that would resume into the last attempt's stop with nothing changed ends
        here with EXIT_DO_NOT_RESTART (``restart.py``)."""
        check = RestartCheck(
            self.config,
            self.resumed_from,
            iterable,
            self.events,
            self.group,
            self.device,
            self.rank,
            exit_fn=self._exit_refused,
        )
        check.run()

    def _exit_refused(self, code: int) -> None:
        """The refused restart's exit: the job ends for good, its states at a failure with it."""
        if self.failure is not None:
            self.failure.restart_refused()
        os._exit(code)

    def _say_no_watch(self, step: int) -> None:
        """Once, at the first step decided outside a ``watch()`` loop: recovery takes its
        snapshots, checkpoints and states at a failure at ``watch()``'s step boundary
        (``step_boundary``), so this loop gets none; said in one line (rank 0), not found
        out at the first failure."""
        self._said_no_watch = True
        if self.rank == 0:
            logger.warning(
                "trainguard: recovery is on (resume, checkpoint_every or "
                "on_escalation='rollback') but step %d was not fed by guard.watch(): "
                "snapshots, checkpoints and states at a failure are taken at its step "
                "boundary, so none are; iterate `for batch in guard.watch(loader)` "
                "(docs/recovery.md)",
                step,
            )

    def watch(self, view: StreamView, iterable: Any, epoch: int) -> None:
        ended = self.stream
        if ended is not None:
            end = ended.view.position
            self._ended.add(
                EndedStream(ended.ident, ended.epoch, end, ended.iterable, ended.sampler_epoch)
            )
        self._streams += 1
        self._skipped.seed(self._streams, self._dropped_at_start)
        self._dropped_at_start = frozenset()
        self.stream = Stream(
            view, iterable, epoch, self._streams, self._loader, sampler_epoch(iterable)
        )

    def replicas_resynced(self, step: int, reference: int) -> None:
        """A resync at ``step`` from rank ``reference``: snapshots up to it hold the weights
        the ranks had before it, diverged on some."""
        self._resynced = (step, reference)

    def step_boundary(self) -> None:
        """At a step's start (its first training forward, else when its first batch is handed
        out): the weights describe the start of that step, whose first batch is at the
        stream's ``step_position`` (a loop that fetches ahead took it during the step
        before)."""
        stream = self.stream
        step = self.guard_state.step
        if stream is None:
            return
        expected = self._resume_digest
        if expected is not None:  # the resumed step's first batch, the failed attempt's?
            self._resume_digest = None
            if expected[0] == step:
                check_resumed_batch(self.events, self.rank, step, expected[1], stream)
        resume_rng = self._resume_rng
        if resume_rng is not None and resume_rng[0] == step and resume_rng[2] == "forward":
            # As the checkpointed run had it here: at the batch's hand-out, and again at the
            # step's first forward when a hook records it (the checkpoint's moment then).
            set_rng_state(resume_rng[1])
        elif resume_rng is not None and resume_rng[0] < step:
            self._resume_rng = None
        if self.checkpoints.due(step):
            guard, recovery = self.guard_state.state_dict(), self.state.state_dict()
            self.checkpoints.save(step, stream, guard, recovery)
        elif stream.loader is not None:
            stream.loader.forget_before(stream.view.step_position)
        if not self.snapshots.due(step):
            return
        snapshot = snap.take(
            self.objects,
            step,
            stream.view.step_position,
            stream.ident,
            self.guard_state.state_dict(),
            {"recovery": self.state.state_dict(), "epoch": stream.epoch},
        )
        self.snapshots.add(snapshot)
        if self.failure is not None:  # sharded state: its shard on a peer too
            self.failure.snapshot_taken(snapshot)

    def handout(self) -> None:
        """The hand-out of a step's first batch (states at a failure only): a resumed step's
        RNG states taken at a hand-out go back here; the step's start may be recorded here."""
        stream, step, failure = self.stream, self.guard_state.step, self.failure
        resume_rng = self._resume_rng
        if resume_rng is not None and resume_rng[0] == step and resume_rng[2] == "handout":
            set_rng_state(resume_rng[1])
            self._resume_rng = None
        if stream is not None and failure is not None:
            failure.handout(step, stream)

    def step_recorded(self, rng: RngSnapshot) -> None:
        """The step's start recorded at its first forward (``rng``: its RNG states)."""
        if self.failure is not None and self.stream is not None:
            self.failure.step_start(self.guard_state.step, self.stream, rng)

    def after_step(self, step: int, ok: bool, loss: float) -> None:
        """The agreed outcome of ``step`` (before the optimizer step, when ``ok``)."""
        if self.stream is None and not self._said_no_watch:
            self._say_no_watch(step)
        if self.failure is not None:
            self.failure.boundary.decided(step, ok)
        self.lr.backoff = self.state.backoff
        self.lr.step = step
        self.checkpoints.judge(step, ok, loss)
        if not ok:
            self.snapshots.bad_step()
            return
        self.snapshots.healthy_step(step, loss)
        self._optimizer_steps += 1
        if self.state.applied is not None:
            self.state.applied += 1
        self.first_loss.good_step(step, loss)
        failed_at = self.state.failed_at
        if failed_at is not None and step >= failed_at + self.config.recovery.good_after:
            self.state.attempts = 0  # progress: past the last failure, healthy
            self.state.failed_at = None

    def lr_factor(self, step: int) -> float:
        """The LR backoff factor the optimizer hooks apply to optimizer step ``step``."""
        return self.state.backoff.at(step)

    def close(self) -> None:
        """Complete a background save (the checkpoint stays pending: not good)."""
        self.checkpoints.finish()

    def abandon(self) -> None:
        """A guard whose build failed after this was made: no SIGTERM handler of ours stays
        behind, nor a step hook on the optimizer."""
        if self.failure is not None:
            self.failure.abandon()
        self.lr.close()

    def resume(self) -> None:
        """Collective, at construction: load the freshest state every rank can be given (a
        state at a failure: ``failure/``), else the newest good checkpoint, if any."""
        run_dir = Path(self.config.run_dir)
        found = resume_freshest(
            run_dir, self.objects, self.failure, self.events, self.group, self.device, self.rank
        )
        if found is None:
            return
        self.guard_state.load_state_dict(found.extras["guard"])
        self.state.load_state_dict(found.extras["recovery"])
        self._optimizer_steps = self.state.applied or 0
        self.resume_point = found.point
        self._resume_rng = found.rng
        digest = found.extras["data"].get("batch_digest")
        self._resume_digest = (found.step, digest) if isinstance(digest, str) else None
        self.first_loss.resumed(found.step, found.first_loss)
        if found.path is not None:
            self.resumed_from = relative_checkpoint(run_dir, found.path)
            self.checkpoints.resumed(found.step)

    # -- rollback ----------------------------------------------------------------------------

    def rollback(self, step: int, consecutive: int) -> bool:
        """On escalation at ``step``: restore, skip, back off. False: give up (raise)."""
        attempt = self.state.attempts + 1
        rung = rung_for(attempt, self.config.recovery.max_rollbacks)
        target = self._target(step - consecutive + 1)
        key = -1 if target is None else 2 * target.step + targets.from_disk(target)
        agreed = same_on_every_rank(key, self.group, self.device)
        if rung is Rung.STOP or target is None or not agreed:
            reason = "max_rollbacks" if rung is Rung.STOP else "no_good_snapshot"
            if not agreed:
                reason = "ranks_disagree"
            self.events.write("rollback_refused", step, reason=reason, attempt=attempt)
            return False
        if targets.from_disk(target):  # the position is in the checkpoint: load it first
            targets.restore(self.objects, target, self.rank)
        skipped = self._skip_batches(target, step)
        epoch = self.stream.epoch if self.stream is not None else None
        self._restore(target, attempt, rung, step)
        resynced = self._resynced
        if resynced is not None and target.step <= resynced[0] and self.resync_replicas:
            self.resync_replicas(resynced[1])  # the target predates a resync: its weights too
        if self.stream is not None:  # the restored state now reads on from here
            target.position = self.stream.view.untrained_position
            target.stream_id = self.stream.ident
        self.events.write(
            "rollback",
            step,
            restored_step=target.step,
            scheduler_restored=self.objects.scheduler is not None,
            source="disk" if targets.from_disk(target) else "memory",
            rung=rung.value,
            attempt=attempt,
            epoch=epoch,
            batches_skipped=[entry.batch for entry in skipped if entry.epoch == epoch],
            earlier_batches_skipped=earlier_batches(skipped, epoch),
            samples_skipped=[i for entry in skipped for i in (entry.samples or [])] or None,
            lr_factor=self.state.backoff.at(target.step),
        )
        log = logger.warning if self.rank == 0 else logger.debug
        log("trainguard: step %d rolled back to step %d (%s)", step, target.step, rung.value)
        if self.objects.scheduler is None and unknown_scheduler(self.objects.optimizer):
            warn_scheduler_lead(log, self._optimizer_steps, self.state.applied)
        return True

    def _target(self, first_bad: int) -> snap.Snapshot | None:
        memory = self.snapshots.target(first_bad)
        if self.config.recovery.checkpoint_every == 0:
            return memory
        stream = self.stream
        epoch, ident = (stream.epoch, stream.ident) if stream is not None else (-1, -1)
        disk = targets.disk_target(Path(self.config.run_dir), first_bad, epoch, ident)
        return targets.choose(memory, disk)

    def _cumulative(self) -> dict[str, Any]:
        return {k: v for k, v in self.guard_state.state_dict().items() if k in _CUMULATIVE}

    def _restore(self, target: snap.Snapshot, attempt: int, rung: Rung, step: int) -> None:
        cumulative = self._cumulative()
        if not targets.from_disk(target):
            with self._changing():
                snap.restore(self.objects, target)
        self.guard_state.load_state_dict({**target.guard, **cumulative})
        self.state.applied = target.extra.get("recovery", {}).get("applied")
        self.snapshots.drop_after(target.step)
        self.checkpoints.last_saved = (
            -1
        )  # a step whose checkpoint was discarded is saved when reached
        self.state.attempts = attempt
        self.state.failed_at = step
        self.state.rollbacks += 1
        if rung in (Rung.BACKOFF, Rung.RESET_MOMENTS):
            zero = ZERO_LR_STEPS if rung is Rung.RESET_MOMENTS else 0
            factor = self.config.recovery.lr_backoff ** (attempt - 1)
            ramp = self.config.recovery.lr_backoff_steps
            self.state.backoff = Backoff(target.step, factor, ramp, zero)
        if rung is Rung.RESET_MOMENTS:
            clear_optimizer_state(self.objects.optimizer)
        self.lr.backoff, self.lr.step = self.state.backoff, target.step  # the restored step's
        self.first_loss.rolled_back(target.step, target.first_loss)

    def _changing(self) -> AbstractContextManager[None]:
        """A restore outside a step: no state at a failure is copied meanwhile."""
        return self.failure.boundary.changing() if self.failure is not None else nullcontext()

    def _skip_batches(self, target: snap.Snapshot, step: int) -> list[SkipEntry]:
        stream = self.stream
        if stream is None:
            return []
        run = self.events.run.id if self.events.run is not None else None
        margin = self.config.recovery.skip_margin
        entries = rollback_entries(stream, self._ended, self._skipped, target, step, run, margin)
        self.ledger.append(entries)
        return entries
