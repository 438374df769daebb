"""Step batches for loops that do not iterate ``guard.watch()`` (Lightning, HF Trainer...).

A framework owns the loop, so the guard cannot hand out the batches; the loop (or an
integration's hook) hands each micro-batch to ``guard.record_batch(batch)`` before its
forward instead. Like ``BatchStream``, this keeps references (never copies) to the micro-
batches of the step in progress and the RNG states taken before its first micro-batch, for
the capture of a bad step. A new optimizer step (the guard's step counter moved on) starts
a new list.
"""

from __future__ import annotations

from typing import Any

from trainguard.capture.rng import rng_state


class RecordedBatches:
    """The micro-batches handed to ``Guard.record_batch`` for the step in progress."""

    def __init__(self) -> None:
        self.current: list[Any] = []
        """Micro-batches of the step in progress (references, not copies)."""
        self.current_rng: dict[str, Any] | None = None
        """RNG states taken before the step's first micro-batch was recorded."""
        self._step = -1

    @property
    def used(self) -> bool:
        """Whether any batch was recorded (the loop calls ``record_batch``)."""
        return self._step >= 0

    def record(self, batch: Any, step: int) -> None:
        """Keep ``batch`` as a micro-batch of optimizer step ``step`` (call before its forward)."""
        if step != self._step:
            self._step = step
            self.current = []
            self.current_rng = rng_state()
        self.current.append(batch)
