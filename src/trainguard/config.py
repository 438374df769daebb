"""GuardConfig: every Guard option, documented and validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainguard.errors import ConfigError

NonFiniteAction = Literal["skip", "warn", "raise"]
_ACTIONS = ("skip", "warn", "raise")


@dataclass
class GuardConfig:
    """Options of :class:`trainguard.Guard`. Invalid values raise :class:`ConfigError`."""

    run_dir: Path | str = "runs/trainguard"
    """Folder for ``events/``, ``captures/`` and ``hangs/``; every rank must pass the same path."""

    on_nonfinite: NonFiniteAction = "skip"
    """What a non-finite step does: ``"skip"`` clears the gradients (set to None) and returns
    False; ``"warn"`` logs, writes an event and returns False, leaving the gradients alone;
    ``"raise"`` raises :class:`NonFiniteError` on every rank."""

    max_consecutive: int = 5
    """Bad steps in a row before the guard escalates (NonFiniteError on every rank)."""

    capture: bool = True
    """Write a replay bundle for the first bad step and on escalation."""

    grad_clip: float | None = None
    """Max total gradient norm; applied in the same pass that checks the gradients."""

    hang_timeout: float | None = None
    """Seconds without progress before a hang is declared; None learns it; 0 disables."""

    accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``watch()`` groups batches by this count."""

    min_loss_scale: float = 1.0
    """With a GradScaler: an overflow while the loss scale is below this escalates."""

    max_recorded_steps: int = 100
    """How many bad step numbers ``guard.state.nonfinite_steps`` keeps (the most recent)."""

    history_steps: int = 256
    """How many recent step records (losses, gradient norm, decision, lr) the guard keeps in
    memory and writes into a capture bundle as ``history.json``."""

    extra: dict[str, object] = field(default_factory=dict)
    """Free-form metadata written into the ``start`` event (experiment name, git sha...)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.on_nonfinite not in _ACTIONS:
            raise ConfigError(
                "on_nonfinite", f"got {self.on_nonfinite!r}; use one of {', '.join(_ACTIONS)}"
            )
        if not isinstance(self.max_consecutive, int) or self.max_consecutive < 1:
            raise ConfigError(
                "max_consecutive", f"got {self.max_consecutive!r}; use an integer >= 1"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError("grad_clip", f"got {self.grad_clip!r}; use a positive number or None")
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise ConfigError(
                "hang_timeout", f"got {self.hang_timeout!r}; use seconds > 0, 0 to disable, or None"
            )
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(
                "accumulation_steps", f"got {self.accumulation_steps!r}; use an integer >= 1"
            )
        if not self.min_loss_scale > 0:
            raise ConfigError("min_loss_scale", f"got {self.min_loss_scale!r}; use a number > 0")
        if self.max_recorded_steps < 1:
            raise ConfigError("max_recorded_steps", "use an integer >= 1")
        if not isinstance(self.history_steps, int) or self.history_steps < 1:
            raise ConfigError("history_steps", f"got {self.history_steps!r}; use an integer >= 1")
