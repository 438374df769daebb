"""A world of one's step row, folded on the host.

With other ranks the row's device columns (``consensus.COLUMNS``) are reduced on the device,
since the all-reduce carries them: the micro-batch losses summed in float64, the gradient
norms stacked and normed, the input tensors reduced to one ``max |x|``. A process alone
reads its row straight back, so it stacks the raw pieces instead, in one float32 ``stack``:
the micro-batch losses, the per-parameter gradient norms and the L2 norms of the step's
input tensors, which ride the gradients' fused ``_foreach_norm`` (``detect.grad_stats``).
The host reduces them after the one read. Per step that is one fused pass and one
``stack`` where the reduced row takes seven device ops, and on a small model the device
ops are most of what a check costs.

The folded values are the reduced ones: the check is the float64 sum of the micro-batch
losses; the gradient norm the float64 root of the sum of squares of the float32 norms
(``total_norm``: NaN when any is NaN, else Inf when any is Inf). Only the input column's
finiteness is read (``Agreement.input_ranks``): it is the largest input norm when every
norm is finite; a non-finite norm (a NaN/Inf input, or a finite input whose float32 sum of
squares overflows: values beyond about 1e19) is confirmed by the exact ``max |x|``
(``confirm``: a host read, on such steps only). Anything else (a loss that is not a float32
scalar on the device, float64 inputs, sharded gradients) keeps the reduced row
(``foldable_losses``, ``InputCheck.foldable``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class FoldedRow:
    """The layout of a folded row: ``[losses..., gradient norms..., input norms...]``."""

    losses: int
    norms: int
    confirm: Callable[[], float]
    """The exact input column (``max |x|`` of the inputs, read on the host): called only when
    an input norm is not finite."""

    def unfold(self, values: list[float]) -> list[float]:
        """The reduced device columns ``[loss, loss_check, grad_norm, input, fingerprint]``."""
        return reduce_row(values, self.losses, self.norms, self.confirm)


def reduce_row(
    values: list[float], losses: int, norms: int, confirm: Callable[[], float]
) -> list[float]:
    """``FoldedRow.unfold`` of a row laid out ``[losses..., norms..., input norms...]``."""
    split = losses + norms
    step_losses = values[:losses]
    check = step_losses[0] if losses == 1 else sum(step_losses)
    inputs = values[split:]
    top = max(inputs, default=0.0)
    if not math.isfinite(top) or not all(map(math.isfinite, inputs)):
        top = confirm()
    reported = check if losses == 1 else check / losses  # the mean of the step's losses
    return [reported, check, total_norm(values[losses:split]), top, 0.0]


def total_norm(norms: list[float]) -> float:
    """The root of the sum of squares of per-tensor norms, in float64, in one C call
    (``math.hypot``); NaN when any is NaN, else Inf when any is Inf, as on the device."""
    norm = math.hypot(*norms)
    if norm == math.inf and any(map(math.isnan, norms)):  # hypot: Inf wins over NaN
        return math.nan
    return norm


def foldable_losses(losses: list[Tensor], device: torch.device) -> bool:
    """Whether every loss is a float32 0-d tensor on ``device`` (a ``stack`` that must convert
    costs more than folding saves)."""
    for loss in losses:  # a loop, not all(...): no generator per step
        if loss.dtype != torch.float32 or loss.dim() != 0 or loss.device != device:
            return False
    return True


def fold(
    losses: list[Tensor],
    norms: list[Tensor],
    input_norms: list[Tensor],
    confirm: Callable[[], float],
) -> tuple[Tensor, FoldedRow]:
    """One float32 ``stack`` of the pieces (``foldable_losses`` checked first) and its
    layout."""
    values = torch.stack([*losses, *norms, *input_norms])
    return values, FoldedRow(len(losses), len(norms), confirm)
