"""Rerun a bad step in place before deciding: a transient fault costs nothing.

``Guard(rerun=loss_fn)``: when every rank has agreed that a step went non-finite, every rank
(so DDP's collectives still pair up) puts the step back at its start, recomputes it and
agrees again, before the policy runs:

1. the buffers the step's forward wrote are put back (``buffers.BufferKeeper``), the RNG
   states are set to those of the step's first forward (dropout draws the same masks), the
   gradients are cleared;
2. each micro-batch of the step goes through ``loss_fn(model, batch)`` and ``backward``
   under the autocast state the step's forward ran under; under DDP every micro-batch but
   the last runs in ``no_sync()``, as an accumulating loop does;
3. the gradient pass and the agreement run again.

Finite everywhere: *transient* (a flipped bit, a flaky device): the step counts with the
rerun's gradients. Still bad: *persistent*: the usual policy (skip, rollback...) follows.

``loss_fn`` is the replay factory's: it returns the loss the loop backpropagates for one
micro-batch (divided by the accumulation count if the loop divides it). A ``loss_fn`` that
runs a framework's whole step (the integrations': forward under the framework's own
precision context, then its backward) sets ``runs_own_autocast = True``: the rerun then
enters no autocast around it, which would put the framework's backward inside one (a
backward the first pass ran outside autocast, and whose gradients then differ in bf16).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.capture.rng import set_rng_state
from trainguard.step.step_start import StepStart

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class RerunResult:
    """What the rerun computed: the step's last micro-batch loss and every micro loss."""

    loss: Tensor
    micro_losses: list[Tensor]


class StepRerun:
    """Recomputes a step from its start (every rank at once)."""

    def __init__(self, loss_fn: LossFn, model: nn.Module, start: StepStart) -> None:
        self._loss_fn = loss_fn
        self._model = model
        self._start = start

    def run(self, step: int, batches: list[Any]) -> RerunResult:
        """Put the step back at its start and run its micro-batches again."""
        self._rewind(step)
        losses: list[Tensor] = []
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            with self._sync(last), self._autocast():
                loss = self._loss_fn(self._model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
        if not losses:
            raise RuntimeError(f"step {step}: no micro-batch to rerun")
        return RerunResult(losses[-1], losses[:-1])

    def _rewind(self, step: int) -> None:
        self._start.buffers.restore(step)
        if self._start.started(step) and self._start.rng is not None:
            set_rng_state(self._start.rng)
        for param in self._model.parameters():
            param.grad = None

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self._model, "no_sync", None)
        if last or not callable(no_sync):
            return contextlib.nullcontext()
        context: contextlib.AbstractContextManager[Any] = no_sync()
        return context

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if getattr(self._loss_fn, "runs_own_autocast", False):
            return contextlib.nullcontext()  # the framework's step enters its own
        state = self._start.autocast
        if not state or not state.get("enabled"):
            return contextlib.nullcontext()
        dtype = getattr(torch, str(state["dtype"]))
        return torch.autocast(str(state["device_type"]), dtype=dtype)


def ranks_by_host(hosts: list[str], ranks: list[int]) -> dict[str, list[int]]:
    """The ranks grouped by the host they run on."""
    grouped: dict[str, list[int]] = {}
    for rank in ranks:
        host = hosts[rank] if rank < len(hosts) else "?"
        grouped.setdefault(host, []).append(rank)
    return grouped


class SuspectHosts:
    """Counts transient faults per host; a host past ``after`` faults within ``window``
    steps is suspect (identical on every rank: fed from agreed data only)."""

    def __init__(self, after: int, window: int) -> None:
        self._after = after
        self._window = window
        self._faults: dict[str, list[int]] = {}

    def counts(self) -> dict[str, int]:
        """Transient faults per host so far."""
        return {host: len(steps) for host, steps in sorted(self._faults.items())}

    def transient(self, step: int, hosts: list[str]) -> list[str]:
        """Record a transient fault of ``hosts`` at ``step``; returns the suspect hosts."""
        suspect = []
        for host in sorted(set(hosts)):
            steps = [s for s in self._faults.get(host, []) if s > step - self._window]
            steps.append(step)
            self._faults[host] = steps
            if self._after > 0 and len(steps) >= self._after:
                suspect.append(host)
        return suspect
