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

from trainguard.capture.rng import RngSnapshot
from trainguard.step.detect import GradStats
from trainguard.step.step_start import ForwardBatches
from trainguard.step.types import Reduced, SamplerDraws


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
    reduced: Reduced
    """The started agreement (its buffer is what ``host_values`` copies)."""
    batches: list[Any] = field(default_factory=list)
    rng: RngSnapshot | dict[str, Any] | None = None
    """The RNG states of the step's start (``capture.rng.states_of`` gives the dict)."""
    losses: list[Tensor] = field(default_factory=list)
    ok: bool | None = None
    """Set when read: the step was applied (finite on every rank)."""
    spike: tuple[Tensor, torch.cuda.Event | None] | None = None
    """The spike verdict staged to the host (``SpikeWatch.on_device``), or None."""
    autocast: dict[str, Any] | None = None
    """The autocast state the step's forward ran under (``step_start.autocast_state``)."""
    forward_inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    """The inputs of the step's training forwards (``StepStart.forward_inputs``)."""
    sampler_draws: SamplerDraws | None = None
    """What gives, per micro-batch, the dataset indices its ``DataLoader``'s sampler drew
    (``StepEvidence.sampler_draws``; read only if the step is bad), None without one."""
    forward_batches: ForwardBatches | None = None
    """Without ``batches``: the step's micro-batches as the model was called with them
    (``StepStart.forward_batches``, taken when the step ended)."""

    def values(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        values: list[float] = self.host_values.tolist()
        return values


class HostStager:
    """Copies the step's small buffer to the host without blocking.

    Two pinned buffers (and their events) are used in turn: a step's copy is read during the
    next step, before the step after that reuses its buffer. Allocating pinned memory and
    creating an event each step would cost host time that shows on launch-bound models.
    """

    def __init__(self) -> None:
        self._slots: list[tuple[Tensor, torch.cuda.Event]] = []
        self._turn = 0

    def stage(self, buf: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start the copy; CPU buffers are returned as they are."""
        if buf.device.type != "cuda":
            return buf, None
        if not self._slots or self._slots[0][0].shape != buf.shape:
            self._slots = [self._new_slot(buf) for _ in range(2)]
        host, ready = self._slots[self._turn]
        self._turn ^= 1
        host.copy_(buf, non_blocking=True)
        ready.record()
        return host, ready

    @staticmethod
    def _new_slot(buf: Tensor) -> tuple[Tensor, torch.cuda.Event]:
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        return host, torch.cuda.Event()  # type: ignore[no-untyped-call]


class FoundInf:
    """The ``found_inf`` flag fused optimizers take, from the agreed buffer, on the device.

    One fused kernel (``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's own
    check, with a scale of exactly 1) sets the flag when any value is NaN/Inf; the flag and
    the scale tensors are kept, so nothing is allocated per step.
    """

    def __init__(self) -> None:
        self._flags: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def of(self, buf: Tensor, device: torch.device) -> Tensor:
        """1.0 when ``buf`` holds a non-finite value, else 0.0 (float32, on ``device``)."""
        if buf.device not in self._flags:
            one = torch.ones((), dtype=torch.float32, device=buf.device)
            self._flags[buf.device] = (torch.zeros_like(one), one)
        found, one = self._flags[buf.device]
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([buf], found, one)
        return found if buf.device == device else found.to(device, non_blocking=True)


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
