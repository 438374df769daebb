"""Step batches for loops that do not iterate ``guard.watch()`` (Lightning, HF Trainer...).

A framework owns the loop, so the guard cannot hand out the batches; the loop (or an
integration's hook) hands each micro-batch to ``guard.record_batch(batch)`` before its
forward instead. This keeps references (never copies) to the micro-batches of the step in
progress, for the capture of a bad step; a new optimizer step (the guard's step counter moved
on) starts a new list. The step's start (RNG, autocast, buffers) is ``start.StepStart``'s.
"""

from __future__ import annotations

from typing import Any


class RecordedBatches:
    """The micro-batches handed to ``Guard.record_batch`` for the step in progress."""

    def __init__(self) -> None:
        self.current: list[Any] = []
        """Micro-batches of the step in progress (references, not copies)."""
        self._step = -1

    @property
    def used(self) -> bool:
        """Whether any batch was recorded (the loop calls ``record_batch``)."""
        return self._step >= 0

    def of(self, step: int) -> list[Any]:
        """The micro-batches recorded for ``step`` (empty when none were)."""
        return list(self.current) if step == self._step else []

    def record(self, batch: Any, step: int) -> None:
        """Keep ``batch`` as a micro-batch of optimizer step ``step`` (call before its forward)."""
        if step != self._step:
            self._step = step
            self.current = []
        self.current.append(batch)
