"""Non-finite tensors made before the step outside the model and the batch.

A loss module's buffers (``nn.CrossEntropyLoss(weight=...)`` with class weights estimated on
a sample that lacked a class: ``1 / 0 = inf``), a tensor the loop or the loss function made
before the step and keeps (a closure, a global): the tracer never saw an op make them, and
they are neither the batch nor the model's weights. Such a tensor is an ``external`` origin,
named by what holds it (the module's buffer, or the argument the first op got it as), its
shape and its first non-finite element. A tensor whose non-finite values are all ``-inf``
is a mask (a causal mask kept as a plain attribute): a deliberate ``constant`` origin.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainguard.replay.hops import Origin
from trainguard.replay.values import first_nonfinite, plural, value_name


def is_mask(tensor: Tensor) -> bool:
    """Every non-finite value is -inf (no NaN, no +inf)."""
    if tensor.is_complex():
        return False
    data = tensor.detach()
    return bool(((data == float("-inf")) | torch.isfinite(data)).all())


def describe(tensor: Tensor) -> str:
    """``float32 [4], holds 1 non-finite value (first: inf at [3])``."""
    index, value, count = first_nonfinite(tensor)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return (
        f"{dtype} {list(tensor.shape)}, holds {plural(count, 'non-finite value')} "
        f"(first: {value_name(value)} at {index})"
    )


def external_origin(tensor: Tensor, label: str, what: str) -> Origin:
    """The origin of ``tensor``, made before the step: ``label`` names what holds it, ``what``
    says so in words (``buffer weight of CrossEntropyLoss (a module outside the model)``)."""
    _, value, count = first_nonfinite(tensor)
    if is_mask(tensor):
        detail = f"{what} holds {plural(count, '-inf value')} (a mask)"
        return Origin("constant", "-inf", label=label, detail=detail)
    detail = f"{what}, {describe(tensor)}, made before the step"
    return Origin("external", value_name(value), label=label, detail=detail)


def argument_name(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensor: Tensor) -> str:
    """The name of the argument of ``func`` that ``tensor`` was passed as (``weight``)."""
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(getattr(schema, "arguments", [])):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is tensor or (
            isinstance(value, (list, tuple)) and any(v is tensor for v in value)
        ):
            return str(arg.name)
    return "?"


def lazy_origin(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensor: Tensor) -> Origin:
    """The origin of a non-finite input no traced op made: made before the step."""
    packet = getattr(func, "overloadpacket", func)
    op = f"aten.{getattr(packet, '__name__', str(packet))}"
    name = argument_name(func, args, kwargs, tensor)
    label = f"argument {name} of {op}"
    return external_origin(tensor, label, f"{label}, a tensor")
