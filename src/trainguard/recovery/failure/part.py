"""``FailureState``: what recovery composes for states at a failure (the package docstring).

Built when ``resume=True`` and ``recovery.save_at_failure`` (only a job that resumes can use
a state). Recovery calls ``step_start`` at each step boundary (the step-start record),
``resume`` before the checkpoints on disk, and ``end`` when the guard closes; the guard
closes the boundary when a step's decision begins; the launcher's SIGTERM, the watchdog's
exit and an exception out of the ``with`` block call ``save``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainguard.capture.rng import RngSnapshot
from trainguard.config import GuardConfig
from trainguard.errors import NonFiniteError
from trainguard.events import EventLog
from trainguard.recovery.failure import store
from trainguard.recovery.failure.boundary import Boundary, StepBoundary
from trainguard.recovery.failure.fresh import Fresh, fresh_resume
from trainguard.recovery.failure.mirror import StepMirror
from trainguard.recovery.failure.on_terminate import TerminateSave
from trainguard.recovery.failure.shards import PeerShards, localize
from trainguard.recovery.failure.writer import FailureWriter, StartBuffers, StateHolder
from trainguard.recovery.snapshot import Snapshot, TrainingObjects
from trainguard.recovery.types import Stateful, Stream

logger = logging.getLogger(__name__)


def _boundary(step: int, stream: Stream, at: str, rng: RngSnapshot) -> Boundary:
    """The start of ``step``: its first batch's position in ``stream`` and the loader there."""
    position = stream.view.step_position
    loader = stream.loader.at(position) if stream.loader is not None else None
    return Boundary(step, stream.epoch, position, loader, rng, at, stream.view.step_batch)


def replicated(model: nn.Module, world: int) -> bool:
    """Whether every rank holds the same weights and optimizer state (DDP, or one rank): one
    survivor's state then serves every rank."""
    return world == 1 or type(model).__name__ == "DistributedDataParallel"


def sharded(model: nn.Module) -> bool:
    """Parameters sharded over the ranks (FSDP2's DTensors): not written at a failure yet."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


class FailureState:
    """The boundary, the step-start record, the writer and its triggers, the resume."""

    def __init__(
        self,
        config: GuardConfig,
        objects: TrainingObjects,
        guard_state: Stateful,
        recovery_state: StateHolder,
        events: EventLog,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        options = config.recovery
        self.folder = store.job_folder(Path(config.run_dir), options.failure_state_dir)
        self.rank = rank
        self.world = world
        self.events = events
        self.objects = objects
        self.boundary = StepBoundary()
        self.usable = store.open_folder(self.folder) is not None
        self._mirror = StepMirror(self.folder, rank) if self.usable else None
        self.writer = FailureWriter(
            self.folder,
            rank,
            world,
            objects,
            self.boundary,
            None,
            guard_state,
            recovery_state,
            events,
            options.failure_save_seconds,
        )
        self.shards = PeerShards(rank, world, group) if sharded(objects.model) else None
        """Sharded state (FSDP2): snapshot shards kept on a peer (``shards.py``); exchanged
        on every rank alike (a collective), whether this rank's folder is usable or not."""
        self.writer.shards = self.shards
        self._terminate = TerminateSave(self.writer) if self.usable else None
        if self.usable:
            store.sweep_stale(self.folder)

    def start_buffers(self, buffers: StartBuffers) -> None:
        """The step's buffer copies (the guard's ``BufferKeeper``): the buffers at its start."""
        self.writer.buffers = buffers

    def step_start(self, step: int, stream: Stream, rng: RngSnapshot) -> None:
        """At the step's first training forward (``rng``: the RNG states it recorded),
        unless the record of its first batch's hand-out stands (nothing drawn since)."""
        current = self.boundary.current
        if current is not None and current.step == step and current.rng is rng:
            return
        boundary = _boundary(step, stream, "forward", rng)
        self.boundary.begin(boundary)
        self._record(boundary)

    def handout(self, step: int, stream: Stream) -> None:
        """The hand-out of a step's first batch: recorded when it opens the step."""
        if not self.boundary.may_open(step):
            return
        boundary = _boundary(step, stream, "handout", RngSnapshot.take())
        if self.boundary.handout(boundary):
            self._record(boundary)

    def _record(self, boundary: Boundary) -> None:
        """The step-start record written; a record that cannot be (its folder removed
        meanwhile, the memory file system full) is given up for the run with one warning:
        this runs inside the model's forward hook or the loop's fetch, where the guard must
        not raise. The states the survivors write at a failure do not need it."""
        mirror = self._mirror
        if mirror is None:
            return
        try:
            mirror.write(boundary)
        except OSError as exc:
            self._mirror = None
            mirror.close()
            logger.warning(
                "trainguard: rank %d: the step-start record %s cannot be written (%s); "
                "from now on a restart after this rank is lost resumes from its peers' state "
                "or the newest checkpoint",
                self.rank,
                mirror.path,
                exc,
            )

    def snapshot_taken(self, snapshot: Snapshot) -> None:
        """Collective, sharded state only: a snapshot's shard goes to the next rank too."""
        shards = self.shards
        if shards is None:
            return
        snapshot.wait()
        payload = {
            "format": 1,
            "step": snapshot.step,
            "world_size": self.world,
            "state": localize(snapshot.state),
            "buffers": {},
            "rng": snapshot.rng,
            "rng_at": "forward",
            "data": {
                "epoch": snapshot.extra.get("epoch"),
                "position": snapshot.position,
                "loader": None,
            },
            "guard": snapshot.guard,
            "recovery": snapshot.extra.get("recovery"),
        }
        seconds = shards.exchange(snapshot.step, payload)
        size = len(shards.own[1]) if shards.own is not None else 0
        self.events.write(
            "failure_shard_copy", snapshot.step, seconds=round(seconds, 4), bytes=size
        )

    def save(self, trigger: str) -> None:
        """Write the state at the failure (bounded, once; never raises)."""
        if self.usable:
            self.writer.save(trigger)

    def save_for_exit(self) -> None:
        """The watchdog ends this rank (a peer failed, or a hang was declared)."""
        self.writer.exiting = True
        self.save("watchdog exit")

    def resume(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        newer_than: int,
    ) -> Fresh | None:
        """Collective (on every rank, a usable folder or not: an unusable one offers nothing):
        the freshest state at a failure, loaded; then the folder's states go."""
        found = fresh_resume(
            self.folder if self.usable else None,
            self.objects,
            self.events,
            group,
            device,
            self.rank,
            self.world,
            replicated(self.objects.model, self.world),
            newer_than,
        )
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)  # every rank read what it needed
        if self.usable and os.environ.get("LOCAL_RANK", str(self.rank)) == "0":
            store.remove_states(self.folder)
        return found

    def abandon(self) -> None:
        """The guard's build failed: the SIGTERM handler and the record file are let go, the
        folder's states stay (a resume that raised may be tried again); a folder left empty
        goes (the build made it)."""
        if self._terminate is not None:
            self._terminate.close()
        if self._mirror is not None:
            self._mirror.close()
        if self.usable:
            store.remove_if_empty(self.folder)

    def restart_refused(self) -> None:
        """A refused restart (``EXIT_DO_NOT_RESTART``) ends the job for good: this rank's
        files go, and the folder once empty, as at a run's end. The signal handlers stay as
        the refusal set them (its exit code must not be lost to the agent's SIGTERM)."""
        if self._mirror is not None:
            self._mirror.close()
        if self.usable:
            store.remove_rank(self.folder, self.rank)

    def close(self) -> None:
        """A guard never closed, released when collected or at the interpreter's exit
        (``step/unclosed.py``): as ``end``, with the exception that ended the interpreter,
        if one did (the SIGTERM handler goes, the record file is closed or removed)."""
        self.end(getattr(sys, "last_value", None))

    def end(self, ended_by: BaseException | None) -> None:
        """The guard closes: after an exception (not the guard's own stop) the state is
        written; a run that ended for good leaves nothing behind."""
        if self._terminate is not None:
            self._terminate.close()
        if isinstance(ended_by, Exception) and not isinstance(ended_by, NonFiniteError):
            self.save(f"exception: {type(ended_by).__name__}")
            return
        if self._mirror is not None:
            self._mirror.close()
        if self.usable and (ended_by is None or isinstance(ended_by, NonFiniteError)):
            store.remove_rank(self.folder, self.rank)
