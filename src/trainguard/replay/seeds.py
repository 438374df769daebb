"""Tag the values that are non-finite before the step: the batch's, the weights', and those of
modules that run outside the model (a loss module's ``weight``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from trainguard.numerics import is_additive_mask
from trainguard.replay.external import external_origin, is_mask
from trainguard.replay.localize import NonFiniteTracer, Origin
from trainguard.replay.values import all_finite, first_nonfinite, plural, value_name


def seed_inputs(
    tracer: NonFiniteTracer,
    batch: Any,
    leaves: Callable[[Any], Any],
    size: int | None,
    name: str = "batch",
) -> list[Origin]:
    """Tag the batch's non-finite tensors (``_seed_inputs``), outside the tracer: a live trace
    seeds from a module hook, while the tracer runs, and its own reads are no op of the step."""
    with _disable_current_modes():
        return _seed_inputs(tracer, batch, leaves, size, name)


def _seed_inputs(
    tracer: NonFiniteTracer,
    batch: Any,
    leaves: Callable[[Any], Any],
    size: int | None,
    name: str,
) -> list[Origin]:
    """Tag the batch's non-finite tensors as ``input`` origins; returns them. A tensor of
    only 0 and -inf is an additive mask carried in the batch (``scores + batch["bias"]``): a
    deliberate ``constant`` origin, as a mask buffer is, not returned (its fully masked rows
    then name the reduction over them: ``masked_row``)."""
    found: list[Origin] = []
    for path, leaf in leaves(batch):
        if not isinstance(leaf, Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            continue
        if not leaf.numel() or all_finite(leaf):
            continue
        index, value, count = first_nonfinite(leaf)
        label = f"{name}{path}"
        if is_additive_mask(leaf):  # only 0 and -inf: a mask carried in the batch
            detail = f"{label} holds {plural(count, '-inf value')} (an additive mask)"
            tracer.seed(leaf, Origin("constant", "-inf", label=label, detail=detail))
            continue
        sample = f", sample {index[0]}" if size and leaf.dim() and leaf.shape[0] == size else ""
        detail = (
            f"{label} holds {plural(count, 'non-finite value')} (first: {value_name(value)} "
            f"at {index}{sample})"
        )
        origin = Origin("input", value_name(value), label=label, detail=detail, inputs_finite=False)
        tracer.seed(leaf, origin)
        found.append(origin)
    return found


def seed_parameters(tracer: NonFiniteTracer, model: nn.Module) -> list[Origin]:
    """Tag the model's non-finite weights and buffers (``_seed_parameters``), outside the
    tracer (see ``seed_inputs``)."""
    with _disable_current_modes():
        return _seed_parameters(tracer, model)


def _seed_parameters(tracer: NonFiniteTracer, model: nn.Module) -> list[Origin]:
    """Tag non-finite weights and buffers as ``parameter`` origins; returns them. A buffer
    whose non-finite values are all -inf is a mask (a causal mask kept as a buffer): it is
    tagged as a deliberate ``constant`` origin instead, and not returned."""
    found: list[Origin] = []
    buffers = list(model.named_buffers())
    named = list(model.named_parameters()) + buffers
    for name, tensor in named:
        if not (tensor.is_floating_point() or tensor.is_complex()) or all_finite(tensor):
            continue
        _, value, count = first_nonfinite(tensor)
        if any(tensor is b for _, b in buffers) and is_mask(tensor):
            detail = f"buffer {name} holds {plural(count, '-inf value')} (a mask)"
            tracer.seed(tensor, Origin("constant", "-inf", label=name, detail=detail))
            continue
        detail = f"{name} holds {plural(count, 'non-finite value')} before the step"
        origin = Origin("parameter", value_name(value), label=name, detail=detail)
        tracer.seed(tensor, origin)
        found.append(origin)
    return found


def seed_outside(tracer: NonFiniteTracer, module: nn.Module) -> list[Origin]:
    """Tag the non-finite parameters and buffers of a module that runs outside the model (a
    loss module: ``nn.CrossEntropyLoss(weight=...)``) as ``external`` origins, made before
    the step (external.py; one of only -inf is a mask); returns them."""
    with _disable_current_modes():
        return _seed_outside(tracer, module)


def _seed_outside(tracer: NonFiniteTracer, module: nn.Module) -> list[Origin]:
    owner = type(module).__name__
    found: list[Origin] = []
    buffers = {id(b) for _, b in module.named_buffers()}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not (tensor.is_floating_point() or tensor.is_complex()) or not tensor.numel():
            continue
        if all_finite(tensor) or tracer.tagged(tensor):
            continue
        kind = "buffer" if id(tensor) in buffers else "parameter"
        what = f"{kind} {name} of {owner} (a module outside the model)"
        origin = external_origin(tensor, f"{owner}.{name}", what)
        tracer.seed(tensor, origin)
        found.append(origin)
    return found
