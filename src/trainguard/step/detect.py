"""Local checks of one rank: the loss, and every gradient in one fused pass.

The pass is one ``torch._foreach_norm`` per device (a single read of the gradients, no
``torch.cat``, no per-parameter ``.item()``). The per-parameter norms stay on the device; they
are read back only on a bad step, to name the parameters whose gradients are not finite.
With ``grad_clip`` the same norms give the clip coefficient, so clipping costs no second read.

Gradients that pass refuses (sparse layouts, e.g. ``nn.Embedding(sparse=True)``; float64 or
complex ones, which it cannot accumulate in float32) take the mixed pass instead: a sparse
gradient's norm is that of its stored values (a COO gradient coalesced first, so duplicate
indices are summed as in the dense gradient), the others are normed at their own precision;
clipping multiplies a sparse gradient in place. Dense-only models never see the mixed pass
(it starts when the fused pass raises, or when the caller says it is needed: ``mixed``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from trainguard.numerics import is_sparse, stored_values


@dataclass(slots=True)
class GradStats:
    """The gradient pass of one rank. All tensors live on ``device``; nothing synced yet.

    The per-parameter norms are kept as the fused pass returned them (``per_param``); their
    ``stack`` (``norms``) and the total (``norm``) are built on first read: a world of one
    folds the norms on the host instead (``step/folded_row.py``), two ops fewer a step."""

    names: list[str]
    """Parameter names, aligned with ``per_param``."""
    per_param: list[Tensor]
    """Per-parameter gradient norms (float32 0-d tensors on ``device``)."""
    grads: list[Tensor]
    """The local gradient tensors (shards under FSDP2), for in-place clipping. After the mixed
    pass the sparse ones come last (in ``names`` and ``per_param`` too)."""
    device: torch.device
    mixed: bool = False
    """The gradients took the mixed pass (some are sparse, float64 or complex): pass
    ``mixed=True`` to the next ``grad_stats`` to go there directly."""
    input_norms: list[Tensor] = field(default_factory=list)
    """float32 L2 norms of the tensors given as ``grad_stats(inputs=...)`` (taken in the same
    fused pass), on ``device``."""
    _norms: Tensor | None = field(default=None, init=False, repr=False)
    _norm: Tensor | None = field(default=None, init=False, repr=False)

    @property
    def norms(self) -> Tensor | None:
        """Per-parameter gradient norms (float32, 1-d), or None when no parameter has a
        gradient."""
        if self._norms is None and self.per_param:
            self._norms = torch.stack(self.per_param)
        return self._norms

    @property
    def norm(self) -> Tensor:
        """L2 norm of all the local gradients (float64 scalar, computed in float64).
        Non-finite exactly when some gradient holds NaN/Inf (or has a norm beyond float32):
        squares of finite float32 norms cannot overflow float64."""
        if self._norm is None:
            norms = self.norms
            if norms is None:
                self._norm = torch.zeros((), dtype=torch.float64, device=self.device)
            else:  # NaN/Inf propagate
                self._norm = torch.linalg.vector_norm(norms, dtype=torch.float64)
        return self._norm

    def bad_names(self) -> list[str]:
        """Names of the parameters whose gradients are not finite. Syncs: bad steps only."""
        norms = self.norms
        if norms is None:
            return []
        finite = torch.isfinite(norms).tolist()
        return [name for name, ok in zip(self.names, finite, strict=True) if not ok]


def local_grad(param: Tensor) -> Tensor | None:
    """The gradient this rank holds for ``param``: the local shard of a DTensor gradient."""
    grad = param.grad
    if grad is None:
        return None
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def is_sharded(params: Iterable[Tensor]) -> bool:
    """True when the gradients are DTensor shards (FSDP2): norms must be summed across ranks."""
    return any(hasattr(p.grad, "to_local") for p in params if p.grad is not None)


def _norms(grads: list[Tensor]) -> list[Tensor]:
    try:
        return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    except TypeError:  # torch < 2.3 has no dtype argument
        return [n.float() for n in torch._foreach_norm(grads, 2.0)]


def grad_stats(
    named_params: list[tuple[str, nn.Parameter]],
    device: torch.device,
    sharded: bool = True,
    mixed: bool = False,
    inputs: list[Tensor] | None = None,
) -> GradStats:
    """One fused pass over the local gradients, grouped by device; results land on ``device``.

    ``sharded=False`` skips the DTensor lookup per parameter (plain gradients). ``mixed``: the
    last call's ``GradStats.mixed``; when False the fused pass is tried first and the mixed
    pass runs only if it refuses a gradient, so dense models pay nothing for it. ``inputs``:
    tensors on ``device`` that ``fused_takes`` (the step's input data) whose norms ride the
    same pass (``GradStats.input_norms``): one launch for both."""
    names, grads = local_grads(named_params, sharded)
    extra = inputs or []
    if not mixed and grads:
        try:
            norms = _norms_on(grads + extra, device)
            cut = len(grads)
            return GradStats(names, norms[:cut], grads, device, input_norms=norms[cut:])
        except RuntimeError:  # NotImplementedError too: a sparse gradient, a float64 one
            if all(fused_takes(grad) for grad in grads):
                raise
    input_norms = _norms(extra) if extra else []
    if not grads:
        return GradStats(names, [], [], device, input_norms=input_norms)
    stats = _mixed_stats(names, grads, device)
    stats.input_norms = input_norms
    return stats


def local_grads(
    named_params: list[tuple[str, nn.Parameter]], sharded: bool
) -> tuple[list[str], list[Tensor]]:
    """The names and gradients of the parameters that have one (``sharded``: the local shards)."""
    if sharded:
        found = [(name, grad) for name, p in named_params if (grad := local_grad(p)) is not None]
    else:  # comprehensions, not a loop of appends: a large model has hundreds of gradients
        found = [(name, grad) for name, p in named_params if (grad := p.grad) is not None]
    return [name for name, _ in found], [grad for _, grad in found]


def _norms_on(grads: list[Tensor], device: torch.device) -> list[Tensor]:
    """Per-gradient norms, one fused pass per device, moved to ``device``."""
    first = grads[0].device
    if first == device and all(g.device == first for g in grads):
        return _norms(grads)  # the usual case: one device, nothing to move
    by_device: dict[torch.device, list[int]] = {}
    for i, grad in enumerate(grads):
        by_device.setdefault(grad.device, []).append(i)
    norms: list[Tensor] = [torch.empty(0)] * len(grads)
    for indices in by_device.values():
        for i, norm in zip(indices, _norms([grads[i] for i in indices]), strict=True):
            norms[i] = norm.to(device, non_blocking=True)
    return norms


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What the fused pass accumulates in float32 (``dtype=`` refuses to narrow float64/complex)."""


def fused_takes(grad: Tensor) -> bool:
    """Whether the fused pass accumulates this tensor (strided, float32/16, bfloat16)."""
    return grad.layout == torch.strided and grad.dtype in _FUSED_DTYPES


def _mixed_stats(names: list[str], grads: list[Tensor], device: torch.device) -> GradStats:
    """The mixed pass: strided gradients first, then the sparse ones (normed by their stored
    values); one fused pass per device and dtype."""
    order = sorted(range(len(grads)), key=lambda i: is_sparse(grads[i]))  # stable
    names = [names[i] for i in order]
    grads = [grads[i] for i in order]
    norms = _mixed_norms_on([stored_values(g) for g in grads], device)
    return GradStats(names, norms, grads, device, True)


def _mixed_norms_on(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """float32 norms of strided tensors of any floating or complex dtype, on ``device``."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    for (_, dtype), indices in groups.items():
        group = [tensors[i] for i in indices]
        if dtype in _FUSED_DTYPES:
            found = _norms(group)
        else:  # float64 and complex at their own precision, then float32 like the others
            found = [n.float() for n in torch._foreach_norm(group, 2.0)]
        for i, norm in zip(indices, found, strict=True):
            norms[i] = norm.to(device, non_blocking=True)
    return norms


def loss_value(loss: Tensor) -> Tensor:
    """The loss as a scalar on its device (the float64 mean when it has several elements);
    non-finite when any element is."""
    value = loss.detach() if loss.requires_grad else loss  # a detached loss: no second op
    if value.numel() == 1:
        return value if value.dim() == 0 else value.reshape(())
    return value.double().mean()


def loss_columns(micro_losses: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """The step's two loss columns on ``device`` from its losses (each micro-batch's once,
    ``StepLosses.checked``): the reported loss and the check. One loss: that loss, twice.
    Under gradient accumulation: their mean (reported: the step's loss, NaN/Inf when any is)
    and their float64 sum."""
    if len(micro_losses) == 1:
        only = loss_value(micro_losses[0])
        if only.device != device:
            only = only.to(device, non_blocking=True)
        if only.dtype != torch.float64:  # the row is float64: a stack that must promote costs
            only = only.double()  # several times this conversion (the same value)
        return only, only
    micro = [loss_value(m).to(device, non_blocking=True) for m in micro_losses]
    total = torch.stack(micro).double().sum()
    return total / len(micro), total


def clip_(grads: list[Tensor], total_norm: float, max_norm: float) -> float:
    """Scale the gradients in place so their total norm is at most ``max_norm``.

    ``total_norm`` is the (already agreed) global norm, so every rank applies the same factor.
    Returns the factor applied (1.0 when no clipping was needed).
    """
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0 or not grads:
        return 1.0
    _scale_(grads, coef)
    return coef


def clip_on_device_(grads: list[Tensor], total_norm: Tensor, max_norm: float) -> None:
    """Clip by a global norm that stays on the device (the sync-free path); no host read.

    A non-finite norm makes the factor non-finite too; that step is skipped by ``found_inf``.
    """
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).float()
    _scale_(grads, coef)


def _scale_(grads: list[Tensor], coef: float | Tensor) -> None:
    """Multiply in place: the strided gradients in one fused call per device, the sparse ones
    (last after the mixed pass) one by one, so they keep the dense ones on the fused kernel.
    Any order is correct; a sparse gradient elsewhere only slows its device's call."""
    strided = len(grads)
    while strided and is_sparse(grads[strided - 1]):
        strided -= 1
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads[:strided]:
        by_device.setdefault(grad.device, []).append(grad)
    for device, group in by_device.items():
        torch._foreach_mul_(group, _on(coef, device))
    for grad in grads[strided:]:
        grad.mul_(_on(coef, grad.device))


def _on(coef: float | Tensor, device: torch.device) -> float | Tensor:
    return coef.to(device, non_blocking=True) if isinstance(coef, Tensor) else coef


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters under the user's own names (no ``module.`` / ``_orig_mod.`` wrapper prefix)."""
    inner = model
    for attr in ("module", "_orig_mod"):  # DDP, torch.compile
        wrapped = getattr(inner, attr, None)
        if isinstance(wrapped, nn.Module) and type(inner).__name__ in (
            "DistributedDataParallel",
            "OptimizedModule",
        ):
            inner = wrapped
    return list(inner.named_parameters())
