"""The step's losses: what ``check()`` and ``record_loss()`` accept, and which are recorded.

What is accepted: a tensor (0-dim as usual; with several elements their mean is checked and
reported) or a plain Python number (``check(loss.item())``, as some loops already hold the
loss on the host). A number becomes a 0-dim float64 tensor on the guard's device by a fill
(``torch.full``): no host-to-device copy, no sync. Anything else is a ``ConfigError`` naming
``loss`` and what it takes.

The rule for ``record_loss()`` and ``check(loss)`` (gradient accumulation): each micro-batch's
loss is recorded exactly once.

- ``check(loss)``'s loss is always checked (a non-finite value marks the step bad).
- The value reported for the step (the agreed per-rank ``losses``, the metrics log, the
  spike rule, ``last_good_loss``, ``trainguard/loss``) is the mean of the step's micro-batch
  losses: ``check()``'s loss when it is the only one; under accumulation the window's mean,
  NaN/Inf when any micro-batch's is (each loss as the loop computed it: a loss the loop
  divided by the window before ``backward`` is reported so divided, unless handed over
  undivided, as the Lightning and HF integrations do).
- The step's micro-batch losses (the capture's ``micro_losses``) are the losses recorded
  with ``record_loss()`` during the step, then ``check()``'s loss, unless it is the loss last
  recorded: the same tensor (or a view of the same memory, e.g. ``loss.detach()``) or the
  same Python number object. So both usual loops record each loss once: ``record_loss()`` on
  every micro-batch and ``check()`` with the last one, or ``record_loss()`` on all but the last
  and ``check()`` with the last. Without ``record_loss()``, ``check()``'s loss is the step's
  only loss. ``check()`` with no loss takes the loss last recorded (``record_loss()`` on
  every micro-batch, then ``check()``); with none recorded it is a ``ConfigError``.
- Every recorded loss is checked too, so a NaN in any micro-batch marks the step bad even
  when its gradients came out finite.

The identity test reads tensor metadata only (``data_ptr``, shape, dtype, device): no sync.
A recorded tensor is held until the step ends, so its memory cannot be reused meanwhile.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from trainguard.errors import ConfigError

LossLike = Tensor | float | int
"""What ``check()``, ``step()`` and ``record_loss()`` take."""


def as_loss(loss: Any, device: torch.device, option: str = "loss") -> Tensor:
    """``loss`` as a tensor: a tensor as it is, a Python number as a 0-dim float64 tensor on
    ``device`` (filled on the device: no copy, no sync). Raises ``ConfigError`` otherwise."""
    if isinstance(loss, Tensor):
        if loss.numel() == 0:
            raise ConfigError(
                option,
                "got an empty tensor; pass the loss as a 0-dim tensor or a Python float/int",
            )
        return loss
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.full((), float(loss), dtype=torch.float64, device=device)
    raise ConfigError(
        option,
        f"got {type(loss).__name__}; pass the loss as a torch.Tensor (0-dim, as returned by "
        "the loss function) or as a Python float/int (loss.item())",
    )


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values in the same memory (metadata only)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
    )


class StepLosses:
    """The losses of the step in progress (the rule above)."""

    def __init__(self) -> None:
        self._recorded: list[Tensor] = []
        self._last_number: Any = None
        """The Python number last recorded (the object), so ``check()`` can tell it is it."""
        self._step: list[Tensor] = []

    def tensor(self, loss: Any, device: torch.device) -> Tensor:
        """``as_loss``; the Python number last recorded gives back its recorded tensor."""
        if self._recorded and self._last_number is not None and loss is self._last_number:
            return self._recorded[-1]
        return as_loss(loss, device)

    def last_recorded(self) -> Tensor:
        """The loss last recorded this step, for a ``check()`` given none (``ConfigError``
        when none was)."""
        if not self._recorded:
            raise ConfigError(
                "loss",
                "check() was given no loss and no record_loss() came before it in this step; "
                "pass the loss (check(loss): a tensor or a Python float), call "
                "guard.record_loss(loss) after each micro-batch's backward, or use "
                "guard.check_gradients() where no loss is at hand",
            )
        return self._recorded[-1]

    def record(self, loss: Any, device: torch.device) -> None:
        """A micro-batch's loss (``record_loss``); kept on its device, no sync."""
        self._recorded.append(as_loss(loss, device).detach())
        self._last_number = None if isinstance(loss, Tensor) else loss

    def replace(self, losses: list[Tensor]) -> None:
        """The step's micro-batch losses, all of them (a rerun computed them again)."""
        self.clear()
        self._recorded = [loss.detach() for loss in losses]

    def checked(self, loss: Tensor) -> list[Tensor]:
        """``check()``'s loss: returns the step's losses, each once (what the finiteness
        check covers: a float64 sum of them is non-finite when any is)."""
        loss = loss.detach()
        recorded = self._recorded
        self._step = recorded if recorded and _same(recorded[-1], loss) else [*recorded, loss]
        return self._step

    def step_losses(self) -> list[Tensor]:
        """The step's losses, each once: the recorded ones and ``check()``'s (rule above)."""
        return list(self._step) if self._step else list(self._recorded)

    def take(self) -> list[Tensor]:
        """``step_losses()``, and the next step starts afresh."""
        losses = self.step_losses()
        self.clear()
        return losses

    def clear(self) -> None:
        self._recorded = []
        self._last_number = None
        self._step = []
