"""The tensor each ``backward()`` runs on: a NaN made after the loss the guard read.

The loss ``trainguard run`` reads (``loss_inputs``) is the first 0-d result computed from the
model's output (``F.cross_entropy(...)``). A loop often goes on from there before its
backward: an auxiliary term (``loss + 0.01 * aux``), a division (``loss / accumulation``), a
product. A NaN made there reached the gradients, and under DDP or FSDP every rank's (their
all-reduce spreads it): the step was skipped, but every rank looked alike (``grad_ranks``
all of them, ``loss_ranks`` none) and no event could name the rank it came from.

So ``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped, process-wide as
the clipping functions are (``BackwardCalls``): a 0-d tensor it runs on is handed to
``LossInputs.backward_on``, which keeps it (detached: no copy, no host read) when it was
computed from the latest loss read (that loss's autograd node within a few nodes of its
own; the node is let go at that backward, or when the followers disarm). At the check, a
loss whose backward tensor is not finite is taken as that tensor (``torch.where``, on the
device): the step is bad on that rank, by its loss. Its value is
never used otherwise (scaled, divided, summed: not the loss). Under a GradScaler nothing
changes (its scaled loss overflowing is the scaler's business: ``skip``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

Listener = Callable[[Tensor], None]


class BackwardCalls:
    """Wraps ``torch.autograd.backward`` while installed; each 0-d tensor it runs on goes to
    ``listeners`` (never into the script's call: a listener's error is logged at debug)."""

    def __init__(self, listeners: Sequence[Listener], skip: Callable[[], bool]) -> None:
        self._listeners = listeners
        self._skip = skip
        self._restore: Callable[[], None] | None = None

    def install(self) -> None:
        if self._restore is not None:
            return
        original = torch.autograd.backward
        wrapper = self._wrap(original)
        torch.autograd.backward = wrapper

        def restore() -> None:
            if torch.autograd.backward is wrapper:
                torch.autograd.backward = original

        self._restore = restore

    def remove(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensors, Tensor) and tensors.dim() == 0 and not self._skip():
                try:
                    for listener in self._listeners:
                        listener(tensors)
                except Exception as exc:  # never into the script's call
                    logger.debug("trainguard run: a backward's tensor not read: %s", exc)
            return original(tensors, *args, **kwargs)

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        return backward


def computed_from(tensor: Tensor, node: Any, depth: int = 6) -> bool:
    """Whether ``tensor`` was computed from the autograd ``node`` (a loss's ``grad_fn``)
    within ``depth`` autograd nodes: ``loss * x``, ``(loss + aux) / n``. A bounded walk
    (at most 64 nodes): a loss several ops before the backward is the usual case."""
    frontier: list[Any] = [tensor.grad_fn]
    seen = 0
    for _ in range(depth):
        following: list[Any] = []
        for current in frontier:
            if current is None:
                continue
            if current is node:
                return True
            seen += 1
            if seen > 64:
                return False
            following += [n for n, _ in current.next_functions if n is not None]
        frontier = following
    return False
