"""Finding what to guard in a script that says nothing: the model, and whether it may be.

At the first optimizer step ``trainguard run`` knows the optimizer (the hook's argument) and
the modules the step's forward called at the top level (``prestart.PreStart``). The model
is the outermost of those whose parameters hold every parameter of the optimizer: a DDP or
``torch.compile`` wrapper, else the module itself. Pure functions, no hooks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainguard.step.capturer import unwrap
from trainguard.user_hooks import Hook

_FRAMEWORK_GUARDS = ("trainguard.step", "trainguard.health")
"""Modules whose objects hook a model a trainguard ``Guard`` watches."""


def optimizer_params(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of every parameter the optimizer updates."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def model_params(model: nn.Module) -> set[int]:
    """The ids of every parameter of ``model``."""
    return {id(p) for p in model.parameters()}


def over_the_rest(
    optimizer: torch.optim.Optimizer, guarded: torch.optim.Optimizer, model: nn.Module
) -> bool:
    """Whether ``optimizer`` updates only parameters of ``model`` that ``guarded`` does not
    (one model, two optimizers: Muon beside AdamW), and some."""
    params = optimizer_params(optimizer)
    return bool(params) and params <= model_params(model) and not params & optimizer_params(guarded)


DIRECT_FORWARD = (
    "a loop that calls the model's forward itself (model.forward(x), PyTorch's "
    "forward-forward example) runs no module hook: call model(x)"
)
"""The other way a model's forward goes unseen, named with its fix."""


@dataclass(frozen=True)
class Found:
    """The model to guard, or why there is none (``reason``)."""

    model: nn.Module | None
    reason: str = ""


def find_model(candidates: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> Found:
    """The outermost candidate (a module called at the top level with gradients on, in
    training mode) whose parameters include all of the optimizer's; the first such call
    wins when several do."""
    wanted = optimizer_params(optimizer)
    if not wanted:
        return Found(None, "the optimizer has no parameters")
    if not candidates:
        return Found(
            None,
            "no module ran a training forward (grad enabled, train mode) before the first "
            f"optimizer step; {DIRECT_FORWARD}",
        )
    for module in candidates:
        if wanted <= model_params(module):
            return Found(module)
    names = ", ".join(describe_module(m) for m in candidates[:3])
    return Found(
        None,
        f"no module called in the step ({names}) holds all {len(wanted)} parameters of the "
        f"optimizer (several models under one optimizer?); {DIRECT_FORWARD}",
    )


WRAPPER_DEPTH = 8
"""Wrappers looked through by ``in_training`` (DDP around a compiled module, ...)."""


def in_training(module: nn.Module) -> bool:
    """Whether a call of ``module`` is a training call's module: it is in training mode, or a
    wrapper (no parameters of its own, one child: DDP, a compile wrapper, a framework's own)
    around one that is. Lightning's sanity-check validation leaves its DDP wrapper in eval
    mode while the LightningModule inside trains again."""
    inner: nn.Module | None = module
    for _ in range(WRAPPER_DEPTH):
        if inner is None:
            return False
        if inner.training:
            return True
        children = inner._modules
        if len(children) != 1 or inner._parameters:
            return False
        (inner,) = children.values()
    return False


def existing_guard(model: nn.Module) -> str | None:
    """The name of the trainguard object already hooked into ``model`` (a ``Guard`` made by
    the script, Lightning's ``TrainGuard`` callback, the HF ``TrainGuardCallback``), if any."""
    for module in model.modules():
        hooks: Iterable[object] = module._forward_pre_hooks.values()
        for hook in hooks:
            callback = hook.callback if isinstance(hook, Hook) else hook  # the guard's: Hook
            owner = getattr(callback, "__self__", None)
            kind = type(owner)
            if owner is not None and kind.__module__.startswith(_FRAMEWORK_GUARDS):
                return f"{kind.__module__}.{kind.__qualname__}"
    return None


def describe_module(module: nn.Module) -> str:
    """``DistributedDataParallel(GPT)``, ``OptimizedModule(GPT)``, or ``GPT``."""
    inner = unwrap(module)
    if inner is module:
        return type(module).__name__
    return f"{type(module).__name__}({type(inner).__name__})"


def describe(optimizer: torch.optim.Optimizer, model: nn.Module) -> str:
    """``AdamW over DistributedDataParallel(GPT) (1.2M parameters)``."""
    count = sum(p.numel() for p in model.parameters())
    return f"{type(optimizer).__name__} over {describe_module(model)} ({_count(count)} parameters)"


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
