"""LR backoff as a factor on the schedule: ``lr = schedule(step) x factor``.

The factor is applied only around ``optimizer.step()``: a step pre-hook multiplies every
param group's ``lr`` by the factor and a post-hook puts the scheduler's value back. So
``scheduler.step()`` (which, for the chainable schedulers, computes from the current
``group["lr"]``), ``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` never see a
scaled LR, and the schedule goes on as if there had been no backoff. A loop that sets
``group["lr"]`` itself before each step gets its value scaled the same way (once: an optimizer
subclass whose ``step()`` calls ``super().step()`` runs the hooks twice, and the nested pair
is recognised by the very ``lr`` objects the outer one set). The factor lives in
the guard's recovery state (saved with snapshots and checkpoints) and ramps linearly back to 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from trainguard.recovery.failure.boundary import StepBoundary


@dataclass
class Backoff:
    start: int = 0
    """First step of the backoff."""
    factor: float = 1.0
    """The factor right after the zero-LR steps; ramps linearly to 1."""
    ramp_steps: int = 1
    zero_steps: int = 0
    """Steps at factor 0 first (after an optimizer-moment reset)."""

    def at(self, step: int) -> float:
        """The LR factor for optimizer step ``step``."""
        if self.factor >= 1.0 and self.zero_steps == 0:
            return 1.0
        done = step - self.start
        if done < 0:
            return 1.0
        if done < self.zero_steps:
            return 0.0
        ramped = (done - self.zero_steps) / self.ramp_steps
        if ramped >= 1.0:
            return 1.0
        return self.factor + (1.0 - self.factor) * ramped

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Backoff:
        return cls(**state)


class LrFactor:
    """Installs the pre/post step hooks on ``optimizer``; ``step_of()`` names the step."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, boundary: StepBoundary | None = None
    ) -> None:
        self.optimizer = optimizer
        self._boundary = boundary
        """Closed when an update begins (a state at a failure is a step's start only)."""
        self.backoff = Backoff()
        self.step = 0
        """The optimizer step the next ``optimizer.step()`` performs (set by the guard)."""
        self._saved: list[float] | None = None
        self._scaled: list[Any] = []
        """The very ``lr`` objects the pre-hook set: seeing them again means a nested step."""
        self._nested = 0
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def current(self) -> float:
        return self.backoff.at(self.step)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._boundary is not None:
            self._boundary.update_begins()
        if self._saved is not None and self._is_scaled(optimizer):
            # A subclass's step() calling super().step(): torch runs the hooks of both
            # patched methods. The LR is scaled already; scaling again would square it.
            self._nested += 1
            return
        factor = self.current()
        if factor == 1.0:
            self._saved = None
            return
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = _scaled(group["lr"], factor)
        self._scaled = [group["lr"] for group in optimizer.param_groups]

    def _is_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        return len(groups) == len(self._scaled) and all(
            group["lr"] is lr for group, lr in zip(groups, self._scaled, strict=True)
        )

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._boundary is not None and not self._nested:
            self._boundary.update_ends()
        if self._nested:
            self._nested -= 1
            return
        saved, self._saved = self._saved, None
        self._scaled = []
        if saved is None:
            return
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def close(self) -> None:
        """Take the step hooks off the optimizer (idempotent): a closed guard leaves nothing
        of its own in the user's optimizer, and a later guard over it adds its own once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _scaled(lr: Any, factor: float) -> Any:
    if isinstance(lr, torch.Tensor):
        return lr * factor
    return float(lr) * factor
