"""The step in flight as this rank knows it, and whether its state is still the step's start.

A state written at a failure must describe the start of a step: the weights and optimizer
after the last applied update, the buffers and RNG states as the step began, its data
position, the guard's state before the step's decision. ``StepBoundary`` holds what the
step's start recorded and closes the boundary when the step's decision begins (``deciding``:
the guard's state changes from there) or its update begins (``update_begins``: a loop that
steps the optimizer without a decision).

A step starts at its first training forward (``begin``: the moment checkpoints describe).
The hand-out of its first batch opens it earlier (``handout``) when that is provably after
the step before ended: decided, and its update done or skipped. A rank hung between the
hand-out and the forward (a collective in the loop body, a stuck transform) so still has its
step's start; its RNG states are those of the hand-out, which a resume then puts back at the
hand-out (``Boundary.at``), so that the loop body draws the same numbers again.

A state is written only while the boundary is open, and kept only if the step did not move
while it was copied (``open_now``, ``unchanged``). A rank hung in its loader (the step
before decided, the next one's first batch not handed out) or half-way through an update has
no open boundary and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from trainguard.capture.rng import RngSnapshot


@dataclass(slots=True)
class Boundary:
    """What the start of step ``step`` recorded on this rank."""

    step: int
    epoch: int
    position: int
    """The data position of the step's first batch (the stream's ``step_position``)."""
    loader_state: Any
    """A stateful loader's own state at ``position`` (None: none)."""
    rng: RngSnapshot
    """The RNG states at the step's start."""
    at: str = "forward"
    """The moment ``rng`` was taken: ``"forward"`` (the step's first training forward) or
    ``"handout"`` (its first batch's hand-out)."""
    batch: Any = None
    """The step's first batch (a reference: its digest is taken only when a state is
    written, ``batch_digest.py``)."""


class StepBoundary:
    """The open or closed boundary of the step in flight (see the module docstring).

    Only the main thread changes it, with plain attribute writes (no lock on the step's
    path); each change that moves the step on bumps a generation counter, after its marks
    and before the state changes. A writer takes the generation, then the open boundary
    (``open_now``), copies the state, and keeps the copy only if the generation is the same
    after (``unchanged``): a change whose marks came after the writer's look had bumped the
    counter before the state moved, so a copy that raced with it is dropped."""

    def __init__(self) -> None:
        self._current: Boundary | None = None
        self._closed = -1
        """The last step whose decision or update began: its start is gone."""
        self._decided = -1
        """The last step decided."""
        self._update_due = False
        """The last step decided was OK and its update has not ended yet."""
        self._updating = False
        self._generation = 0

    def begin(self, boundary: Boundary) -> None:
        """At a step's first training forward (recovery's step boundary)."""
        self._current = boundary
        self._generation += 1

    def may_open(self, step: int) -> bool:
        """Whether a hand-out of ``step``'s first batch opens it: the step before ended
        (decided, its update done or skipped) and ``step`` has not started yet."""
        current = self._current
        return (
            self._decided == step - 1
            and not self._update_due
            and not self._updating
            and self._closed < step
            and (current is None or current.step < step)
        )

    def handout(self, boundary: Boundary) -> bool:
        """At the hand-out of a step's first batch: opens the step when ``may_open``."""
        if not self.may_open(boundary.step):
            return False
        self._current = boundary
        self._generation += 1
        return True

    def deciding(self, step: int) -> None:
        """The step's decision begins: the guard's state changes from here."""
        if step > self._closed:
            self._closed = step
        self._update_due = True  # until decided() says the step is not applied
        self._generation += 1  # after the marks: see the class docstring

    def decided(self, step: int, ok: bool) -> None:
        """The step's agreed outcome: OK (its update follows) or not (no update)."""
        if step > self._decided:
            self._decided = step
        self._update_due = ok

    def update_begins(self) -> None:
        """``optimizer.step()`` begins: the weights change from here."""
        self._updating = True
        current = self._current
        if current is not None and current.step > self._closed:
            self._closed = current.step
        self._generation += 1

    def update_ends(self) -> None:
        self._updating = False
        self._update_due = False

    @property
    def current(self) -> Boundary | None:
        """The last step start recorded (open or closed)."""
        return self._current

    @contextmanager
    def changing(self) -> Iterator[None]:
        """The main thread changes the state outside a step (a rollback's restore)."""
        self._current = None
        self._generation += 1
        try:
            yield
        finally:
            self._generation += 1

    def open_now(self) -> tuple[Boundary | None, int]:
        """The open boundary (None: none) and the generation to check after a copy."""
        generation = self._generation
        current = self._current
        if current is None or current.step <= self._closed or self._updating:
            return None, generation
        return current, generation

    def unchanged(self, generation: int) -> bool:
        """The step has not moved since ``open_now`` gave ``generation``."""
        return self._generation == generation

    def why_closed(self) -> str:
        """Why no state can be written now (for the ``failure_state`` event)."""
        current = self._current
        if current is None:
            return "no step has started"
        return (
            f"step {current.step}'s decision or update had begun (not at a step boundary): "
            "its start cannot be proven"
        )
