"""Step batches for loops that do not iterate ``guard.watch()`` (Lightning, HF Trainer...).

A framework owns the loop, so the guard cannot hand out the batches; the loop (or an
integration's hook) hands each micro-batch to ``guard.record_batch(batch)`` before its
forward instead. This keeps references to the micro-batches of the step in progress, for
the capture of a bad step; a new optimizer step (the guard's step counter moved on) starts a
new list. A loop that copies every micro-batch into one preallocated buffer (a pinned
staging buffer, a prefetcher) would leave the step's earlier micro-batches holding the last
one's data: a micro-batch in the storage of an earlier one of the same step is detected, the
earlier ones are reported as overwritten (a ``batch_overwritten`` event and a warning), and
from then on every micro-batch is kept as a copy. The step's start (RNG, autocast, buffers)
is ``step_start.StepStart``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainguard.capture.batchtree import map_tensors
from trainguard.events import EventLog
from trainguard.step.refilled_batches import Held, copy_of, held_tensors, refills

logger = logging.getLogger(__name__)


class RecordedBatches:
    """The micro-batches handed to ``Guard.record_batch`` for the step in progress."""

    def __init__(self, on_overwritten: Callable[[int, list[int]], None] | None = None) -> None:
        self.current: list[Any] = []
        """Micro-batches of the step in progress (references, not copies)."""
        self._step = -1
        self._held: list[Held] = []
        """The tensors of the step's micro-batches and their versions when recorded
        (``refill.held_tensors``), to find a micro-batch refilled into an earlier's buffer."""
        self._on_overwritten = on_overwritten
        self.overwritten: list[int] = []
        """The micro-batches found overwritten (the step's earlier ones, when found)."""
        self._overwritten_step = -1
        self.copying = False
        """True once the loop was seen to refill one input buffer for every micro-batch:
        from then on each micro-batch is kept as a copy."""

    @property
    def used(self) -> bool:
        """Whether any batch was recorded (the loop calls ``record_batch``)."""
        return self._step >= 0

    def of(self, step: int) -> list[Any]:
        """The micro-batches recorded for ``step`` (empty when none were)."""
        return list(self.current) if step == self._step else []

    def overwritten_of(self, step: int) -> list[int]:
        """The micro-batches of ``step`` found overwritten (a capture does not hold them)."""
        return list(self.overwritten) if step == self._overwritten_step else []

    def record(self, batch: Any, step: int) -> None:
        """Keep ``batch`` as a micro-batch of optimizer step ``step`` (call before its forward)."""
        if step != self._step:
            self._step = step
            self.current = []
            self._held = []
        if self.copying:
            batch = map_tensors(batch, copy_of)
        elif self._refills(batch):
            self._overwritten(step)
            batch = map_tensors(batch, copy_of)
        self.current.append(batch)

    def add_loss_inputs(self, index: int, extra: list[Any]) -> None:
        """The loss's own inputs join micro-batch ``index`` (``attach/loss_inputs.py``: the
        targets of ``criterion(model(x), y)``): it becomes ``(batch, *extra)``."""
        if not 0 <= index < len(self.current):
            return
        if self.copying:
            extra = [map_tensors(item, copy_of) for item in extra]
        self.current[index] = (self.current[index], *extra)

    def _refills(self, batch: Any) -> bool:
        """Whether ``batch`` was copied into the buffer of an earlier micro-batch of the step
        (``refill.refills``): the earlier one is gone."""
        fetched = held_tensors(batch)
        found = refills(fetched, self._held)
        self._held.append(fetched)
        return found

    def _overwritten(self, step: int) -> None:
        """Copies from now on; the step's earlier micro-batches hold this one's data."""
        self.copying = True
        self.overwritten, self._overwritten_step = list(range(len(self.current))), step
        if self._on_overwritten is not None:
            self._on_overwritten(step, self.overwritten)

    def adopt(self, other: RecordedBatches, step: int) -> None:
        """Take over ``other``'s record of ``step`` (``trainguard run``'s first step,
        recorded before the guard existed), a refilled buffer it saw included."""
        self._step, self.current = step, list(other.current)
        self._held = list(other._held)
        if other.copying:
            self.copying = True
            self.overwritten, self._overwritten_step = other.overwritten, step
            if self._on_overwritten is not None:
                self._on_overwritten(step, self.overwritten)


def report_overwritten(events: EventLog, rank: int) -> Callable[[int, list[int]], None]:
    """What ``RecordedBatches`` calls when the loop refilled an input buffer: a
    ``batch_overwritten`` event (the step, its overwritten micro-batches) and a warning."""

    def report(step: int, earlier: list[int]) -> None:
        events.write("batch_overwritten", step, micro_batches=earlier)
        logger.warning(
            "trainguard: rank %d: step %d: the loop copies each micro-batch into the same "
            "input buffer, so micro-batch(es) %s of this step were overwritten before it ended "
            "(a capture of this step would not hold them); every micro-batch is kept as a copy "
            "from now on",
            rank,
            step,
            earlier,
        )

    return report
