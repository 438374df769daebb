"""Make every replica take one rank's copy: parameters, buffers and optimizer state, by
``torch.distributed.broadcast`` from that rank, tensor by tensor (``on_divergence="resync"``).

Every rank must call :func:`broadcast_state` at the same point. The optimizer state's
layout (which tensors each parameter holds, their shapes and dtypes, and the non-tensor
entries) comes from the source rank first, so a rank whose state is missing or shaped
differently still takes the same collectives and ends with the source's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.distributed.objects import broadcast_object

_WRAPPERS = {"DistributedDataParallel": "module", "OptimizedModule": "_orig_mod"}

Entry = tuple[str, str, object]
"""``("tensor", key, (shape, dtype, on_cpu))`` or ``("value", key, value)``."""


def ddp_inner(module: nn.Module) -> nn.Module | None:
    """The module a ``DistributedDataParallel`` wraps (known by its type's name, as in
    ``user_module``); None for any other module."""
    if type(module).__name__ != "DistributedDataParallel":
        return None
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) else None


def user_module(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (names without their prefix)."""
    inner = model
    while type(inner).__name__ in _WRAPPERS:
        wrapped = getattr(inner, _WRAPPERS[type(inner).__name__], None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner


def broadcast_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Every rank's parameters, buffers and optimizer state become rank ``src``'s (a global
    rank); ``device``: where the group's collectives run (CUDA for NCCL, CPU for gloo)."""
    inner = user_module(model)
    ignored = set(getattr(inner, "_ddp_params_and_buffers_to_ignore", ()))
    with torch.no_grad():
        for name, param in inner.named_parameters():
            if name not in ignored:
                broadcast_(param.detach(), src, group, device)
        for name, buffer in inner.named_buffers():
            if name not in ignored:
                broadcast_(buffer, src, group, device)
        _broadcast_optimizer(optimizer, src, group, device)


def broadcast_(
    tensor: Tensor, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """``tensor`` takes rank ``src``'s values, in place (sent through ``device``)."""
    wire_dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype
    direct = tensor.device == device and tensor.dtype == wire_dtype and tensor.is_contiguous()
    wire = tensor if direct else tensor.to(device=device, dtype=wire_dtype).contiguous()
    dist.broadcast(wire, src, group=group)
    if wire is not tensor:
        tensor.copy_(wire)


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _layout(optimizer: torch.optim.Optimizer) -> list[list[Entry]]:
    """Per parameter (in ``param_groups`` order): its state entries, sorted by key."""
    layout: list[list[Entry]] = []
    for param in _params(optimizer):
        state = optimizer.state.get(param, {})
        entries: list[Entry] = []
        for key in sorted(state, key=str):
            value = state[key]
            if isinstance(value, Tensor):
                meta = (tuple(value.shape), value.dtype, value.device.type == "cpu")
                entries.append(("tensor", key, meta))
            else:
                entries.append(("value", key, value))
        layout.append(entries)
    return layout


def _broadcast_optimizer(
    optimizer: torch.optim.Optimizer,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    layout = broadcast_object(_layout(optimizer), src, group, device)
    assert isinstance(layout, list)
    for param, entries in zip(_params(optimizer), layout, strict=True):
        if not entries:
            optimizer.state.pop(param, None)
            continue
        state = optimizer.state[param]
        for key in [k for k in state if k not in {e[1] for e in entries}]:
            del state[key]
        for kind, key, meta in entries:
            if kind == "value":
                state[key] = meta
                continue
            target = _state_tensor(state, key, meta, param.device)
            broadcast_(target, src, group, device)


def _state_tensor(state: dict[str, object], key: str, meta: object, home: torch.device) -> Tensor:
    """The local state tensor ``key``, (re)made when missing or shaped differently."""
    assert isinstance(meta, tuple)
    shape, dtype, on_cpu = meta
    current = state.get(key)
    if isinstance(current, Tensor) and tuple(current.shape) == shape and current.dtype == dtype:
        return current
    made = torch.empty(shape, dtype=dtype, device="cpu" if on_cpu else home)
    state[key] = made
    return made
