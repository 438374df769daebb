"""This rank's optimizer state, for optimizers whose ``state_dict()`` is a collective.

``torch.distributed.optim.ZeroRedundancyOptimizer`` shards the optimizer state over the
ranks: its ``state_dict()`` raises until ``consolidate_state_dict(to=rank)`` (a collective)
gathered every shard on one rank. The guard's snapshots and captures are per rank and taken
where not every rank may join a collective, so for such an optimizer they hold this rank's
shard instead: the state of the local optimizer it wraps (``optimizer.optim``) and the
wrapper's param-group settings (the learning rate the loop sets is the wrapper's, copied
to the local optimizer at each ``step()``). Restoring loads both back. Any other optimizer:
its own ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

ZERO_KEY = "zero_local_shard"
"""Marks a state saved from a ``ZeroRedundancyOptimizer``'s local shard."""


def _zero_local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer a ``ZeroRedundancyOptimizer`` wraps, None for any other (its
    module is looked up, not imported: an optimizer of that class has imported it, and the
    import costs time and warnings about ``torch.jit``)."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    if zero is not None and isinstance(optimizer, zero):
        local: torch.optim.Optimizer = optimizer.optim
        return local
    return None


def is_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (its state sharded over ranks)."""
    return _zero_local(optimizer) is not None


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``, or this rank's shard of a ZeRO optimizer (module doc)."""
    local = _zero_local(optimizer)
    if local is None:
        return optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {ZERO_KEY: local.state_dict(), "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore what ``optimizer_state`` saved."""
    local = _zero_local(optimizer)
    if local is None or ZERO_KEY not in state:
        optimizer.load_state_dict(state)
        return
    local.load_state_dict(state[ZERO_KEY])
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)


def clear_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the moments and step counters (recovery's last rung); a ZeRO optimizer's local
    shard too, which holds them."""
    optimizer.state.clear()
    local = _zero_local(optimizer)
    if local is not None:
        local.state.clear()
