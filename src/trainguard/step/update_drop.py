"""Dropping a step's update: a skipped, spiked or escalated step leaves no trace.

The gradients are cleared (the optimizer's and every parameter's; ``trainguard run`` gets
them back after the script's own optimizer step, ``give_back``) and the buffers the step's
forward wrote are put back (``buffers.BufferKeeper``: BatchNorm statistics, counters), so
the model is exactly as before the step. Buffers the forward wrote for the first time (no
copy was taken yet) cannot be put back: a ``buffers_not_restored`` event and a warning name
them; they are copied at every step from then on.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainguard.events import EventLog
from trainguard.step.step_start import StepStart

logger = logging.getLogger(__name__)


class UpdateDrop:
    """Clears a step's gradients and puts its buffers back."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[tuple[str, nn.Parameter]],
        start: StepStart,
        events: EventLog,
        rank: int,
    ) -> None:
        self._optimizer = optimizer
        self._params = params
        self._start = start  # its BufferKeeper is read at each drop: it may be replaced
        self._events = events
        self._rank = rank
        self.keep_dropped = False
        """Keep the cleared gradients in ``dropped`` (``trainguard run``: the script's own
        optimizer step runs after the skip, and its code after that may read them)."""
        self.dropped: list[tuple[nn.Parameter, torch.Tensor]] = []
        """With ``keep_dropped``: the last dropped step's gradients, for ``give_back``."""
        self._said_carried = False
        self.given: list[tuple[nn.Parameter, torch.Tensor, int]] = []
        """The gradients ``give_back`` put back, with their version counters: the loop's
        next training forward looks whether it left them as they were (``carried``)."""

    def give_back(self) -> None:
        """Put the last dropped step's gradients back on their parameters (after the
        optimizer step that must not see them), as the script would have had them."""
        for param, grad in self.dropped:
            if param.grad is None:
                param.grad = grad
                self.given.append((param, grad, grad._version))
        self.dropped = []

    def carried(self) -> int:
        """At the loop's next training forward: clear the given-back gradients it left as they
        were (neither set to None nor zeroed in place), which hold the skipped step's
        non-finite values: a loop that carries gradients across optimizer steps would make
        every later step non-finite; one that zeroes them after its forward loses nothing.
        Returns how many were cleared (``say_carried`` tells which loop it was)."""
        given, self.given = self.given, []
        cleared = 0
        for param, grad, version in given:
            if param.grad is grad and grad._version == version:
                param.grad = None
                cleared += 1
        return cleared

    def say_carried(self, step: int) -> None:
        """``step`` reached its check with gradients ``carried`` cleared at its forward and no
        ``zero_grad`` since: the loop carries gradients across optimizer steps (said once)."""
        if self._said_carried:
            return
        self._said_carried = True
        logger.warning(
            "trainguard: rank %d: step %d began with the skipped step's gradients still on "
            "the parameters, and the loop does not clear them before its backward (it carries "
            "gradients across optimizer steps): cleared at its first forward, else every "
            "later step would be non-finite; the gradients carried into the skipped step are "
            "dropped with it",
            self._rank,
            step,
        )

    def __call__(self, step: int) -> int:
        """Drop ``step``'s update; returns how many buffers were put back."""
        if self.keep_dropped:
            self.dropped = [(p, p.grad) for _, p in self._params if p.grad is not None]
        self._optimizer.zero_grad(set_to_none=True)
        for _, param in self._params:
            param.grad = None
        buffers = self._start.buffers
        restored = buffers.restore(step)
        if restored:
            logger.debug("trainguard: step %d: buffers put back: %s", step, restored)
        if buffers.uncopied:
            self._not_restored(step, buffers.uncopied)
        return len(restored)

    def _not_restored(self, step: int, names: list[str]) -> None:
        self._events.write("buffers_not_restored", step, buffers=names)
        logger.warning(
            "trainguard: rank %d: step %d was not applied, but its forward was the first to "
            "write %s, which could not be put back; they are copied at every step from now on",
            self._rank,
            step,
            ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else ""),
        )
