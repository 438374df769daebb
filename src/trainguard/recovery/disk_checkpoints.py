"""The checkpoints recovery writes to disk every ``checkpoint_every`` steps, and their verdict.

A checkpoint is written at a step's start, judged by the steps after it (``good_after``
healthy steps make it good, a bad one discards it) and completed, when written in the
background, at the next collective point every rank reaches (``finish``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainguard.capture.rng import rng_state
from trainguard.config import GuardConfig
from trainguard.events import EventLog
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.failure.batch_digest import batch_digest
from trainguard.recovery.snapshot import TrainingObjects
from trainguard.recovery.types import Stream


@dataclass
class _Pending:
    """A checkpoint waiting for its verdict."""

    step: int
    healthy: int = 0
    first_loss: float | None = None


class DiskCheckpoints:
    """Writes, judges and completes the checkpoints on disk (collective: every rank calls each
    method at the same step)."""

    def __init__(
        self,
        config: GuardConfig,
        objects: TrainingObjects,
        events: EventLog,
        group: dist.ProcessGroup | None,
        rank: int,
    ) -> None:
        self.options = config.recovery
        self.run_dir = Path(config.run_dir)
        self.objects = objects
        self.events = events
        self.group = group
        self.rank = rank
        self.last_saved = -1
        self.good_steps: set[int] = set()
        """Steps whose checkpoint became good here (or was resumed from): not written again
        when a rollback returns to them, which would replace the good one before the new one
        is judged (and a bad step then deletes it)."""
        self._pending: _Pending | None = None
        self._saving: ckpt.Saved | None = None
        # async_save writes over a group of its own; new_group needs every rank of the
        # default group, so a guard on a sub-group saves synchronously instead.
        self._async = self.options.checkpoint_every > 0 and group is None
        self._write_group = ckpt.async_group() if self._async else None

    def due(self, step: int) -> bool:
        """A multiple of ``checkpoint_every`` not saved at this step yet, not one that became
        good (a rollback back to it), and no checkpoint waiting for its verdict (a newer one
        would leave it on disk unjudged, and with ``checkpoint_every < good_after`` none
        would ever become good)."""
        every = self.options.checkpoint_every
        due = every > 0 and step > 0 and step % every == 0 and step != self.last_saved
        return due and self._pending is None and step not in self.good_steps

    def save(self, step: int, stream: Stream, guard: dict[str, Any], recovery: Any) -> None:
        """Write the checkpoint of ``step``'s start (``guard``, ``recovery``: their states)."""
        position = stream.view.step_position
        # The loader's own state at this boundary (not at the prefetch front); this rank's.
        loader = stream.loader.at(position) if stream.loader is not None else None
        extras = {
            "rng": rng_state(),
            "guard": guard,
            "recovery": recovery,
            "data": {
                "epoch": stream.epoch,
                "position": position,
                "loader": loader,
                "batch_digest": batch_digest(stream.view.step_batch),
            },
        }
        self.finish()  # a previous one still writing (good_after >= checkpoint_every)
        saved = ckpt.save(
            self.run_dir,
            step,
            self.objects,
            extras,
            self.group,
            self.rank,
            self._write_group,
            use_async=self._async,
        )
        self._saving = saved
        self.last_saved = step
        self._pending = _Pending(step)
        self.events.write(
            "checkpoint",
            step,
            path=str(saved.path),
            seconds=round(saved.seconds, 4),
            epoch=stream.epoch,
            position=position,
            loader_state=loader is not None,
        )

    def judge(self, step: int, ok: bool, loss: float) -> None:
        """The agreed outcome of ``step``: a bad one discards the pending checkpoint, enough
        healthy ones make it good."""
        pending = self._pending
        if pending is None or step < pending.step:
            return
        if not ok:
            self.finish()
            self._pending = None
            if self.rank == 0:
                ckpt.discard(self.run_dir, pending.step)
            return
        if step == pending.step:
            pending.first_loss = loss
        pending.healthy += 1
        if pending.healthy >= self.options.good_after:
            self.finish()
            self._pending = None
            self.good_steps.add(pending.step)
            if self.rank == 0:
                keep = self.options.keep_checkpoints
                ckpt.mark_good(self.run_dir, pending.step, pending.first_loss, keep)
            self.events.write("checkpoint_good", pending.step, healthy_steps=pending.healthy)

    def resumed(self, step: int) -> None:
        """A resume loaded the good checkpoint of ``step``."""
        self.last_saved = step
        self.good_steps.add(step)

    def finish(self) -> None:
        """Collective (reached on every rank at the same step): complete a background save."""
        saving, self._saving = self._saving, None
        if saving is not None:
            ckpt.finish(saving)
