"""Progress of the local training loop: step, phase and a heartbeat counter.

The main thread updates it (plain attribute writes, no locks on the hot path); the watchdog
thread reads it and publishes it to the other ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("init", "data", "step", "check", "done", "closed")
"""Built-in phases (``done``: a ``watch()`` loop ended); users add their own with
``guard.phase("eval")``."""


@dataclass
class Progress:
    step: int = 0
    phase: str = "init"
    beats: int = 0
    phase_since: float = field(default_factory=time.monotonic)
    user_phases: list[str] = field(default_factory=list)
    busy_beats: int = 0
    """The beats of ``busy``: work between steps on another module (``hang/busy.py``)."""
    pass_start: bool = False
    """A ``watch()`` pass is fetching its first batches (a DataLoader starting its workers
    at each epoch): the learned hang timeout gives that the start's grace."""

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if phase != self.phase:
            self.phase = phase
            self.phase_since = time.monotonic()
        self.beats += 1

    def beat(self) -> None:
        """Progress in the phase the loop is in (an evaluation's forward between steps)."""
        self.beats += 1

    def busy(self) -> None:
        """Work between steps that is not the loop's (an EMA copy's forward): progress for
        the hang rule, not a stretch the learned timeout measures (``hang/busy.py``)."""
        self.busy_beats += 1
        self.beats += 1

    def push_phase(self, name: str) -> str:
        """Enter the user phase ``name`` (``guard.phase``); returns the phase to go back to
        (``pop_phase``)."""
        previous = self.phase
        self.user_phases.append(name)
        self.enter(name)
        return previous

    def pop_phase(self, previous: str) -> None:
        """Leave the innermost user phase, back to ``previous`` (``push_phase``'s answer)."""
        self.user_phases.pop()
        self.enter(previous)

    @property
    def in_user_phase(self) -> bool:
        return bool(self.user_phases)
