"""``rerun=True`` in the integrations: a bad step is rerun through the framework's own path.

``Guard(rerun=loss_fn)`` reruns an agreed bad step in place (``trainguard.step.rerun``): it
rewinds buffers and RNG, clears the gradients and calls ``loss_fn(model, batch)`` for each
micro-batch the integration handed to ``guard.record_batch``. The Guard's model is the
user's module (the LightningModule, the HF model), while the framework runs the real forward
through its DDP wrapper: a rerun on the inner module would not all-reduce the gradients and
the ranks would drift apart. So the integrations' ``loss_fn`` reruns the framework's step
(Lightning's ``strategy.training_step`` + ``strategy.backward``, the Trainer's
``training_step``): forward through the wrapper, the framework's own loss normalisation and
backward, and the wrapper's ``no_sync`` for every micro-batch but the step's last (as the
framework's loop does). The framework has backpropagated by the time ``loss_fn`` returns:
it returns the loss as a detached leaf, whose ``backward()`` in the Guard's rerun is a no-op.

``StepMicroBatches`` keeps, per micro-batch of the step in progress, what the framework
passed along with it (batch index, wrapped model...), so that ``loss_fn`` can call the step
as the framework did, and says while a rerun runs (the integration's own hooks, e.g.
``on_before_backward``, must not record the rerun as a new micro-batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from trainguard.errors import ConfigError


@dataclass
class MicroBatch:
    """A micro-batch of the step in progress and what the framework ran it with."""

    batch: Any
    info: Any


class StepMicroBatches:
    """The micro-batches of the optimizer step in progress, in the order they ran."""

    def __init__(self) -> None:
        self._step = -1
        self._items: list[MicroBatch] = []
        self.active = False
        """True while a rerun runs (the integration's hooks then record nothing)."""

    def record(self, step: int, batch: Any, info: Any) -> None:
        """Keep ``batch`` (a reference) and ``info`` as a micro-batch of ``step``."""
        if step != self._step:
            self._step = step
            self._items = []
        self._items.append(MicroBatch(batch, info))

    def find(self, batch: Any) -> tuple[MicroBatch, bool]:
        """The recorded micro-batch that is ``batch``, and whether it is the step's last."""
        for index, item in enumerate(self._items):
            if item.batch is batch:
                return item, index == len(self._items) - 1
        raise RuntimeError(
            "trainguard: the rerun was handed a micro-batch the integration did not record"
        )

    @contextlib.contextmanager
    def rerunning(self) -> Iterator[None]:
        """Mark the rerun (the integration's hooks skip their recording meanwhile)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False


def backpropagated(loss: Tensor) -> Tensor:
    """``loss`` for the Guard's rerun once the framework has run its backward: a detached
    leaf, so that the rerun's own ``backward()`` touches no parameter."""
    return loss.detach().requires_grad_(True)


def pop_rerun(options: dict[str, Any], where: str) -> bool:
    """The integration's ``rerun`` option (True/False), taken out of the Guard's options."""
    rerun = options.pop("rerun", False)
    if not isinstance(rerun, bool):
        raise ConfigError(
            "rerun",
            f"{where}(rerun=...) takes True or False, got {rerun!r}: the integration reruns "
            "the framework's own step (no loss_fn to pass)",
        )
    return rerun
