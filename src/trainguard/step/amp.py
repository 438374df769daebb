"""fp16 with ``torch.amp.GradScaler``: unscale before the check, keep scales equal on all ranks.

GradScaler records a per-device ``found_inf`` when it unscales. Under FSDP2 one rank's shard
can overflow while another's does not; if each rank then updated its scale from its own flag
the scales would drift apart. After the agreement, every rank marks ``found_inf`` when the
step was bad anywhere, so ``scaler.update()`` moves every rank's scale the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _optimizer_state(scaler: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    states = getattr(scaler, "_per_optimizer_states", None)  # private, stable since torch 1.6
    if states is None:
        return None
    state: dict[str, Any] = states[id(optimizer)]
    return state


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients unless the user already did (e.g. to clip by hand)."""
    if not scaler.is_enabled():
        return
    state = _optimizer_state(scaler, optimizer)
    if state is not None and state.get("found_inf_per_device"):
        return  # already unscaled this step
    scaler.unscale_(optimizer)


def mark_overflow(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scaler.update()`` see an overflow on this rank (the step was bad on some rank)."""
    if not scaler.is_enabled():
        return
    state = _optimizer_state(scaler, optimizer)
    if state is None:
        return
    for found_inf in state.get("found_inf_per_device", {}).values():
        found_inf.fill_(1.0)


def scale_tensor(scaler: Any) -> Tensor | None:
    """The scaler's scale as a tensor for the step's row (its own device tensor: no host
    read), None without an enabled scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # GradScaler's, on the device once it scaled
    if isinstance(scale, Tensor):
        return scale
    return torch.tensor(float(scaler.get_scale()), dtype=torch.float64)  # no scale() yet


def current_scale(scaler: Any) -> float | None:
    """The scaler's current scale (a host read; called on bad steps only)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())
