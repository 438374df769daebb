"""A marked phase: long work that is not a training step (an evaluation, a checkpoint, the
guard's own capture), so that the hang watchdog does not take it for a hang.

``marked_phase`` is what ``Guard.phase(name)`` runs, and the capture runs under it too: the
phase on the progress the watchdog reads, and ``phase`` events (``enter``, ``exit``) at the
step in progress when each is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from trainguard.events import EventLog
from trainguard.hang.progress import Progress


class HasStep(Protocol):
    @property
    def step(self) -> int: ...


@contextlib.contextmanager
def marked_phase(progress: Progress, events: EventLog, state: HasStep, name: str) -> Iterator[None]:
    """Run the block as phase ``name`` (``state``: where the step in progress is read)."""
    previous = progress.push_phase(name)
    events.write("phase", state.step, phase=name, state="enter")
    try:
        yield
    finally:
        progress.pop_phase(previous)
        events.write("phase", state.step, phase=name, state="exit")
