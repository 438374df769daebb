"""GuardState: the counters every rank keeps identically, and their (de)serialization."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


class Part(Protocol):
    """A part of the guard whose state travels with the counters (the spike statistics)."""

    total: int
    """Spikes seen since the start of the run: cumulative (a rollback keeps it)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


RECORDED_STEPS = 100
"""How many bad step numbers ``GuardState.nonfinite_steps`` keeps (the most recent)."""


@dataclass
class GuardState:
    """Where the guarded run stands. Identical on every rank (it is built from agreed data)."""

    step: int = 0
    """The next optimizer step's number (steps count calls of ``check()``, from 0)."""
    consecutive_nonfinite: int = 0
    """Bad steps in a row ending at the last checked step."""
    total_nonfinite: int = 0
    """Bad steps since the start (of the run, when resumed from ``state_dict()``)."""
    last_good_step: int | None = None
    """The last step whose loss and gradients were finite on every rank."""
    last_good_loss: float | None = None
    """That step's loss, averaged over ranks."""
    nonfinite_steps: deque[int] = field(default_factory=lambda: deque(maxlen=100))
    """The most recent bad step numbers (capped)."""
    overflow_steps: int = 0
    """fp16 steps the GradScaler skipped for overflow (not counted as non-finite)."""
    last_streak: int = 0
    """Bad steps in a row ending at the last decided step, kept through a rollback (which
    restores ``consecutive_nonfinite`` to the snapshot's): what the escalating step had."""
    leaving_ranks: list[int] = field(default_factory=list)
    """The ranks whose caller stops guarding after the last agreed step
    (``Agreement.leaving_ranks``; empty while every rank's goes on): a run's end, not saved."""
    spikes: Part | None = field(default=None, repr=False, compare=False)
    """The spike statistics (``SpikeWatch``): saved and restored with the counters, so a
    rollback or a resume judges the next steps as the run did at that step."""

    def record_good(self, step: int, loss: float) -> None:
        self.consecutive_nonfinite = self.last_streak = 0
        self.last_good_step = step
        self.last_good_loss = loss

    def record_bad(self, step: int) -> None:
        self.consecutive_nonfinite += 1
        self.last_streak = self.consecutive_nonfinite
        self.total_nonfinite += 1
        self.nonfinite_steps.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "total_nonfinite": self.total_nonfinite,
            "last_good_step": self.last_good_step,
            "last_good_loss": self.last_good_loss,
            "nonfinite_steps": list(self.nonfinite_steps),
            "overflow_steps": self.overflow_steps,
            "last_streak": self.last_streak,
            **(
                {"spikes": self.spikes.state_dict(), "total_spikes": self.spikes.total}
                if self.spikes is not None
                else {}  # a bare copy (the sync-free step's settled one) overrides neither
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.total_nonfinite = int(state["total_nonfinite"])
        self.last_good_step = state["last_good_step"]
        self.last_good_loss = state["last_good_loss"]
        self.nonfinite_steps.clear()
        self.nonfinite_steps.extend(int(s) for s in state["nonfinite_steps"])
        self.overflow_steps = int(state.get("overflow_steps", 0))
        self.last_streak = int(state.get("last_streak", self.consecutive_nonfinite))
        if self.spikes is not None and "spikes" in state:  # absent: saved before spikes
            self.spikes.load_state_dict(state["spikes"])
        if self.spikes is not None and "total_spikes" in state:
            self.spikes.total = int(state["total_spikes"])
