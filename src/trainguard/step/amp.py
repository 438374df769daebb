"""fp16 with ``torch.amp.GradScaler``: unscale before the check, keep scales equal on all ranks.

GradScaler records a per-device ``found_inf`` when it unscales. Under FSDP2 one rank's shard
can overflow while another's does not; if each rank then updated its scale from its own flag
the scales would drift apart. After the agreement, every rank marks ``found_inf`` when the
step was bad anywhere, so ``scaler.update()`` moves every rank's scale the same way.

GradScaler keys that state by the optimizer object given to ``unscale_``/``step``. A wrapper
(accelerate's ``AcceleratedOptimizer``, ``.optimizer``; ``._optimizer`` elsewhere) steps the
optimizer it holds through the same scaler (``scaler.step(self.optimizer)``): the gradients
are unscaled through the innermost optimizer and its state is the state of every wrapper
around it, so whichever of them the loop steps finds them unscaled (unscaled through the
wrapper, the wrapper's step unscaled them a second time: every update divided by the scale).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

WRAPPED = ("optimizer", "_optimizer")
"""Where a wrapper holds the optimizer it steps (accelerate's ``AcceleratedOptimizer``:
``optimizer``; Lightning's ``LightningOptimizer``: ``_optimizer``)."""


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it wraps, outermost first (a wrapper steps the one it
    holds, whose parameter groups are its own)."""
    chain: list[torch.optim.Optimizer] = [optimizer]
    while len(chain) < 8:
        inner = next(
            (
                held
                for held in (getattr(chain[-1], name, None) for name in WRAPPED)
                if isinstance(held, torch.optim.Optimizer) and held not in chain
            ),
            None,
        )
        if inner is None:
            break
        chain.append(inner)
    return chain


def _optimizer_state(scaler: Any, chain: list[torch.optim.Optimizer]) -> dict[str, Any] | None:
    """The scaler's state of this step for any optimizer of ``chain`` (``optimizers_of``),
    None if none was unscaled (looked up without adding an entry: ``update()`` reads them
    all)."""
    states = getattr(scaler, "_per_optimizer_states", None)  # private, stable since torch 1.6
    if states is None:
        return None
    for held in chain:
        state: dict[str, Any] | None = states.get(id(held))
        if state is not None and state.get("found_inf_per_device"):
            return state
    return None


def unscale(scaler: Any, optimizer: torch.optim.Optimizer, last: Any = None) -> tuple[Any, bool]:
    """Unscale the gradients unless the loop already did this step (e.g. to clip by hand).
    Returns the scaler's state of the step (``last`` at the next step) and whether ``last``
    was stale.

    ``last`` still the state at the next step: the scaler was not updated after the step
    before (a loop that steps the optimizer only when ``check()`` says so, under a wrapper
    that updates the scaler inside its ``step()``). Its ``found_inf`` would make the scaler
    leave out this step's update too, and the check would read scaled gradients: it is
    dropped, this step unscaled anew, and the scale backed off as that update would have
    (the step was left out: its ``found_inf`` is set), so the loop's overflows still bring
    the scale down instead of repeating at the same scale forever."""
    if not scaler.is_enabled():
        return None, False
    chain = optimizers_of(optimizer)
    state = _optimizer_state(scaler, chain)
    stale = state is not None and state is last
    missed = stale and _found_inf(state)
    if stale:
        for held in chain:
            scaler._per_optimizer_states.pop(id(held), None)
        state = None
    if state is None:
        scaler.unscale_(chain[-1])
        state = _optimizer_state(scaler, chain[-1:])
    if missed:
        _back_off(scaler)
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None and state is not None:
        for held in chain:
            states[id(held)] = state
    return state, stale


def _found_inf(state: Any) -> bool:
    """Whether a step's state recorded an overflow (a host read: a stale state only)."""
    return any(float(flag.sum()) > 0 for flag in state["found_inf_per_device"].values())


def _back_off(scaler: Any) -> None:
    """What ``scaler.update()`` does after an overflow: the scale times the backoff factor and
    the growth count back to 0 (after this step's unscale, which used the scale its loss
    was scaled by)."""
    scale, growth = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if isinstance(scale, Tensor):
        scale.mul_(scaler.get_backoff_factor())
    if isinstance(growth, Tensor):
        growth.zero_()


def mark_overflow(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scaler.update()`` see an overflow on this rank (the step was bad on some rank)."""
    if not scaler.is_enabled():
        return
    state = _optimizer_state(scaler, optimizers_of(optimizer))
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
