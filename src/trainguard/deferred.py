"""The sync-free step: the decision acts on the device now, the host reads it a step later.

With a fused optimizer (``fused=True`` Adam, AdamW, SGD) ``guard.step()`` hands the agreed
"bad somewhere" flag to the optimizer as ``found_inf``, so a bad step is skipped on the device
(the fused kernel leaves weights, moments and step counts alone) with no host sync on the hot
path. The reduced buffer is copied to the host without blocking; the host reads it during the
next ``guard.step()`` (before that step's update), or when the returned outcome is tested.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainguard.detect import GradStats


def uses_fused(optimizer: torch.optim.Optimizer) -> bool:
    """True when every parameter group runs the fused kernels (they accept ``found_inf``)."""
    groups = optimizer.param_groups
    return bool(groups) and all(group.get("fused") for group in groups)


@dataclass
class PendingStep:
    """A step whose decision was taken on the device and is not yet read on the host."""

    step: int
    host_values: Tensor
    """The reduced buffer on the host (pinned and filled asynchronously under CUDA)."""
    ready: torch.cuda.Event | None
    stats: GradStats
    """The gradient pass (norms only; gradient references are dropped)."""
    batches: list[Any] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    losses: list[Tensor] = field(default_factory=list)
    ok: bool | None = None
    """Set when read: the step was applied (finite on every rank)."""

    def values(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        values: list[float] = self.host_values.tolist()
        return values


def stage_to_host(buf: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Start copying ``buf`` to the host without blocking; CPU buffers are returned as is."""
    if buf.device.type != "cuda":
        return buf, None
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return host, ready


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor | None) -> None:
    """Hand ``found_inf`` to a fused optimizer's next ``step()`` (None removes it)."""
    if found_inf is None:
        for name in ("found_inf", "grad_scale"):
            if hasattr(optimizer, name):
                delattr(optimizer, name)
        return
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]


class StepOutcome:
    """What ``guard.step()`` returns: truthy when the step was applied on every rank.

    For a sync-free step the answer is read from the device only when you test it, so a
    loop that ignores the return value never waits for the device.
    """

    def __init__(self, value: bool | None = None, read: Callable[[], bool] | None = None):
        self._value = value
        self._read = read

    def __bool__(self) -> bool:
        if self._value is None:
            self._value = self._read() if self._read is not None else True
        return self._value

    def __repr__(self) -> str:
        state = "pending" if self._value is None else str(self._value)
        return f"StepOutcome({state})"
