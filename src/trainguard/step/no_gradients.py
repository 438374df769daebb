"""Loop mistakes the guard can see for free, said once: ``check()`` before ``backward()``.

A ``check()`` called before ``loss.backward()`` (or after ``optimizer.zero_grad()``) finds no
gradient at all, so it can only pass: the step is not guarded. The gradient pass
(``detect.grad_stats``) already lists the gradients it read, so the test is whether that
list is empty: no extra pass, no host sync. Only when it is empty are the parameters asked
whether any requires a gradient (a frozen model has none to check and is not warned about).

"No gradient at all" on this rank, not "some missing": under DDP with unused parameters
some gradients are None on a good step, and under FSDP2 every rank holds a (maybe empty)
shard of each gradient. The warning is this rank's (a log line and a
``check_without_gradients`` event in its own event log): it changes no decision, so it
needs no agreement.
"""

from __future__ import annotations

import logging

from torch import nn

from trainguard.events import EventLog
from trainguard.step.detect import GradStats

logger = logging.getLogger(__name__)

NO_GRADIENTS_FIX = "call guard.check(loss) after loss.backward() and before optimizer.step()"


class NoGradientsCheck:
    """Warns once when ``check()`` finds no gradient while the parameters require one."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], events: EventLog, rank: int):
        self._params = params
        self._events = events
        self._rank = rank
        self.warned = False

    def seen(self, stats: GradStats, step: int, backward_ran: bool = True) -> None:
        """After the gradient pass of ``step``: warn (once) when it read no gradient.
        ``backward_ran`` False: the step ran no backward by design
        (``Guard.check_gradients(backward_ran=False)``): no gradient is expected there."""
        if self.warned or stats.grads or not backward_ran:
            return
        if not any(param.requires_grad for _, param in self._params):
            return  # frozen: nothing to check, nothing forgotten
        self.warned = True
        self._events.write("check_without_gradients", step, fix=NO_GRADIENTS_FIX)
        logger.warning(
            "trainguard: rank %d: check() at step %d found no gradient on any parameter, so "
            "it could not check them (was it called before loss.backward(), or after "
            "optimizer.zero_grad()?); fix: %s",
            self._rank,
            step,
            NO_GRADIENTS_FIX,
        )
